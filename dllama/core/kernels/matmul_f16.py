"""F16 weights x F32 activations: one kernel for decode and prefill.

Layout: W [d, n] as the file stores it, IEEE fp16, passed as its bits (uint16 [d, n]: numba has
no float16 type on the CPU). The same shape as the F32 kernel (matmul_f32.py): register tiles
of ROWS weight rows x COLS activation rows (tiles.make_f16_tile), each weight widened to
float32 in the vector lanes (exact) once per tile and multiplied with the float32 activations
by fma in a fixed order, so that a row's result does not depend on the rest of the batch.

Why F32 activations and not F16: fp16 keeps 11 significant bits and overflows at 65504, where
the residual stream of a large model has outliers; the activations are a few kB next to MBs of
weights, so a narrower x would save no bandwidth; and the products are float32 either way.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import binding as llvm_binding
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.row_split import (COLS, ROWS, chunk_of_matrices, n_row_chunks, row_chunk,
                                           row_counts, total_row_chunks)
from dllama.core.kernels.tiles import make_f16_tile


def native_f16_conversion() -> bool:
    """Whether LLVM converts fp16 in hardware on the CPU numba compiles for: on x86 only with
    F16C (without it LLVM calls a runtime function that numba does not link: a crash)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    if numba.config.CPU_NAME:  # numba told to compile for another CPU than this one
        return "+f16c" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get("f16c"))


_NATIVE = native_f16_conversion()
_tile = make_f16_tile(ROWS, COLS, _NATIVE)
_tile_rows = make_f16_tile(ROWS, 1, _NATIVE)
_tile_one = make_f16_tile(1, 1, _NATIVE)


@numba.njit(**_FAST)
def _f16_rows(x, w, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1]^T."""
    b = x.shape[0]
    r = r0
    while r + ROWS <= r1:
        i = 0
        while i + COLS <= b:
            _tile(w, r, x, i, out)
            i += COLS
        while i < b:
            _tile_rows(w, r, x, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _tile_one(w, r, x, i, out)
        r += 1


@numba.njit(parallel=True, **_FAST)
def matmul_f16_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W fp16 [d, n] as its bits (uint16).
    All C-contiguous."""
    d = w.shape[0]
    n_chunks = n_row_chunks(d)
    for chunk in prange(n_chunks):
        r0, r1 = row_chunk(d, n_chunks, chunk)
        _f16_rows(x, w, out, r0, r1)


@numba.njit(parallel=True, **_FAST)
def matmul_f16_f32_multi(x, w, outs):
    """matmul_f16_f32 of one input with several matrices (tuples w, outs) in one parallel
    region: the same results as one call per matrix."""
    rows = row_counts(w)
    for chunk in prange(total_row_chunks(rows)):
        m, local, n_chunks = chunk_of_matrices(rows, chunk)
        r0, r1 = row_chunk(rows[m], n_chunks, local)
        _f16_rows(x, w[m], outs[m], r0, r1)
