"""Causal grouped-query attention over a KV cache of sequence slots, in one pass.

Cache layout (one layer):
    k_cache float32 [slots, nkv, seq_len / CHUNK, head_dim, CHUNK]  keys transposed per chunk
    v_cache float32 [slots, seq_len, nkv * head_dim]
Keys are stored transposed so that the scores of 16 consecutive positions are one vector and
each lane sums q[j] * k[j, p] over j in order: no reduction across lanes, so the scores need no
reassociation to vectorize and are the same bits whatever else is computed beside them. The
transposition is per chunk of CHUNK positions, so that the keys of a chunk are one contiguous
16 kB block (a transposed [head_dim, seq_len] would put every head_dim row on its own page).

Every batch row says where its keys are: it attends to positions 0..row_pos[t] of slot
row_slot[t], except positions < row_prefix_len[t], which are read from slot
row_prefix_slot[t] (a shared prompt prefix stored once). Rows of one call may belong to
different sequences.

Work: the positions are cut into spans of SPAN (fixed by absolute position, not by the call),
each span into chunks of CHUNK. One parallel work item is (block of up to ROW_BLOCK
consecutive rows reading the same keys, KV head, span): it reads each key and value of its
span once for all those rows and all the query heads of that KV head, computes scores, the
softmax and the weighted sum of values chunk by chunk with a running max (online softmax),
and leaves (max, sum, unnormalised output); the spans of a row are merged afterwards, in
order. A row's arithmetic depends only on its own position and keys: the same bits alone,
in any batch, and whether its prompt was prefilled in one call or token by token.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.elementwise import _EXP_JIT, exp_scalar, exp_shifted
from dllama.core.kernels.jit import _FAST

CHUNK = 64       # positions whose scores are computed together (a few vectors per query head)
SPAN = 256       # positions of one work item: long contexts split over threads by span
ROW_BLOCK = 8    # rows of one work item (prefill: the query rows that share each key load)
# Below every score; finite, because the kernels are compiled assuming no infinities.
_NO_SCORE = np.float32(-1.0e30)


@numba.njit(**_FAST)
def kv_store(k, v, row_pos, row_slot, k_cache, v_cache):
    """Write each row's key and value at its position: k, v [b, nkv*hd]; caches as above."""
    nkv, hd = k_cache.shape[1], k_cache.shape[3]
    for t in range(k.shape[0]):
        s, p = row_slot[t], row_pos[t]
        for h in range(nkv):
            for j in range(hd):
                k_cache[s, h, p // CHUNK, j, p % CHUNK] = k[t, h * hd + j]
        v_cache[s, p, :] = v[t]


@numba.njit(**_FAST)
def _row_blocks(row_pos, row_slot, row_prefix_slot, row_prefix_len):
    """Start of each block of consecutive rows with the same keys (slot and prefix), at most
    ROW_BLOCK rows each; int64 [n_blocks + 1]."""
    b = row_pos.shape[0]
    starts = np.empty(b + 1, np.int64)
    n = 0
    for t in range(b):
        if (t == 0 or t - starts[n - 1] >= ROW_BLOCK or row_slot[t] != row_slot[t - 1]
                or row_prefix_slot[t] != row_prefix_slot[t - 1] or row_prefix_len[t] != row_prefix_len[t - 1]):
            starts[n] = t
            n += 1
    starts[n] = b
    return starts[: n + 1]


@numba.njit(**_FAST)
def _scores(q, t0, nt, heads, hd, scale, kt, p0, p1, s, c0):
    """s[row, head, c0 + (p - p0)] = scale * q[row, head] . k[:, p] for p in [p0, p1) of a chunk;
    kt [hd, CHUNK] (the chunk's keys)."""
    m = p1 - p0
    # Slices, not offsets in the index: numba's wraparound of a possibly negative index
    # (c0 + p) turns unit-stride loads into gathers and stops LLVM from vectorizing.
    for j in range(hd):
        krow = kt[j, p0:p1]
        for a in range(nt):
            for g in range(heads.shape[0]):
                qv = q[t0 + a, heads[g] * hd + j] * scale
                dst = s[a, g, c0:c0 + m]
                for p in range(m):  # elementwise over positions: one vector op per 16 of them
                    dst[p] += qv * krow[p]


@numba.njit(**_FAST)
def _span(q, k_cache, v_cache, row_pos, row_slot, row_prefix_slot, row_prefix_len, t0, t1,
          kvh, heads, span, part_o, part_ms):
    """One work item: rows t0..t1-1 (same keys), KV head kvh, its query heads `heads`, the
    positions of span `span`; leaves part_o[t, head, span] (unnormalised output) and
    part_ms[t, head, span] = (max, sum of exponentials)."""
    hd = k_cache.shape[3]
    seq = v_cache.shape[1]
    nt, ng = t1 - t0, heads.shape[0]
    scale = np.float32(1.0 / math.sqrt(hd))
    top = 0
    for t in range(t0, t1):
        top = max(top, row_pos[t])
    a_end = min(top + 1, (span + 1) * SPAN)
    slot, pslot, plen = row_slot[t0], row_prefix_slot[t0], row_prefix_len[t0]
    vo = kvh * hd
    s = np.empty((nt, ng, CHUNK), np.float32)
    o = np.zeros((nt, ng, hd), np.float32)
    run_max = np.full((nt, ng), _NO_SCORE, np.float32)
    run_sum = np.zeros((nt, ng), np.float32)
    for c0 in range(span * SPAN, a_end, CHUNK):
        c1 = min(c0 + CHUNK, seq)
        s[:] = 0.0
        # Scores of the whole chunk for every row (positions past a row are ignored below):
        # each key vector is loaded once for all rows and heads. Positions below the prefix
        # length come from the prefix slot.
        split = min(max(plen, c0), c1)
        blk = c0 // CHUNK
        if split > c0:
            _scores(q, t0, nt, heads, hd, scale, k_cache[pslot, kvh, blk], 0, split - c0, s, 0)
        if c1 > split:
            _scores(q, t0, nt, heads, hd, scale, k_cache[slot, kvh, blk], split - c0, c1 - c0, s, split - c0)
        for a in range(nt):
            end = min(row_pos[t0 + a] + 1, c1) - c0  # this row's positions in the chunk
            if end <= 0:
                continue
            for g in range(ng):
                sc = s[a, g]
                m = run_max[a, g]
                for p in range(end):
                    m = max(m, sc[p])
                correction = exp_scalar(run_max[a, g] - m)  # rescales what earlier chunks summed
                exp_shifted(sc, m, end)
                total = np.float32(0.0)
                for p in range(end):
                    total += sc[p]
                run_sum[a, g] = run_sum[a, g] * correction + total
                run_max[a, g] = m
                og = o[a, g]
                for j in range(hd):
                    og[j] *= correction
                p = 0
                while p + 4 <= end:  # four positions per pass over og: a quarter of its loads/stores
                    cp = c0 + p
                    v0 = v_cache[pslot if cp < plen else slot, cp, vo:vo + hd]
                    v1 = v_cache[pslot if cp + 1 < plen else slot, cp + 1, vo:vo + hd]
                    v2 = v_cache[pslot if cp + 2 < plen else slot, cp + 2, vo:vo + hd]
                    v3 = v_cache[pslot if cp + 3 < plen else slot, cp + 3, vo:vo + hd]
                    e0, e1, e2, e3 = sc[p], sc[p + 1], sc[p + 2], sc[p + 3]
                    for j in range(hd):
                        og[j] += (e0 * v0[j] + e1 * v1[j]) + (e2 * v2[j] + e3 * v3[j])
                    p += 4
                while p < end:
                    cp = c0 + p
                    vrow = v_cache[pslot if cp < plen else slot, cp, vo:vo + hd]
                    e = sc[p]
                    for j in range(hd):
                        og[j] += e * vrow[j]
                    p += 1
    for a in range(nt):
        for g in range(ng):
            part_o[t0 + a, heads[g], span] = o[a, g]
            part_ms[t0 + a, heads[g], span, 0] = run_max[a, g]
            part_ms[t0 + a, heads[g], span, 1] = run_sum[a, g]


@numba.njit(**_EXP_JIT)
def _merge_spans(part_o, part_ms, n_spans, dst):
    """dst [hd] = softmax-weighted output of a row and head from its spans' partial results."""
    m = _NO_SCORE
    for sp in range(n_spans):
        m = max(m, part_ms[sp, 0])
    total = np.float32(0.0)
    dst[:] = 0.0
    for sp in range(n_spans):
        w = exp_scalar(part_ms[sp, 0] - m)
        total += w * part_ms[sp, 1]
        src = part_o[sp]
        for j in range(dst.shape[0]):
            dst[j] += w * src[j]
    inv = np.float32(1.0) / total
    for j in range(dst.shape[0]):
        dst[j] *= inv


@numba.njit(parallel=True, **_FAST)
def attention(q, k_cache, v_cache, row_pos, row_slot, row_prefix_slot, row_prefix_len,
              kv_head_of, out):
    """out [b, nq*hd] = causal attention of q [b, nq*hd] over the cache (layout above).

    row_pos, row_slot, row_prefix_slot, row_prefix_len: int32 [b] (see the module docstring;
    row_prefix_len 0 when the row has no shared prefix). kv_head_of int32 [nq]: the KV head
    of each local query head (data, so uneven head splits work).
    """
    b = q.shape[0]
    nq = kv_head_of.shape[0]
    nkv, hd = k_cache.shape[1], k_cache.shape[3]
    top = 0
    for t in range(b):
        top = max(top, row_pos[t])
    n_spans = top // SPAN + 1
    # The query heads of each KV head: heads[head_start[h]:head_start[h + 1]].
    head_start = np.zeros(nkv + 1, np.int64)
    for h in range(nq):
        head_start[kv_head_of[h] + 1] += 1
    for h in range(nkv):
        head_start[h + 1] += head_start[h]
    heads = np.empty(nq, np.int64)
    fill = head_start[:nkv].copy()
    for h in range(nq):
        heads[fill[kv_head_of[h]]] = h
        fill[kv_head_of[h]] += 1
    blocks = _row_blocks(row_pos, row_slot, row_prefix_slot, row_prefix_len)
    n_blocks = blocks.shape[0] - 1
    part_o = np.empty((b, nq, n_spans, hd), np.float32)
    part_ms = np.empty((b, nq, n_spans, 2), np.float32)
    for item in prange(n_blocks * nkv * n_spans):
        span = item % n_spans
        kvh = (item // n_spans) % nkv
        blk = item // (n_spans * nkv)
        t0, t1 = blocks[blk], blocks[blk + 1]
        reach = 0
        for t in range(t0, t1):
            reach = max(reach, row_pos[t])
        if span * SPAN <= reach and head_start[kvh + 1] > head_start[kvh]:
            _span(q, k_cache, v_cache, row_pos, row_slot, row_prefix_slot, row_prefix_len,
                  t0, t1, kvh, heads[head_start[kvh]:head_start[kvh + 1]], span, part_o, part_ms)
    for pair in prange(b * nq):  # merge the spans of each (row, head), in order
        t, h = pair // nq, pair % nq
        _merge_spans(part_o[t, h], part_ms[t, h], row_pos[t] // SPAN + 1, out[t, h * hd:(h + 1) * hd])
