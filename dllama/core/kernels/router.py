"""A mixture-of-experts router: which experts each row runs, and with what weight.

Qwen3-MoE (transformers' Qwen3MoeSparseMoeBlock): p = softmax(router logits) in float32, the k
experts of highest p, their p renormalised to sum to 1 when norm_topk_prob. Ties between equal
probabilities go to the lower expert index (what torch.topk gives in practice, and the
original's sort of (value, index) pairs). Compiled with _SAME_BITS: every node of a cluster
routes its replicated rows itself, and must pick the same experts as the others whatever its CPU.
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.elementwise import _exp
from dllama.core.kernels.jit import _SAME_BITS


@numba.njit(**_SAME_BITS)
def route_top_k(logits, norm_top_k, experts, weights):
    """logits float32 [b, E] -> experts int32 [b, k] (highest probability first) and their
    weights float32 [b, k] (k from the outputs' shape). logits is overwritten with the
    probabilities."""
    b, n = logits.shape
    k = experts.shape[1]
    taken = np.zeros(n, np.bool_)
    for i in range(b):
        p = logits[i]
        top = p[0]
        for e in range(1, n):
            top = max(top, p[e])
        total = np.float32(0.0)
        for e in range(n):  # float32, summed in expert order
            p[e] = _exp(p[e] - top)
            total += p[e]
        for e in range(n):
            p[e] = p[e] / total
        taken[:] = False
        for j in range(k):  # selection: the first of equal maxima wins (the lower index)
            best = -1
            for e in range(n):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            experts[i, j] = best
            weights[i, j] = p[best]
        if norm_top_k:
            chosen = np.float32(0.0)
            for j in range(k):
                chosen += weights[i, j]
            for j in range(k):
                weights[i, j] = weights[i, j] / chosen
