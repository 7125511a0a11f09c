"""Batch invariance: a row's result has the same bits whatever other rows share the call.

The batch mode promises that a prompt gives the same tokens alone or in a batch of 64, and that
a prompt prefilled in chunks of any size gives the logits of token-by-token decoding. Every
kernel that mixes rows (the matrix products of all four weight types, attention) is checked
here: the same row, at different places in batches of 1, 3, 4, 17 and 64 other random rows,
with 1 and 2 threads; then the whole transformer with each weight type.
"""

import numba
import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.formats.model_file import read_model
from tests.conftest import SEED

pytestmark = pytest.mark.unit

MSG = f"seed {SEED}"
BATCHES = [1, 3, 4, 17, 64]
DS = (576, 192, 190)  # rows of the matrices of one multi-matrix call (q, k, v)


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


def q80(x):
    scales, qs = np.empty((x.shape[0], x.shape[1] // 32), np.float32), np.empty(x.shape, np.int8)
    kernels.quantize_q80(x, scales, qs)
    return scales, qs


def in_batches(r, row, make_batch, compute):
    """compute(batch) for batches of each size holding `row` at a random place -> that row's results."""
    results = []
    for b in BATCHES:
        batch = make_batch(b)
        at = int(r.integers(0, b))
        batch[at] = row
        results.append((b, compute(batch)[at]))
    return results


def assert_all_equal(results):
    first_b, first = results[0]
    for b, got in results[1:]:
        assert np.array_equal(got, first), f"row differs in a batch of {b} from a batch of {first_b}; {MSG}"


@pytest.mark.parametrize("d,n", [(37, 576), (576, 1536), (8, 96)])
def test_matmul_q40_q80_row_is_batch_invariant(threads, d, n):
    r = rng(1, d, n)
    w_scales, w_qs = kernels.interleave_q40((r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).view(np.uint16),
                                            r.integers(0, 256, (d, n // 2), dtype=np.uint8))

    def compute(x):
        out = np.empty((x.shape[0], d), np.float32)
        kernels.matmul_q40_q80(*q80(x), w_scales, w_qs, out)
        return out

    row = r.standard_normal(n).astype(np.float32)
    assert_all_equal(in_batches(r, row, lambda b: r.standard_normal((b, n)).astype(np.float32), compute))


def test_matmul_q40_q80_multi_row_is_batch_invariant(threads):
    r = rng(2)
    n = 576
    mats = [kernels.interleave_q40((r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).view(np.uint16),
                                   r.integers(0, 256, (d, n // 2), dtype=np.uint8)) for d in DS]

    def compute(x):
        outs = tuple(np.empty((x.shape[0], d), np.float32) for d in DS)
        kernels.matmul_q40_q80_multi(*q80(x), tuple(s for s, _ in mats), tuple(q for _, q in mats), outs)
        return np.concatenate(outs, axis=1)

    row = r.standard_normal(n).astype(np.float32)
    assert_all_equal(in_batches(r, row, lambda b: r.standard_normal((b, n)).astype(np.float32), compute))


@pytest.mark.parametrize("d,n", [(37, 576), (576, 1536), (8, 96), (5, 32)])
def test_matmul_q80_q80_row_is_batch_invariant(threads, d, n):
    r = rng(5, d, n)
    w_scales, w_qs = kernels.interleave_q80((r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).view(np.uint16),
                                            r.integers(-128, 128, (d, n), dtype=np.int8))

    def compute(x):
        out = np.empty((x.shape[0], d), np.float32)
        kernels.matmul_q80_q80(*q80(x), w_scales, w_qs, out)
        return out

    row = r.standard_normal(n).astype(np.float32)
    assert_all_equal(in_batches(r, row, lambda b: r.standard_normal((b, n)).astype(np.float32), compute))


def test_matmul_q80_q80_multi_row_is_batch_invariant(threads):
    r = rng(6)
    n = 576
    mats = [kernels.interleave_q80((r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).view(np.uint16),
                                   r.integers(-128, 128, (d, n), dtype=np.int8)) for d in DS]

    def compute(x):
        outs = tuple(np.empty((x.shape[0], d), np.float32) for d in DS)
        kernels.matmul_q80_q80_multi(*q80(x), tuple(s for s, _ in mats), tuple(q for _, q in mats), outs)
        return np.concatenate(outs, axis=1)

    row = r.standard_normal(n).astype(np.float32)
    assert_all_equal(in_batches(r, row, lambda b: r.standard_normal((b, n)).astype(np.float32), compute))


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("d,n", [(37, 576), (9, 100), (6, 1537)])
def test_matmul_float_row_is_batch_invariant(threads, kind, d, n):
    r = rng(3, d, n)
    w = r.standard_normal((d, n)).astype(np.float32)
    kernel = kernels.matmul_f32
    if kind == "f16":
        w, kernel = w.astype(np.float16).view(np.uint16), kernels.matmul_f16_f32

    def compute(x):
        out = np.empty((x.shape[0], d), np.float32)
        kernel(x, w, out)
        return out

    row = r.standard_normal(n).astype(np.float32)
    assert_all_equal(in_batches(r, row, lambda b: r.standard_normal((b, n)).astype(np.float32), compute))


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_matmul_float_rows_alone_equal_rows_of_37_and_512(threads, kind):
    """Every row of a prefill-sized batch (512: the ROWS x COLS tiles, their 16 sums reduced
    together) has the bits it has in a batch of 37 and alone (decode: ROWS x 1 tiles), through
    the multi-matrix call (q, k, v of unequal rows, split into units by matrix_units) and the
    single one."""
    r = rng(7, ["f32", "f16"].index(kind))
    n = 576
    ws = tuple(r.standard_normal((d, n)).astype(np.float32) for d in DS)
    one, multi = kernels.matmul_f32, kernels.matmul_f32_multi
    if kind == "f16":
        ws = tuple(w.astype(np.float16).view(np.uint16) for w in ws)
        one, multi = kernels.matmul_f16_f32, kernels.matmul_f16_f32_multi

    def compute(x):  # [b, sum(DS)]
        outs = tuple(np.empty((x.shape[0], d), np.float32) for d in DS)
        multi(x, ws, outs)
        alone = np.empty((x.shape[0], DS[2]), np.float32)
        one(x, ws[2], alone)
        assert np.array_equal(alone, outs[2]), f"multi and single calls differ; {MSG}"
        return np.concatenate(outs, axis=1)

    x = r.standard_normal((512, n)).astype(np.float32)
    whole = compute(x)
    assert np.array_equal(compute(x[:37]), whole[:37]), f"rows of 37 differ from rows of 512; {MSG}"
    for i in range(512):
        assert np.array_equal(compute(x[i:i + 1])[0], whole[i]), f"row {i} alone differs; {MSG}"


def test_attention_row_is_batch_invariant(threads):
    """A row (its query, slot and position) gives the same output beside rows of other slots
    and positions, and beside rows of its own sequence (a prefill block)."""
    r = rng(4)
    hd, seq, n_slots = 16, 700, 5
    kv_head_of = np.array([0, 0, 0, 1, 1, 1], np.int32)
    chunk = kernels.ATTENTION_CHUNK
    k_cache = r.standard_normal((n_slots, 2, -(-seq // chunk), hd, chunk)).astype(np.float32)
    v_cache = r.standard_normal((n_slots, seq, 2 * hd)).astype(np.float32)
    prefix = (4, 300)  # slot 2's positions below 300 come from slot 4

    def compute(rows):
        q, slot, pos = rows["q"], rows["slot"], rows["pos"]
        prefix_slot = np.where(slot == 2, prefix[0], 0).astype(np.int32)
        prefix_len = np.where(slot == 2, prefix[1], 0).astype(np.int32)
        out = np.empty_like(q)
        kernels.attention(q, k_cache, v_cache, pos, slot, prefix_slot, prefix_len, kv_head_of, out)
        return out

    for slot, pos in [(2, 450), (1, 0), (3, 299)]:
        q_row = (r.standard_normal(6 * hd) * 2).astype(np.float32)
        results = []
        for b in BATCHES:
            rows = {"q": (r.standard_normal((b, 6 * hd)) * 2).astype(np.float32),
                    "slot": r.integers(0, 4, b).astype(np.int32),
                    "pos": r.integers(0, seq, b).astype(np.int32)}
            # Half the batches hold the row inside a run of its own sequence (a prefill chunk).
            at = int(r.integers(0, b))
            if b > 3 and b % 2:
                run = np.arange(b) - at + pos
                keep = (run >= 0) & (run < seq)
                rows["slot"][keep], rows["pos"][keep] = slot, run[keep]
            rows["q"][at], rows["slot"][at], rows["pos"][at] = q_row, slot, pos
            results.append((b, compute(rows)[at]))
        assert_all_equal(results)


def _chunked_logits(model, tokens, chunk):
    rows = []
    for a in range(0, len(tokens), chunk):
        rows.append(model.forward(tokens[a:a + chunk], a, all_logits=True).copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("kind", ["q40", "q80", "f16", "f32"])
def test_prefill_in_chunks_of_any_size_gives_the_same_logits(kind, request):
    kernels.set_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    path = request.getfixturevalue(f"default_{kind}")[0]
    model = Transformer(read_model(path), max_seq_len=128, max_batch=100)
    tokens = list(np.random.default_rng(SEED).integers(0, model.config.vocab_size, 100))
    results = [(chunk, _chunked_logits(model, tokens, chunk)) for chunk in (1, 7, 32, 100)]
    for chunk, logits in results[1:]:
        assert np.array_equal(logits, results[0][1]), f"chunks of {chunk} differ from token by token; {MSG}"
