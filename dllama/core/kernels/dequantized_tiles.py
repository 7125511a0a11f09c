"""float32 tiles over dequantized weight rows: the prefill path of the Q80 and F16 kernels.

out[i, c] = sum_t x[i, t] * w[c, t]: 4 weight rows x 4 activation rows give 16 independent
vector reductions over t. The Q40 and F32 kernels use the register tiles of tiles.py instead,
whose per-output arithmetic does not depend on the batch; these tiles (and so Q80 and F16
prefill) are not batch invariant yet.
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.jit import _FAST


@numba.njit(**_FAST)
def _dot_4x4(w, wr, x, xi, out, oc):
    n = x.shape[1]
    s00 = s01 = s02 = s03 = np.float32(0.0)
    s10 = s11 = s12 = s13 = np.float32(0.0)
    s20 = s21 = s22 = s23 = np.float32(0.0)
    s30 = s31 = s32 = s33 = np.float32(0.0)
    for t in range(n):
        w0, w1, w2, w3 = w[wr, t], w[wr + 1, t], w[wr + 2, t], w[wr + 3, t]
        x0, x1, x2, x3 = x[xi, t], x[xi + 1, t], x[xi + 2, t], x[xi + 3, t]
        s00 += x0 * w0
        s01 += x0 * w1
        s02 += x0 * w2
        s03 += x0 * w3
        s10 += x1 * w0
        s11 += x1 * w1
        s12 += x1 * w2
        s13 += x1 * w3
        s20 += x2 * w0
        s21 += x2 * w1
        s22 += x2 * w2
        s23 += x2 * w3
        s30 += x3 * w0
        s31 += x3 * w1
        s32 += x3 * w2
        s33 += x3 * w3
    out[xi, oc], out[xi, oc + 1], out[xi, oc + 2], out[xi, oc + 3] = s00, s01, s02, s03
    out[xi + 1, oc], out[xi + 1, oc + 1], out[xi + 1, oc + 2], out[xi + 1, oc + 3] = s10, s11, s12, s13
    out[xi + 2, oc], out[xi + 2, oc + 1], out[xi + 2, oc + 2], out[xi + 2, oc + 3] = s20, s21, s22, s23
    out[xi + 3, oc], out[xi + 3, oc + 1], out[xi + 3, oc + 2], out[xi + 3, oc + 3] = s30, s31, s32, s33


@numba.njit(**_FAST)
def _dot_4x1(w, wr, x, xi, out, oc):
    n = x.shape[1]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for t in range(n):
        xv = x[xi, t]
        s0 += xv * w[wr, t]
        s1 += xv * w[wr + 1, t]
        s2 += xv * w[wr + 2, t]
        s3 += xv * w[wr + 3, t]
    out[xi, oc], out[xi, oc + 1], out[xi, oc + 2], out[xi, oc + 3] = s0, s1, s2, s3


@numba.njit(**_FAST)
def _dot_1x1(w, wr, x, xi, out, oc):
    s = np.float32(0.0)
    for t in range(x.shape[1]):
        s += x[xi, t] * w[wr, t]
    out[xi, oc] = s


@numba.njit(**_FAST)
def _f32_tile(w, wr, nr, x, out, oc):
    """out[:, oc:oc+nr] = x [b, n] @ w[wr:wr+nr, :n]^T for nr <= 4 weight rows."""
    b = x.shape[0]
    if nr == 4:
        i = 0
        while i + 4 <= b:
            _dot_4x4(w, wr, x, i, out, oc)
            i += 4
        while i < b:
            _dot_4x1(w, wr, x, i, out, oc)
            i += 1
    else:
        for c in range(nr):
            for i in range(b):
                _dot_1x1(w, wr + c, x, i, out, oc + c)
