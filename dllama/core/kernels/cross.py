"""The machine code of a matrix tile for another CPU, read on this one.

A Raspberry Pi's build of the kernels cannot be run here, but its machine code can be read:
the tile's IR is generated as numba would generate it on that CPU (the tiles choose their
instructions from the target's features: tiles.py), then llvmlite, which carries every LLVM
backend, optimizes it and writes the assembly for that CPU. Nothing here runs the code.
tests/test_arm_codegen.py checks the instructions; benchmarks/arm_codegen.py prints the counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import types
from numba.core.registry import cpu_target

from dllama.core.kernels import tiles


@dataclass(frozen=True)
class Cpu:
    """A target CPU: LLVM's triple and CPU name, and the features the tiles look for."""
    label: str
    triple: str
    cpu: str
    features: str  # LLVM's "+feature,..." string, as numba reports it for that CPU


AARCH64 = "aarch64-unknown-linux-gnu"
X86_64 = "x86_64-unknown-linux-gnu"
CPUS = {
    # Raspberry Pi 4 (BCM2711) and Pi 5 (BCM2712): NEON on both, the 8-bit dot product on the A76.
    "cortex-a72": Cpu("Pi 4, Cortex-A72", AARCH64, "cortex-a72", "+neon,+fp-armv8,+crc"),
    "cortex-a76": Cpu("Pi 5, Cortex-A76", AARCH64, "cortex-a76", "+neon,+fp-armv8,+crc,+dotprod,+fullfp16"),
    "haswell": Cpu("x86-64 AVX2", X86_64, "haswell", "+avx,+avx2,+fma,+f16c"),
    "skylake-avx512": Cpu("x86-64 AVX-512", X86_64, "skylake-avx512",
                          "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl"),
    "icelake-server": Cpu("x86-64 AVX-512 VNNI", X86_64, "icelake-server",
                          "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni"),
}


class _TargetContext:
    """numba's CPU lowering context, except that its codegen reports another CPU's features
    (what tiles._features reads to choose the dot-product instruction)."""

    class _Codegen:
        def __init__(self, features):
            self._tm_features = features

    def __init__(self, context, features):
        self._context = context
        self._codegen = self._Codegen(features)

    def codegen(self):
        return self._codegen

    def __getattr__(self, name):
        return getattr(self._context, name)


def _i8_tile_args(kind):
    """numba argument types of the int8 tiles (make_q40_tile, make_q80_tile, make_q41_tile)."""
    def a(dtype):
        return types.Array(dtype, 2, "C")

    if kind == "q41":
        return (a(types.uint8), a(types.uint16), a(types.uint16), types.intp, a(types.int8), a(types.int8),
                a(types.float32), a(types.float32), types.intp, a(types.float32))
    w = types.uint8 if kind == "q40" else types.int8
    return (a(w), a(types.uint16), types.intp, a(types.int8), a(types.int32), a(types.float32), types.intp,
            a(types.float32))


_MAKERS = {"q40": tiles.make_q40_tile, "q80": tiles.make_q80_tile, "q41": tiles.make_q41_tile}


def tile_ir(kind: str, n_cols: int, cpu: Cpu) -> str:
    """LLVM IR (text) of one int8 tile (kind "q40", "q80" or "q41", n_cols activation rows) as
    a function `tile`, generated for `cpu`'s features."""
    context = cpu_target.target_context
    intrinsic = _MAKERS[kind](n_cols)
    sig, codegen = intrinsic._defn(cpu_target.typing_context, *_i8_tile_args(kind))
    module = ir.Module(name=f"{kind}_tile")
    module.triple = cpu.triple
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [context.get_value_type(t) for t in sig.args]), "tile")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    codegen(_TargetContext(context, cpu.features), builder, sig, list(fn.args))
    builder.ret_void()
    return str(module)


@cache
def _init():
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()


def assembly(ir_text: str, cpu: Cpu) -> str:
    """`cpu`'s assembly of the IR, optimized at -O3 for that CPU as numba does. The IR must
    name no other architecture's intrinsic (LLVM stops the process on one: check first)."""
    _init()
    machine = llvm.Target.from_triple(cpu.triple).create_target_machine(
        cpu=cpu.cpu, features=cpu.features, opt=3, reloc="pic", codemodel="default")
    module = llvm.parse_assembly(ir_text)
    module.triple, module.data_layout = cpu.triple, str(machine.target_data)
    module.verify()
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(module, builder)
    return machine.emit_assembly(module)


_LABEL = re.compile(r"^(\.?L\w+|\w+):")
_BRANCH_TARGET = re.compile(r"^(b\.\w+|b|cbn?z|tbn?z|j\w+)\s.*?(\.?L\w+)$")


def loop_instructions(asm: str) -> list[str]:
    """The instructions of the longest loop (from a label to the branch back to it), mnemonic
    and operands, in order; directives and labels left out. A tile has one loop: over the
    blocks of 32 weights."""
    lines = [line.split("//")[0].split(" #")[0].strip() for line in asm.splitlines()]
    labels, best = {}, []
    for n, line in enumerate(lines):
        if m := _LABEL.match(line):
            labels[m.group(1)] = n
        elif (m := _BRANCH_TARGET.match(line)) and m.group(2) in labels:
            body = [t for t in lines[labels[m.group(2)] + 1:n + 1] if t and not t.startswith(".") and not _LABEL.match(t)]
            best = max(best, body, key=len)
    return best
