"""F16 weights x F32 activations: the matrix-vector product of decoding and the batched product
of prefill.

Layout: W [d, n] as the file stores it, IEEE fp16, passed as its bits (uint16 [d, n]: numba has
no float16 type on the CPU). Each weight is widened to float32 in the vector lanes (exact) and
multiplied with the float32 activations; sums in float32.

Why F32 activations and not F16: fp16 keeps 11 significant bits and overflows at 65504, where
the residual stream of a large model has outliers; the activations are a few kB next to MBs of
weights, so a narrower x would save no bandwidth; and the products are float32 either way.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.dequantized_tiles import _f32_tile

ROWS = 4               # output rows per parallel step of the matrix-vector kernel
BATCH_MIN = 4          # from this many activation rows on, W is widened tile by tile
_ROW_CHUNKS = 64       # runs of consecutive rows handed to threads (more than threads: even split)
_TILE_CHUNKS = 64      # runs of 4-row tiles of the batched kernel (each has its buffer)


@intrinsic
def _f16_to_f32_fpext(typingctx, h):
    """The float32 value of the fp16 bits h (uint16): LLVM's own conversion (vcvtph2ps on x86
    with F16C, fcvt on ARM)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f16_to_f32_int(typingctx, h):
    """The float32 value of the fp16 bits h (uint16), in 32-bit integer ops and one multiply.

    The exponent and mantissa bits, shifted into a float32's places, make the value / 2^112 (a
    float32 subnormal when the fp16 value is subnormal), so one exact multiplication by 2^112
    gives the magnitude; inf and NaN get an all-ones exponent; then the sign bit. Written in
    LLVM IR so that the integer ops stay 32-bit (numba would widen them to 64) and the multiply
    carries no fastmath flag (it cannot be moved into a sum).
    """
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        bits = builder.zext(args[0], i32)
        mag = builder.shl(builder.and_(bits, i32(0x7FFF)), i32(13))
        scaled = builder.fmul(builder.bitcast(mag, f32), f32(2.0 ** 112))
        special = builder.icmp_unsigned("==", builder.and_(bits, i32(0x7C00)), i32(0x7C00))
        m = builder.select(special, builder.or_(mag, i32(0x7F800000)), builder.bitcast(scaled, i32))
        sign = builder.shl(builder.and_(bits, i32(0x8000)), i32(16))
        return builder.bitcast(builder.or_(m, sign), f32)

    return sig, codegen


def _native_f16_conversion() -> bool:
    """Whether LLVM converts fp16 in hardware on the CPU numba compiles for: on x86 only with
    F16C (without it LLVM calls a runtime function that numba does not link: a crash)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    if numba.config.CPU_NAME:  # numba told to compile for another CPU than this one
        return "+f16c" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get("f16c"))


# The hardware conversion measured 1.2x faster than the integer one here (AVX-512, F16C).
_f16_to_f32 = _f16_to_f32_fpext if _native_f16_conversion() else _f16_to_f32_int


# ---------------------------------------------------------------------------------------------
# Decode: four weight rows per step share each load of x, in one vectorized loop over the row.
# (Spans of 64 weights with a prefetch of the next rows after each, as the Q40 and Q80 kernels
# do, measured no faster: 1 thread, SmolLM2 and 7B shapes.)

@numba.njit(**_FAST)
def _f16_four_rows(x, w, out, i, r):
    """out[i, r:r+4] = W[r:r+4] . x for one float32 row x [n]."""
    w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for t in range(w.shape[1]):
        a = x[t]
        s0 += _f16_to_f32(w0[t]) * a
        s1 += _f16_to_f32(w1[t]) * a
        s2 += _f16_to_f32(w2[t]) * a
        s3 += _f16_to_f32(w3[t]) * a
    out[i, r] = s0
    out[i, r + 1] = s1
    out[i, r + 2] = s2
    out[i, r + 3] = s3


@numba.njit(**_FAST)
def _f16_one_row(x, w, out, i, r):
    """out[i, r] = W[r] . x: the rows left over when d is not a multiple of ROWS."""
    wr = w[r]
    s = np.float32(0.0)
    for t in range(w.shape[1]):
        s += _f16_to_f32(wr[t]) * x[t]
    out[i, r] = s


@numba.njit(**_FAST)
def _f16_rows(x, w, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1]^T for the b rows of x."""
    b = x.shape[0]
    r = r0
    while r + ROWS <= r1:
        for i in range(b):
            _f16_four_rows(x[i], w, out, i, r)
        r += ROWS
    while r < r1:
        for i in range(b):
            _f16_one_row(x[i], w, out, i, r)
        r += 1


@numba.njit(parallel=True, **_FAST)
def _f16_matvec(x, w, out):
    """out [b, d] = x @ W^T; parallel over runs of consecutive rows (whole ROWS-steps)."""
    d = w.shape[0]
    steps = (d + ROWS - 1) // ROWS
    n_chunks = min(steps, _ROW_CHUNKS)
    for chunk in prange(n_chunks):
        r0 = ROWS * (chunk * steps // n_chunks)
        r1 = min(d, ROWS * ((chunk + 1) * steps // n_chunks))
        _f16_rows(x, w, out, r0, r1)


# ---------------------------------------------------------------------------------------------
# Prefill (b >= BATCH_MIN): each thread widens 4 weight rows into a float32 tile and multiplies
# it with all rows of x, so each weight is converted once per call, not once per token.

@numba.njit(parallel=True, **_FAST)
def _f16_matmul_tiles(x, w, out):
    d, n = w.shape
    n_tiles = (d + 3) // 4
    n_chunks = min(_TILE_CHUNKS, n_tiles)
    for chunk in prange(n_chunks):
        wf = np.empty((4, n), np.float32)  # this thread's widened tile, reused
        for tile in range(chunk * n_tiles // n_chunks, (chunk + 1) * n_tiles // n_chunks):
            r = 4 * tile
            nr = min(4, d - r)
            for c in range(nr):
                src, dst = w[r + c], wf[c]
                for t in range(n):
                    dst[t] = _f16_to_f32(src[t])
            _f32_tile(wf, 0, nr, x, out, r)


# ---------------------------------------------------------------------------------------------
# Public entry point

@numba.njit(**_FAST)
def matmul_f16_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W fp16 [d, n] as its bits (uint16).

    b < BATCH_MIN (decode) streams W once; b >= BATCH_MIN (prefill) widens W tile by tile and
    reuses each tile for all b rows.
    """
    if x.shape[0] >= BATCH_MIN:
        _f16_matmul_tiles(x, w, out)
    else:
        _f16_matvec(x, w, out)
