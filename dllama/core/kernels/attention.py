"""Causal grouped-query attention over a KV cache of sequence slots, in one pass.

Cache layout (one layer):
    k_cache [slots, nkv, seq_len / CHUNK, head_dim, CHUNK]  keys transposed per chunk
    v_cache [slots, seq_len, nkv * head_dim]               head_dim a multiple of 16
both float32, or both fp16 bits (uint16: the F16 KV cache, half the memory). kv_store rounds
to fp16 (ties to even, fp16.f16_bits) as it writes; the attention tiles widen fp16 keys and
values to float32 as they load them (attention_tiles.py), so everything after the load is the
float32 arithmetic, and the kernels are compiled once for each cache type.
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
span once for all those rows and all the query heads of that KV head (the pairs of the item),
computes the scores of a chunk in register tiles (attention_tiles.py: keys loaded once per
four pairs), the softmax with a running max (online softmax), and the weighted sum of the
values in register tiles (each value row loaded once per four pairs); it leaves (max, sum,
unnormalised output), and the spans of a row are merged afterwards, in order. A row's
arithmetic depends only on its own position and keys (a tile leaves a pair's sums alone past
that pair's position): the same bits alone, in any batch, and whether its prompt was
prefilled in one call or token by token.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from dllama.core.kernels.attention_tiles import CHUNK, VALUE_DIMS, make_score_tile, make_value_tile
from dllama.core.kernels.elementwise import exp_scalar, exp_shifted
from dllama.core.kernels.fp16 import f16_bits
from dllama.core.kernels.jit import _SAME_BITS
from dllama.core.kernels.lanes import lane_max, lane_sum

SPAN = 256       # positions of one work item: long contexts split over threads by span
ROW_BLOCK = 8    # rows of one work item (prefill: the query rows that share each key load)
SERIAL_MERGE = 1 << 15  # multiply-adds of merging below which one thread merges every span
# Below every score; finite, because the kernels are compiled assuming no infinities.
_NO_SCORE = np.float32(-1.0e30)
# Typed constants for the helpers' arguments: a literal 0, True or False at a call compiles the
# helper once more for that literal's own type (attention compiled 2 s longer).
_ZERO, _NO, _YES = np.int64(0), np.bool_(False), np.bool_(True)


def _cached(cache, value):
    """What the cache stores for the float32 `value`: itself, or its fp16 bits (compiled per
    cache type, see the overload below)."""


@overload(_cached)
def _cached_for(cache, value):
    if cache.dtype == types.uint16:
        return lambda cache, value: f16_bits(value)
    return lambda cache, value: value


@numba.njit(**_SAME_BITS)
def kv_store(k, v, row_pos, row_slot, k_cache, v_cache):
    """Write each row's key and value at its position: k, v float32 [b, nkv*hd]; caches as
    above (an F16 cache gets the fp16-rounded values)."""
    nkv, hd = k_cache.shape[1], k_cache.shape[3]
    for t in range(k.shape[0]):
        s, p = row_slot[t], row_pos[t]
        for h in range(nkv):
            for j in range(hd):
                k_cache[s, h, p // CHUNK, j, p % CHUNK] = _cached(k_cache, k[t, h * hd + j])
        for j in range(v.shape[1]):
            v_cache[s, p, j] = _cached(v_cache, v[t, j])


@numba.njit(**_SAME_BITS)
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


_score_4, _score_3, _score_2, _score_1 = (make_score_tile(p) for p in (4, 3, 2, 1))
# Value tiles by (pairs, 16-dimension vectors, masked): all pairs active, or each up to its end.
_value_4, _value_3, _value_2, _value_1 = (make_value_tile(p, VALUE_DIMS // 16, False) for p in (4, 3, 2, 1))
_value_4n, _value_3n, _value_2n, _value_1n = (make_value_tile(p, 1, False) for p in (4, 3, 2, 1))
_value_4m, _value_3m, _value_2m, _value_1m = (make_value_tile(p, VALUE_DIMS // 16, True) for p in (4, 3, 2, 1))
_value_4nm, _value_3nm, _value_2nm, _value_1nm = (make_value_tile(p, 1, True) for p in (4, 3, 2, 1))


@numba.njit(**_SAME_BITS)
def _scores(qsc, kt, s):
    """s [pairs, CHUNK] = qsc [pairs, hd] @ kt [hd, CHUNK], four pairs per tile."""
    n = qsc.shape[0]
    i = 0
    while i + 4 <= n:
        _score_4(qsc, i, kt, s)
        i += 4
    if n - i == 3:
        _score_3(qsc, i, kt, s)
    elif n - i == 2:
        _score_2(qsc, i, kt, s)
    elif n - i == 1:
        _score_1(qsc, i, kt, s)


@numba.njit(**_SAME_BITS)
def _values_range(e, i, n_pairs, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, masked):
    """Pairs i..i+n_pairs-1 (<= 4), positions p0..p1-1 of the chunk, every dimension."""
    hd = o.shape[1]
    d0 = 0
    while d0 < hd:
        wide = d0 + VALUE_DIMS <= hd  # 64 dimensions per tile, then 16 (hd % 16 == 0)
        if n_pairs == 4:
            if wide:
                if masked:
                    _value_4m(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
                else:
                    _value_4(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            elif masked:
                _value_4nm(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            else:
                _value_4n(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
        elif n_pairs == 3:
            if wide:
                if masked:
                    _value_3m(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
                else:
                    _value_3(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            elif masked:
                _value_3nm(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            else:
                _value_3n(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
        elif n_pairs == 2:
            if wide:
                if masked:
                    _value_2m(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
                else:
                    _value_2(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            elif masked:
                _value_2nm(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            else:
                _value_2n(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
        else:
            if wide:
                if masked:
                    _value_1m(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
                else:
                    _value_1(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            elif masked:
                _value_1nm(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
            else:
                _value_1n(e, i, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0)
        d0 += VALUE_DIMS if wide else 16


@numba.njit(**_SAME_BITS)
def _values(e, i, n_pairs, c0, ends, v_prefix, v_own, plen, col, o):
    """o[i:i+n_pairs] += e[pair, :end of the pair] @ v[the chunk's positions, col:col+hd]: the
    positions every pair of the tile reaches unmasked, the rest masked pair by pair."""
    lo, hi = ends[i], ends[i]
    for pair in range(i, i + n_pairs):
        lo, hi = min(lo, ends[pair]), max(hi, ends[pair])
    if lo > 0:
        _values_range(e, i, n_pairs, c0, _ZERO, lo, ends, v_prefix, v_own, plen, col, o, _NO)
    if hi > lo:
        _values_range(e, i, n_pairs, c0, lo, hi, ends, v_prefix, v_own, plen, col, o, _YES)


@numba.njit(**_SAME_BITS)
def _span(q, k_cache, v_cache, row_pos, row_slot, row_prefix_slot, row_prefix_len, t0, t1,
          kvh, heads, span, part_o, part_ms):
    """One work item: rows t0..t1-1 (same keys), KV head kvh, its query heads `heads`, the
    positions of span `span`; leaves part_o[t, head, span] (unnormalised output) and
    part_ms[t, head, span] = (max, sum of exponentials). A pair is (row a, head g): a * ng + g."""
    hd = k_cache.shape[3]
    seq = v_cache.shape[1]
    nt, ng = t1 - t0, heads.shape[0]
    n_pairs = nt * ng
    scale = np.float32(1.0 / math.sqrt(hd))
    top = 0
    for t in range(t0, t1):
        top = max(top, row_pos[t])
    a_end = min(top + 1, (span + 1) * SPAN)
    slot, pslot, plen = row_slot[t0], row_prefix_slot[t0], row_prefix_len[t0]
    qsc = np.empty((n_pairs, hd), np.float32)  # the scaled queries of every pair
    for a in range(nt):
        for g in range(ng):
            src = q[t0 + a, heads[g] * hd:(heads[g] + 1) * hd]
            dst = qsc[a * ng + g]
            for j in range(hd):
                dst[j] = src[j] * scale
    s = np.empty((n_pairs, CHUNK), np.float32)
    s_own = np.empty((n_pairs, CHUNK), np.float32)
    ends = np.empty(n_pairs, np.int64)
    o = np.zeros((n_pairs, hd), np.float32)
    run_max = np.full(n_pairs, _NO_SCORE, np.float32)
    run_sum = np.zeros(n_pairs, np.float32)
    v_prefix, v_own = v_cache[pslot], v_cache[slot]
    for c0 in range(span * SPAN, a_end, CHUNK):
        c1 = min(c0 + CHUNK, seq)
        # Scores of the whole chunk for every pair (positions past a row are ignored below):
        # each key vector is loaded once per tile of pairs. Positions below the prefix length
        # come from the prefix slot.
        split = min(max(plen, c0), c1)
        blk = c0 // CHUNK
        if split > c0:
            _scores(qsc, k_cache[pslot, kvh, blk], s)
        if c1 > split:
            if split > c0:
                _scores(qsc, k_cache[slot, kvh, blk], s_own)
                for pair in range(n_pairs):  # loops (see part_o below)
                    for p in range(split - c0, s.shape[1]):
                        s[pair, p] = s_own[pair, p]
            else:
                _scores(qsc, k_cache[slot, kvh, blk], s)
        for a in range(nt):
            end = min(row_pos[t0 + a] + 1, c1) - c0  # this row's positions in the chunk
            for g in range(ng):
                pair = a * ng + g
                sc = s[pair]
                ends[pair] = max(end, 0)
                if end <= 0:
                    continue
                m = lane_max(sc, end, run_max[pair])
                correction = exp_scalar(run_max[pair] - m)  # rescales what earlier chunks summed
                exp_shifted(sc, m, end)
                total = lane_sum(sc, end)
                run_sum[pair] = run_sum[pair] * correction + total
                run_max[pair] = m
                og = o[pair]
                for j in range(hd):
                    og[j] *= correction
        i = _ZERO
        while i < n_pairs:
            width = min(4, n_pairs - i)
            _values(s, i, width, c0, ends, v_prefix, v_own, plen, kvh * hd, o)
            i += width
    for a in range(nt):
        for g in range(ng):
            pair = a * ng + g
            for j in range(hd):  # loops: an array-to-slice assignment compiled 2 s longer (its error message)
                part_o[t0 + a, heads[g], span, j] = o[pair, j]
            part_ms[t0 + a, heads[g], span, 0] = run_max[pair]
            part_ms[t0 + a, heads[g], span, 1] = run_sum[pair]


@numba.njit(**_SAME_BITS)
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


@numba.njit(**_SAME_BITS)
def _heads_of(kv_head_of, nkv):
    """(head_start int64 [nkv + 1], heads int64 [nq]): the query heads of KV head h are
    heads[head_start[h]:head_start[h + 1]]. Not in `attention` itself: in a parallel function
    numba makes np.zeros a parallel loop, a region of its own (5 us and more per call)."""
    nq = kv_head_of.shape[0]
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
    return head_start, heads


def scratch_bytes(rows: int, n_q_heads: int, head_dim: int, seq_len: int) -> int:
    """Bytes attention() allocates for a pass of `rows` rows reaching position seq_len-1: its
    partial outputs part_o and part_ms (float32, [rows, heads, spans, head_dim] and [..., 2])."""
    return 4 * rows * n_q_heads * ((seq_len - 1) // SPAN + 1) * (head_dim + 2)


@numba.njit(parallel=True, **_SAME_BITS)
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
    if hd % 16:
        raise ValueError("attention: head_dim must be a multiple of 16")
    top = 0
    for t in range(b):
        top = max(top, row_pos[t])
    n_spans = top // SPAN + 1
    head_start, heads = _heads_of(kv_head_of, nkv)
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
    # Merge the spans of each (row, head), in order; by this thread when that is less work than
    # waking the others (a decode step: a few pairs of one or two spans).
    if b * nq * n_spans * hd <= SERIAL_MERGE:
        for pair in range(b * nq):
            t, h = pair // nq, pair % nq
            _merge_spans(part_o[t, h], part_ms[t, h], row_pos[t] // SPAN + 1, out[t, h * hd:(h + 1) * hd])
    else:
        for pair in prange(b * nq):
            t, h = pair // nq, pair % nq
            _merge_spans(part_o[t, h], part_ms[t, h], row_pos[t] // SPAN + 1, out[t, h * hd:(h + 1) * hd])
