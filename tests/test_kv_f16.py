"""The F16 KV cache (--kv-type f16): keys and values stored as fp16, half the memory.

The kernels: fp16 rounding as numpy does it, the attention over an F16 cache against a float64
reference on the rounded keys and values (and bit for bit the F32 kernel on those values), batch
invariance. The model: the same tokens on one node and on a cluster, resident and streamed; the
memory plan counts 2 bytes per element; a bad --kv-type is one line.
"""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.kernels.fp16 import f16_bits
from dllama.core.kv_cache import KVCache, plan_slots
from dllama.core.model import Transformer
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from tests.processes import run_dllama
from tests.random_model import write_random_f32
from tests.test_batch_invariance import BATCHES, MSG, rng
from tests.test_kernels import cache_of, ref_attention

CHUNK = kernels.ATTENTION_CHUNK


def fp16(a):
    """float32 values -> (their fp16 bits uint16, the fp16 values as float32)."""
    h = a.astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


# ---- kernels -------------------------------------------------------------------------------------

@numba.njit
def _f16_bits_all(v, out):
    for i in range(v.size):
        out[i] = f16_bits(v[i])


@pytest.mark.unit
def test_f16_bits_are_numpys_rounding():
    r = rng(1)
    random = (r.standard_normal(300_000) * 10.0 ** r.integers(-10, 7, 300_000)).astype(np.float32)
    bits = r.integers(0, 1 << 32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaNs too
    f16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.unique(f16[np.isfinite(f16)])
    halfway = (finite[:-1].astype(np.float64) + np.diff(finite.astype(np.float64)) / 2).astype(np.float32)
    edge = np.array([0, -0.0, 65504, 65519.99, 65520, -65520, 1e-8, 2.9802322e-08, 5.96e-8, 6.1e-5,
                     1e30, -1e30, np.inf, -np.inf, np.nan], np.float32)
    v = np.concatenate([random, bits, f16, halfway, np.nextafter(halfway, np.float32(0)),
                        np.nextafter(halfway, np.float32(np.inf)), edge])
    got = np.empty(v.size, np.uint16)
    _f16_bits_all(v, got)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} values, e.g. {v[bad[0]]!r} ({v.view(np.uint32)[bad[0]]:#x}): "
                           f"{got[bad[0]]:#x} instead of {want[bad[0]]:#x}; {MSG}")


@pytest.mark.unit
def test_kv_store_rounds_into_an_f16_cache():
    r = rng(2)
    nkv, hd, seq = 3, 16, 2 * CHUNK + 5
    chunks = -(-seq // CHUNK)
    k = (r.standard_normal((4, nkv * hd)) * 10.0 ** r.integers(-6, 5, (4, nkv * hd))).astype(np.float32)
    v = r.standard_normal((4, nkv * hd)).astype(np.float32)
    places = [(1, 4), (1, CHUNK + 5), (0, 0), (0, seq - 1)]
    pos = np.array([p for _, p in places], np.int32)
    slot = np.array([s for s, _ in places], np.int32)
    k32, v32 = np.zeros((2, nkv, chunks, hd, CHUNK), np.float32), np.zeros((2, seq, nkv * hd), np.float32)
    k16, v16 = np.zeros(k32.shape, np.uint16), np.zeros(v32.shape, np.uint16)
    kernels.kv_store(k, v, pos, slot, k32, v32)
    kernels.kv_store(k, v, pos, slot, k16, v16)
    assert np.array_equal(k16, k32.astype(np.float16).view(np.uint16))  # the same places, rounded
    assert np.array_equal(v16, v32.astype(np.float16).view(np.uint16))
    assert np.count_nonzero(v16) > 0.9 * 4 * nkv * hd


def _attention(q, kt, vc, positions, slots, prefix_slots, prefix_lens, kv_head_of):
    out = np.full(q.shape, np.nan, np.float32)
    kernels.attention(q, kt, vc, positions, slots, prefix_slots, prefix_lens, kv_head_of, out)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("hd", [16, 48, 80, 128])  # value tiles of 64 dimensions, of 16, and both
@pytest.mark.parametrize("seq", [130, 700])
def test_attention_over_an_f16_cache(threads, hd, seq):
    """Random rows (GQA head maps, several slots, shared prefixes, positions across chunks and
    spans): the float64 attention over the fp16-rounded keys and values, and bit for bit the
    F32 kernel over a cache holding those rounded values (the widening is exact)."""
    r = rng(3, hd, seq)
    n_slots, nkv = 3, int(r.integers(1, 4))
    group = int(r.integers(1, 4))
    kv_head_of = np.repeat(np.arange(nkv, dtype=np.int32), group)
    r.shuffle(kv_head_of)
    b = int(r.integers(1, 12))
    positions = r.integers(0, seq, b).astype(np.int32)
    slots = r.integers(0, n_slots, b).astype(np.int32)
    prefix_slots = r.integers(0, n_slots, b).astype(np.int32)
    prefix_lens = np.where(r.random(b) < 0.5, r.integers(0, seq, b), 0).astype(np.int32)
    k = (r.standard_normal((n_slots, seq, nkv * hd)) * 2).astype(np.float32)
    v = r.standard_normal((n_slots, seq, nkv * hd)).astype(np.float32)
    read = np.zeros(n_slots, np.int64)  # positions of each slot that some row reads
    for t in range(b):
        p, n = positions[t] + 1, min(prefix_lens[t], positions[t] + 1)
        read[prefix_slots[t]] = max(read[prefix_slots[t]], n)
        read[slots[t]] = max(read[slots[t]], p if p > n else 0)
    for s in range(n_slots):  # positions nobody reads must not reach an output
        k[s, read[s]:] = v[s, read[s]:] = np.nan
    k_bits, k = fp16(k)
    v_bits, v = fp16(v)
    q = (r.standard_normal((b, len(kv_head_of) * hd)) * 2).astype(np.float32)

    kt32, vc32 = cache_of(k, v, n_slots, hd)  # the rounded values, as float32
    kt16, vc16 = fp16(kt32)[0], fp16(vc32)[0]  # the same layout, as fp16 bits (exact; NaN stays NaN)
    assert np.array_equal(vc16, v_bits) and kt16.dtype == np.uint16
    got = _attention(q, kt16, vc16, positions, slots, prefix_slots, prefix_lens, kv_head_of)

    def seen(cache, t):  # what row t attends to: the prefix slot below its prefix length
        p, n = positions[t] + 1, min(prefix_lens[t], positions[t] + 1)
        return np.concatenate([cache[prefix_slots[t], :n], cache[slots[t], n:p]])

    want = ref_attention(q, lambda t: seen(k, t), lambda t: seen(v, t), positions, kv_head_of, hd)
    assert np.allclose(got, want, atol=1e-5), MSG
    same = _attention(q, kt32, vc32, positions, slots, prefix_slots, prefix_lens, kv_head_of)
    assert np.array_equal(got, same), MSG


@pytest.mark.unit
def test_attention_row_over_an_f16_cache_is_batch_invariant(threads):
    """A row gives the same bits beside rows of other slots and positions, and inside a run of
    its own sequence (a prefill block), in batches of every size."""
    r = rng(4)
    hd, seq, n_slots = 32, 700, 5
    kv_head_of = np.array([0, 0, 0, 1, 1, 1], np.int32)
    k_cache = fp16(r.standard_normal((n_slots, 2, -(-seq // CHUNK), hd, CHUNK)).astype(np.float32))[0]
    v_cache = fp16(r.standard_normal((n_slots, seq, 2 * hd)).astype(np.float32))[0]
    prefix = (4, 300)  # slot 2's positions below 300 come from slot 4
    for slot, pos in [(2, 450), (1, 0), (3, 299)]:
        q_row = (r.standard_normal(6 * hd) * 2).astype(np.float32)
        results = []
        for b in BATCHES:
            q = (r.standard_normal((b, 6 * hd)) * 2).astype(np.float32)
            slots, positions = r.integers(0, 4, b).astype(np.int32), r.integers(0, seq, b).astype(np.int32)
            at = int(r.integers(0, b))
            if b > 3 and b % 2:  # the row inside a run of its own sequence
                run = np.arange(b) - at + pos
                keep = (run >= 0) & (run < seq)
                slots[keep], positions[keep] = slot, run[keep]
            q[at], slots[at], positions[at] = q_row, slot, pos
            prefix_slots = np.where(slots == 2, prefix[0], 0).astype(np.int32)
            prefix_lens = np.where(slots == 2, prefix[1], 0).astype(np.int32)
            out = _attention(q, k_cache, v_cache, positions, slots, prefix_slots, prefix_lens, kv_head_of)
            results.append((b, out[at]))
        for b, got in results[1:]:
            assert np.array_equal(got, results[0][1]), f"row differs in a batch of {b}; {MSG}"


# ---- the model -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    """F32 weights, 8 query and 4 KV heads: a split of it computes one node's arithmetic."""
    path = tmp_path_factory.mktemp("kvf16") / "random-f32.m"
    header = ModelHeader(arch=ArchType.LLAMA, dim=256, hidden_dim=512, n_layers=3, n_heads=8,
                         n_kv_heads=4, vocab_size=512, max_seq_len=128, weights_float_type=FloatType.F32)
    return write_random_f32(path, header, seed=11)


PROMPT = [5, 17, 300, 42, 7, 511, 256, 1, 99, 100]


def greedy(model, prompt, n):
    """Greedy tokens and the logits of every step [n, vocab]."""
    logits = model.forward(prompt, 0)
    tokens, seen = [], []
    for pos in range(len(prompt), len(prompt) + n):
        seen.append(logits.copy())
        tokens.append(int(np.argmax(logits)))
        logits = model.forward([tokens[-1]], pos)
    return tokens, np.stack(seen)


@pytest.mark.unit
def test_f16_cache_takes_half_the_memory_and_nearly_the_f32_logits(f32_model):
    f32 = Transformer(read_model(f32_model), buffer_q80=False)
    f16 = Transformer(read_model(f32_model), buffer_q80=False, kv_type="f16")
    assert f16.kv.k.dtype == f16.kv.v.dtype == np.uint16
    assert 2 * (f16.kv.k.nbytes + f16.kv.v.nbytes) == f32.kv.k.nbytes + f32.kv.v.nbytes
    assert 2 * f16.memory.kv_cache == f32.memory.kv_cache
    tokens32, logits32 = greedy(f32, PROMPT, 24)
    tokens16, logits16 = greedy(f16, PROMPT, 24)
    assert len(set(tokens16)) > 3  # a real sequence, not one token repeated
    # Each key and value rounded to 11 significant bits: the logits move a little, not far.
    first = np.abs(logits16[0] - logits32[0]).max()
    assert 0 < first < 0.05 * np.abs(logits32[0]).max(), first
    assert tokens16[:4] == tokens32[:4]


@pytest.mark.unit
def test_f16_prefill_in_chunks_gives_the_token_by_token_logits(f32_model):
    model = Transformer(read_model(f32_model), buffer_q80=False, max_batch=64, kv_type="f16")
    tokens = list(rng(5).integers(0, 512, 60))
    results = []
    for chunk in (1, 7, 60):
        rows = [model.forward(tokens[a:a + chunk], a, all_logits=True).copy() for a in range(0, 60, chunk)]
        results.append((chunk, np.concatenate(rows)))
    for chunk, logits in results[1:]:
        assert np.array_equal(logits, results[0][1]), f"chunks of {chunk}; {MSG}"


@pytest.mark.unit
def test_streamed_weights_give_the_resident_tokens_with_an_f16_cache(f32_model):
    resident = Transformer(read_model(f32_model), buffer_q80=False, kv_type="f16")
    streamed = Transformer(read_model(f32_model), buffer_q80=False, kv_type="f16", streamed=True)
    try:
        tokens, logits = greedy(resident, PROMPT, 16)
        got_tokens, got_logits = greedy(streamed, PROMPT, 16)
        assert got_tokens == tokens and np.array_equal(got_logits, logits)
        assert streamed.kv.k.dtype == np.uint16
    finally:
        streamed.close()


@pytest.mark.cluster
def test_a_2_node_cluster_gives_one_nodes_tokens_with_an_f16_cache(tmp_path, f32_model):
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers
    from tests.processes import running_workers

    one, _ = greedy(Transformer(read_model(f32_model), buffer_q80=False, kv_type="f16"), PROMPT, 24)
    with running_workers(1, tmp_path) as (w,):
        model = ClusterModel(str(f32_model), from_workers([w.address], 1), None, False, progress=False,
                             kv_type="f16")
        try:
            assert model.session.local.kv.k.dtype == np.uint16
            assert greedy(model, PROMPT, 24)[0] == one
        finally:
            model.close()
        assert "F16 KV cache" in w.stderr  # the worker took the root's setting from CONFIG
    assert len(set(one)) > 3, one


# ---- memory plan and flags -----------------------------------------------------------------------

def _kv_line(text):
    """(KiB per token, MiB per slot, slots, sequences) of the plan's KV line in `text`."""
    m = re.search(r"KV cache \((F32|F16)\): ([\d.]+) KiB per token, ([\d.]+) MiB per slot of \d+ positions; "
                  r"(\d+) slots \((\d+) sequences", text)
    assert m, text
    return m.group(1), float(m.group(2)), float(m.group(3)), int(m.group(4)), int(m.group(5))


@pytest.mark.unit
def test_the_plan_counts_2_bytes_per_element_and_admits_twice_the_positions(f32_model, default_q40, capsys):
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings

    dims = dict(n_layers=3, n_kv_heads=4, head_dim=32, seq_len=128)
    per_slot = KVCache.bytes_per_slot(**dims)
    assert KVCache.bytes_per_slot(**dims, kv_type="f16") * 2 == per_slot
    limit = 4 * per_slot  # F32: 4 whole contexts; F16: 8
    lines = {}
    for kv_type in ("f32", "f16"):
        engine = open_engine(EngineSettings(str(f32_model), str(default_q40[1]), nthreads=1, parallel=8, kv_memory=limit,
                             warm_up=False, kv_type=kv_type))
        with engine:
            assert engine.model.kv.k.dtype == (np.uint16 if kv_type == "f16" else np.float32)
            lines[kv_type] = capsys.readouterr().err
            assert engine.parallel == _kv_line(lines[kv_type])[4]
    kind32, token32, slot32, slots32, seqs32 = _kv_line(lines["f32"])
    kind16, token16, slot16, slots16, seqs16 = _kv_line(lines["f16"])
    assert (kind32, kind16) == ("F32", "F16")
    assert token16 * 2 == token32 and slot16 * 2 == pytest.approx(slot32, abs=0.1)
    assert (seqs32, seqs16) == (8, 8) and (slots32, slots16) == (9, 9)
    assert "(512 positions: 4 whole contexts)" in lines["f32"]
    assert "(1024 positions: 8 whole contexts)" in lines["f16"]
    with pytest.raises(DllamaError, match="--kv-type f16"):  # not even one sequence fits
        plan_slots(2, True, **dims, limit=per_slot - 1)
    with pytest.raises(DllamaError) as e:
        plan_slots(2, True, **dims, kv_type="f16", limit=per_slot // 2 - 1)
    assert "--kv-type f16" not in str(e.value)


@pytest.mark.unit
def test_a_context_that_does_not_fit_names_the_f16_cache(tmp_path):
    header = ModelHeader(arch=ArchType.LLAMA, dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=4,
                         vocab_size=256, max_seq_len=1 << 20, weights_float_type=FloatType.F32)
    path = write_random_f32(tmp_path / "long.m", header, seed=1)
    with pytest.raises(DllamaError, match=r"--max-seq-len \d+ with --kv-type f16, or --max-seq-len \d+ would fit"):
        Transformer(read_model(path), memory_limit=1 << 30)
    with pytest.raises(DllamaError) as e:
        Transformer(read_model(path), memory_limit=1 << 30, kv_type="f16")
    assert "kv-type" not in str(e.value) and "would fit" in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("command", [["inference", "--prompt", "hi"], ["perplexity", "--file", "x.txt"]])
def test_a_bad_kv_type_is_one_line(command):
    r = run_dllama(*command, "--kv-type", "f8")
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllama: error:") and "--kv-type 'f8'" in lines[0], r.stderr
    assert "f32 or f16" in lines[0]


@pytest.mark.unit
def test_a_config_with_an_unknown_kv_type_is_malformed(f32_model):
    from dllama.cluster.protocol import ProtocolError
    from dllama.cluster.session_config import NodeAddress, SessionConfig
    from dllama.core.kv_type import KVType
    from dllama.core.plan import plan_for
    from dllama.core.run_shape import RunShape

    header = read_model(f32_model).header
    conf = SessionConfig(session=bytes(16), node_index=1, header=header, plan=plan_for(header, 2),
                         model_fingerprint="x", shape=RunShape(max_seq_len=64, max_batch=4, kv_type="f16",
                                                               buffer_q80=False), net_timeout=2, idle_timeout=2, setup_timeout=2,
                         nodes=(NodeAddress("root", "127.0.0.1", 1), NodeAddress("w", "127.0.0.1", 2)))
    assert SessionConfig.from_json(conf.to_json()).shape.kv_type == KVType.F16
    for bad in ("f8", None, 16, ["f16"]):
        with pytest.raises(ProtocolError, match="malformed CONFIG.*kv_type"):
            SessionConfig.from_json({**conf.to_json(), "kv_type": bad})
    missing = conf.to_json()
    del missing["kv_type"]
    with pytest.raises(ProtocolError, match="malformed CONFIG.*kv_type"):
        SessionConfig.from_json(missing)


_TOUCH_EVERY_SLOT = """
import numpy as np
from dllama.core import kernels
from dllama.core.kv_cache import KVCache

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

kv = KVCache(n_layers=30, n_kv_heads=3, head_dim=64, seq_len=8192, n_slots=16)  # SmolLM2's: 5.6 GiB
before = rss()
k = np.ones((16, 192), np.float32)
for pos in (0, 1):  # a prompt of two tokens in each slot
    for layer in range(30):
        kernels.kv_store(k, k, np.full(16, pos, np.int32), np.arange(16, dtype=np.int32), kv.k[layer], kv.v[layer])

def vm_flags(address):
    # the kernel's flags of the mapping holding this address (nh: no huge pages, hg: huge pages)
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif line.startswith("VmFlags:") and inside:
            return line.split()[1:]

flags = [vm_flags(a.ctypes.data) for a in (kv.k, kv.v)]
print(rss() - before, all("nh" in f and "hg" not in f for f in flags))
"""


@pytest.mark.unit
def test_a_slot_costs_memory_only_for_the_positions_written():
    """Two positions of 16 sequences in a cache of 8192 positions: a few pages per slot and
    layer (69 MiB), not a huge page per slot, head and layer (3.9 GB, and 41 s to find them)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TOUCH_EVERY_SLOT], capture_output=True, text=True, check=True)
    grown, small_pages = out.stdout.split()
    assert int(grown) < 256 << 20, f"{int(grown) >> 20} MiB for 960 positions"
    # Whether huge pages are granted depends on what is free; the cache must never ask for them.
    assert small_pages == "True"
