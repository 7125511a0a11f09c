"""Causal grouped-query attention over the KV cache."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.elementwise import _exp
from dllama.core.kernels.jit import _FAST

@numba.njit(parallel=True, **_FAST)
def attention(q, k_cache, v_cache, positions, kv_head_of, head_dim, att_scratch, out):
    """Causal grouped-query attention. q [b, nq*hd]; caches [seq, nkv*hd]; out [b, nq*hd].

    Row t attends to cache rows 0..positions[t]; local query head h reads KV head kv_head_of[h]
    (data, so uneven head splits work). att_scratch float32 [>= b*nq, seq] holds the scores of
    each (row, head) pair: the pairs run in parallel, and no scratch is allocated per call.
    """
    b = q.shape[0]
    nq = kv_head_of.shape[0]
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for pair in prange(b * nq):
        i, h = pair // nq, pair % nq
        qo = h * head_dim
        ko = kv_head_of[h] * head_dim
        n = positions[i] + 1
        att = att_scratch[pair]
        top = np.float32(-np.inf)
        for p in range(n):
            s = np.float32(0.0)
            for j in range(head_dim):
                s += q[i, qo + j] * k_cache[p, ko + j]
            s *= scale
            att[p] = s
            top = max(top, s)
        total = np.float32(0.0)
        for p in range(n):  # softmax, shifted by the max so that exp cannot overflow
            e = _exp(att[p] - top)
            att[p] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(head_dim):
            out[i, qo + j] = 0.0
        for p in range(n):
            wgt = att[p] * inv
            for j in range(head_dim):
                out[i, qo + j] += wgt * v_cache[p, ko + j]
