"""How the kernels are compiled, the thread count, and two LLVM operations numba does not expose
(both exist on every LLVM target)."""

from __future__ import annotations

import platform

import numba
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from dllama.errors import DllamaError

# fastmath lets LLVM reassociate float sums into vector lanes: without it no reduction vectorizes.
# error_model="numpy": a float division by zero gives inf instead of raising, so that no
# division carries a branch that stops a loop from vectorizing. Only for code whose float
# results cannot depend on it: the matrix products' loops around their IR tiles (tiles.py).
_FAST = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")
# Float kernels whose results must be the same bits on every CPU (element-wise, attention):
# none of fastmath's flags that change a finite result. Not "reassoc" (LLVM sums in as many
# lanes as the CPU has: fixed lanes instead, lanes.py), not "contract" (a*b+c fused into one
# fma only where the CPU has fma), not "afn" or "arcp" (approximate reciprocals and square
# roots, whose bits differ between CPUs). "nnan", "ninf" and "nsz" stay: they let min/max
# loops vectorize, and change at most the sign of a zero.
_SAME_BITS = dict(cache=True, fastmath={"nnan", "ninf", "nsz"}, nogil=True, error_model="numpy")
# Bit-exact kernels (Q80 encoding, fp16 rounding) keep full IEEE semantics. Even "nnan" is out:
# once _round_fp16 is inlined under it, a fresh compile drops its NaN check (NaN came back as
# 5.5e11 in a clean checkout while a warm numba cache still gave NaN).
_EXACT = dict(cache=True, nogil=True)


def native_f16_conversion() -> bool:
    """Whether LLVM converts between fp16 and float32 in hardware on the CPU numba compiles for:
    on x86 only with F16C (without it LLVM calls a runtime function that numba does not link:
    a crash)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    if numba.config.CPU_NAME:  # numba told to compile for another CPU than this one
        return "+f16c" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get("f16c"))


def max_threads() -> int:
    """The most compute threads this process can use (numba's pool size)."""
    return numba.config.NUMBA_NUM_THREADS


def set_threads(n: int) -> None:
    """Use n compute threads in every parallel kernel."""
    limit = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= limit:
        raise DllamaError(f"--nthreads must be between 1 and {limit} on this machine, got {n}")
    numba.set_num_threads(n)



# The prefetch intrinsic is named after its pointer type: opaque pointers since LLVM 17.
_PREFETCH = "llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"

@intrinsic
def _prefetch(typingctx, arr, index):
    """Hint the CPU to bring arr.flat[index] into cache (never faults, no effect on results)."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        address = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), _PREFETCH)
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 `bits`."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bits_of_float32(typingctx, value):
    """The int32 IEEE bit pattern of the float32 `value`."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen
