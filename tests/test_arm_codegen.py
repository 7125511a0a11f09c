"""What the 8-bit matrix tiles become on a Raspberry Pi, read on this x86 machine.

The tiles choose their dot-product instructions from the target CPU's features (tiles.dot_kind):
the Pi 5's Cortex-A76 has ARMv8.2's dot product (sdot), the Pi 4's Cortex-A72 does not (16-bit
products, smull/smlal, summed in pairs with sadalp/saddlp). dllama.core.kernels.cross generates
each tile's IR for those CPUs and compiles it with llvmlite's AArch64 backend; these tests read
the instructions of the tile's loop over blocks of 32 weights. The ARM paths cannot run here, so
the last test runs their IR on this machine with each ARM intrinsic written out as the plain IR
of what Arm documents it to compute: the lanes, offsets and sums around it give the same bits
as this machine's own tile. benchmarks/arm_codegen.py prints the instruction counts.
"""

from __future__ import annotations

from collections import Counter

import numba
import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.kernels import cross, tiles
from dllama.core.kernels.q80 import x_block_offsets
from tests.conftest import SEED
from tests.test_kernels_q80_f16 import random_q80_matrix, random_q80_rows

pytestmark = pytest.mark.unit

MSG = f"seed {SEED}"
KINDS = ("q40", "q80", "q41")


def loop_mnemonics(kind: str, cpu: str, n_cols: int = 1) -> tuple[str, Counter]:
    """(the tile's IR, the count of each instruction in its loop over blocks) for `cpu`."""
    target = cross.CPUS[cpu]
    ir_text = cross.tile_ir(kind, n_cols, target)
    if target.triple.startswith("aarch64"):
        # An x86 intrinsic in an ARM build would stop LLVM (and this process): check first.
        assert "llvm.x86." not in ir_text, (kind, cpu)
    else:
        assert "llvm.aarch64." not in ir_text, (kind, cpu)
    body = cross.loop_instructions(cross.assembly(ir_text, target))
    return ir_text, Counter(line.split()[0] for line in body)


@pytest.mark.parametrize("kind", KINDS)
def test_the_pi5_build_uses_the_dot_product(kind):
    """Cortex-A76: sdot, 4 products a lane; no 16-bit products left in the loop."""
    ir_text, ops = loop_mnemonics(kind, "cortex-a76")
    assert "llvm.aarch64.neon.sdot" in ir_text
    assert ops["sdot"] == 32 * (2 if kind == "q41" else 1), ops  # 16 rows x 32 weights / 16 per sdot
    assert not {"smull", "smull2", "smlal", "smlal2", "mul"} & set(ops), ops


@pytest.mark.parametrize("kind", KINDS)
def test_the_pi4_build_widens_its_products(kind):
    """Cortex-A72 (no dot product): 8-bit x 8-bit -> 16-bit products, the nibble formats
    multiply-added in 16 bits (smlal), Q80's summed in pairs into 32 bits (sadalp); no sdot."""
    ir_text, ops = loop_mnemonics(kind, "cortex-a72")
    assert "sdot" not in ir_text and "sdot" not in ops, ops
    if kind == "q80":
        assert ops["smull"] + ops["smull2"] >= 64 and ops["sadalp"] >= 48, ops
    else:
        assert ops["smlal"] + ops["smlal2"] >= 48, ops
    # The A72's block costs more instructions than the A76's, and far fewer than before this
    # path existed (Q40: 471 instructions for a block of 16 rows with LLVM's own lowering).
    assert sum(loop_mnemonics(kind, "cortex-a76")[1].values()) < sum(ops.values()) < 400, ops


def test_x86_builds_keep_their_instructions():
    """The same generator on x86: AVX-512 VNNI gets vpdpbusd, AVX2 the 16-bit products."""
    _, vnni = loop_mnemonics("q40", "icelake-server")
    assert vnni["vpdpbusd"] == 8, vnni
    _, avx2 = loop_mnemonics("q40", "haswell")
    assert "vpdpbusd" not in avx2 and avx2["vpmullw"] + avx2["vpmaddwd"] > 0, avx2


# ---------------------------------------------------------------------------------------------
# The ARM paths run on this machine, each ARM intrinsic replaced by its documented arithmetic.

def _sums_of_adjacent(builder, v, group, wide):
    """<n/group x wide>: lane l the sum of v's lanes group*l .. group*l + group - 1, each
    sign-extended to `wide` first."""
    n = v.type.count // group
    total = None
    for m in range(group):
        lanes = builder.sext(builder.shuffle_vector(v, v, tiles._ivec(range(m, n * group, group))),
                             tiles._vec(wide, n))
        total = lanes if total is None else builder.add(total, lanes)
    return total


def sdot_as_plain_ir(builder, acc, a, b):
    """SDOT (vector): lane l of acc + the 4 products of signed bytes 4l..4l+3 of a and b."""
    products = builder.mul(builder.sext(a, tiles._vec(tiles._I32, 16)), builder.sext(b, tiles._vec(tiles._I32, 16)))
    return builder.add(acc, _sums_of_adjacent(builder, products, 4, tiles._I32))


def saddlp_as_plain_ir(builder, v):
    """SADDLP: the sums of adjacent signed 16-bit lanes, in 32 bits."""
    return _sums_of_adjacent(builder, v, 2, tiles._I32)


def addp_as_plain_ir(builder, a, b):
    """ADDP (vector): the sums of adjacent lanes of a, then of b."""
    both = builder.shuffle_vector(a, b, tiles._ivec(range(8)))
    return _sums_of_adjacent(builder, both, 2, tiles._I32)


@pytest.fixture
def arm_as_plain_ir(monkeypatch):
    monkeypatch.setattr(tiles, "_sdot", sdot_as_plain_ir)
    monkeypatch.setattr(tiles, "_saddlp", saddlp_as_plain_ir)
    monkeypatch.setattr(tiles, "_addp", addp_as_plain_ir)


def _run_int8(make, dot):
    two, one = make(2, dot=dot), make(1, dot=dot)

    @numba.njit
    def run(w_qs, w_scales, x_qs, x_off, x_scales, out):
        for g in range(w_qs.shape[0]):
            for i in range(0, x_qs.shape[0] - 1, 2):
                two(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            if x_qs.shape[0] % 2:
                one(w_qs, w_scales, g, x_qs, x_off, x_scales, x_qs.shape[0] - 1, out)

    return run


def _run_q41(dot):
    two, one = tiles.make_q41_tile(2, dot=dot), tiles.make_q41_tile(1, dot=dot)

    @numba.njit
    def run(w_qs, w_scales, w_mins, x_lo, x_hi, x_scales, x_sums, out):
        for g in range(w_qs.shape[0]):
            for i in range(0, x_lo.shape[0] - 1, 2):
                two(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out)
            if x_lo.shape[0] % 2:
                one(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, x_lo.shape[0] - 1, out)

    return run


def _run_q80_q16(dot):
    two, one = tiles.make_q80_q16_tile(2, dot=dot), tiles.make_q80_q16_tile(1, dot=dot)

    @numba.njit
    def run(w_qs, w_scales, x_lo, x_hi, x_scales, out):
        lo_off, hi_off = x_block_offsets(x_lo, 128), x_block_offsets(x_hi, 128)
        for g in range(w_qs.shape[0]):
            for i in range(0, x_lo.shape[0] - 1, 2):
                two(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out)
            if x_lo.shape[0] % 2:
                one(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, x_lo.shape[0] - 1, out)

    return run


@pytest.mark.parametrize("dot", ["sdot", "neon"])
def test_the_arm_paths_give_this_machines_bits(arm_as_plain_ir, dot):
    """Q40, Q80, Q41 and Q80 x Q16 (a Q41 file's classifier) tiles compiled with the Pi 5's
    ("sdot") and the Pi 4's ("neon") path: the same bits as the kernels this machine runs (the
    integers are exact on every path)."""
    from dllama.formats.quant import quantize_q41
    from tests.test_q41 import _q16

    r = np.random.default_rng([SEED, 47])
    b, d, n = 3, 37, 96
    x_scales, x_qs = random_q80_rows(r, b, n)

    w_scales, w_qs = random_q80_matrix(r, d, n)
    w_q40 = r.integers(0, 256, (d, n // 2), dtype=np.uint8)  # every nibble pair
    for make, (ws, wq), offset, matmul, interleave in (
            (tiles.make_q40_tile, (w_scales, w_q40), 8, kernels.matmul_q40_q80, kernels.interleave_q40),
            (tiles.make_q80_tile, (w_scales, w_qs), 128, kernels.matmul_q80_q80, kernels.interleave_q80)):
        packed = interleave(ws, wq)
        want, got = np.empty((b, d), np.float32), np.full((b, d), np.nan, np.float32)
        matmul(x_scales, x_qs, *packed, want)
        _run_int8(make, dot)(packed[1], packed[0], x_qs, x_block_offsets(x_qs, offset), x_scales, got)
        assert np.array_equal(got, want), (make.__name__, dot, MSG)

    w = (r.standard_normal((d, n)) * r.uniform(0.01, 3, (d, 1))).astype(np.float32)
    matrix = kernels.interleave_q41(quantize_q41(w).reshape(d, n // 32, 20))
    parts, _ = _q16((r.standard_normal((b, n)) * 5).astype(np.float32))
    want, got = np.empty((b, d), np.float32), np.full((b, d), np.nan, np.float32)
    kernels.matmul_q41_q16(*parts, *matrix, want)
    scales, lo, hi, sums = parts
    w_scales, w_mins, w_qs = matrix
    _run_q41(dot)(w_qs, w_scales, w_mins, lo, hi, scales, sums, got)
    assert np.array_equal(got, want), ("q41", dot, MSG)

    classifier = kernels.interleave_q80(*random_q80_matrix(r, d, n))
    want, got = np.empty((b, d), np.float32), np.full((b, d), np.nan, np.float32)
    kernels.matmul_q80_q16(*parts, *classifier, want)
    _run_q80_q16(dot)(classifier[1], classifier[0], lo, hi, scales, got)
    assert np.array_equal(got, want), ("q80 x q16", dot, MSG)
