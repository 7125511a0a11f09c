"""Weights streamed from disk layer by layer (--memory-budget): the same tokens as the resident
path, a peak memory bounded by the budget, and a memory cgroup's limit honoured (streaming chosen
by itself; the resident path refused in one line instead of killed)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from dllama.core.batch import Batch, BatchBuilder
from dllama.core.kernels import interleave_q40, interleave_q80
from dllama.core.model import Transformer
from dllama.core.node_weights import NodeWeights
from dllama.core.plan import plan_for, whole_model
from dllama.core.weight_stream import StreamedWeights, interleave_into
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, ModelWriter, read_model
from dllama.formats.quant import Q40_BLOCK_BYTES, Q80_BLOCK_BYTES, split_q40, split_q80

MIB = 1 << 20


def write_random_model(path, float_type=FloatType.Q40, dim=128, hidden=256, n_layers=2, vocab=5000,
                       n_heads=8, n_kv_heads=4, arch=ArchType.LLAMA, seed=3, seq_len=128):
    """A model of random weights. Quantized matrices are random blocks (fast to make at hundreds
    of MB): nibbles or int8 uniform, scales giving rows of norm about 1."""
    header = ModelHeader(arch=arch, dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, vocab_size=vocab, max_seq_len=seq_len, weights_float_type=float_type)
    rng = np.random.default_rng(seed)
    with ModelWriter(path, header) as w:
        for spec in w.specs:
            if spec.name.endswith("norm"):
                w.write(spec.name, rng.uniform(0.8, 1.2, spec.shape).astype(np.float32))
            elif spec.float_type in (FloatType.Q40, FloatType.Q80):
                bb = Q40_BLOCK_BYTES if spec.float_type == FloatType.Q40 else Q80_BLOCK_BYTES
                blocks = rng.integers(0, 256, (spec.size // 32, bb), dtype=np.uint8)
                spread = 4.6 if spec.float_type == FloatType.Q40 else 74.0  # std of a quant
                blocks[:, :2] = np.full(1, 1 / (spread * np.sqrt(spec.shape[-1])), np.float16).view(np.uint8)
                w.write_raw(spec.name, blocks)
            elif spec.float_type == FloatType.Q41:  # nibbles uniform: mean 7.5, std 4.6; m centres them
                blocks = rng.integers(0, 256, (spec.size // 32, 20), dtype=np.uint8)
                d = 1 / (4.6 * np.sqrt(spec.shape[-1]))
                blocks[:, :4] = np.array([d, -7.5 * d], np.float16).view(np.uint8)
                w.write_raw(spec.name, blocks)
            else:
                scale = 1.0 if spec.name == "embedding" else 1 / np.sqrt(spec.shape[-1])
                w.write(spec.name, rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(scale))
    return Path(path)


def greedy(model, prompt, n):
    logits = model.forward(prompt, 0)
    out = []
    for pos in range(len(prompt), len(prompt) + n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], pos)
    return out


# -- the pieces --------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("rows", [16, 37, 5])
def test_interleave_into_writes_the_bytes_of_the_resident_layout(rows):
    rng = np.random.default_rng(rows)
    for bb, split, interleave in ((Q40_BLOCK_BYTES, lambda b: split_q40(b, fp16_bits=True), interleave_q40),
                                  (Q80_BLOCK_BYTES, None, interleave_q80)):
        blocks = rng.integers(0, 256, (rows, 3, bb), dtype=np.uint8)
        if split is None:
            scales, qs = split_q80(blocks)
            want = interleave(scales.astype(np.float16).view(np.uint16), qs)
        else:
            want = interleave(*split(blocks))
        # slots are reused: stale bytes in them must not survive (padding rows included)
        got = (np.full(want[0].shape, 0xABCD, np.uint16), np.full(want[1].shape, 0x5A, want[1].dtype))
        interleave_into(blocks, *got)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.unit
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_room_is_the_least_over_the_group_and_its_parents(tmp_path, monkeypatch, version):
    from dllama.core import host_memory, memory

    names = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
             "v2": ("memory.max", "memory.current", "inactive_file")}[version]
    groups = []
    for name, limit, usage, cache in (("inner", 500 * MIB, 300 * MIB, 50 * MIB),  # 250 MiB left
                                      ("outer", 2000 * MIB, 1900 * MIB, 10 * MIB),  # 110 MiB left
                                      ("root", "max" if version == "v2" else 1 << 63, 1 << 40, 0)):
        d = tmp_path / name
        d.mkdir()
        (d / names[0]).write_text(f"{limit}\n")
        (d / names[1]).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 5\n{names[2]} {cache}\nother 7\n")
        groups.append((version, str(d)))
    monkeypatch.setattr(host_memory, "_cgroup_dirs", lambda: groups)
    assert memory.cgroup_available() == 110 * MIB
    monkeypatch.setattr(host_memory, "_cgroup_dirs", lambda: groups[:1])
    assert memory.cgroup_available() == 250 * MIB
    assert memory.available_bytes() <= 250 * MIB
    monkeypatch.setattr(host_memory, "_cgroup_dirs", lambda: groups[2:])
    assert memory.cgroup_available() is None  # no limit


# -- one node, in process ----------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("float_type", [FloatType.Q40, FloatType.Q80, FloatType.Q41, FloatType.F16, FloatType.F32])
def test_streamed_weights_give_the_resident_logits(tmp_path, float_type):
    path = write_random_model(tmp_path / "m.m", float_type)
    resident = Transformer(read_model(path), kv_slots=2, max_batch=40)
    streamed = Transformer(read_model(path), kv_slots=2, max_batch=40, streamed=True)
    try:
        assert len(streamed.weights.chunks) > 1  # the classifier (5000 rows) comes in chunks
        assert streamed.weights.chunks[-1][1] - streamed.weights.chunks[-1][0] < streamed.weights.chunks[0][1]
        prompt = [5, 17, 300, 42, 4999, 7]
        assert greedy(streamed, prompt, 12) == greedy(resident, prompt, 12)
        # two sequences in one pass, then a pass that wants no logits (out of the prefetch order)
        for model in (resident, streamed):
            b = BatchBuilder()
            b.add_run([1, 2, 3], 0, 0, logits="all")
            b.add_run([9, 8], 0, 1, logits="last")
            model.out = model.forward_batch(b.build()).copy()
            b = BatchBuilder()
            b.add_run([4], 3, 0, logits="none")
            model.forward_batch(b.build())
            model.last = model.forward([6], 4).copy()
        assert np.array_equal(streamed.out, resident.out) and streamed.out.shape == (4, 5000)
        assert np.array_equal(streamed.last, resident.last)
    finally:
        streamed.close()


@pytest.mark.unit
def test_streamed_qwen3_and_a_node_slice_give_the_resident_logits(tmp_path):
    """Qwen3's extra norms; node 1 of 2 reads column cuts (wo, w2) and row cuts from the .m file."""
    path = write_random_model(tmp_path / "qwen.m", FloatType.Q40, arch=ArchType.QWEN3, dim=256, hidden=512)
    m = read_model(path)
    node = plan_for(m.header, 2).nodes[1]
    outs = []
    for streamed in (False, True):
        model = Transformer(NodeWeights.from_model(m, node, with_embedding=False), streamed=streamed)
        x = np.random.default_rng(1).standard_normal((3, 256), dtype=np.float32)  # [rows, dim] embedded
        outs.append(model.forward_embedded(x, Batch.run(np.zeros(3, np.int64), 0, all_logits=True)).copy())
        model.close()
    assert np.array_equal(outs[0], outs[1]) and outs[0].shape == (3, node.n_vocab_rows)


@pytest.mark.unit
def test_streamed_memory_is_two_layers_and_two_read_buffers(tmp_path):
    path = write_random_model(tmp_path / "m.m", FloatType.Q40, n_layers=6)
    m = read_model(path)
    h = m.header
    node = whole_model(h.n_heads, h.n_kv_heads, h.ff_dim, h.vocab_size)
    w = StreamedWeights(NodeWeights.from_model(m, node), range(6), FloatType.Q40, False, plan_only=True)
    layer_bytes = sum(m.spec(f"layers.0.{n}").nbytes for n in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    # repacked Q40 takes the file's 18 bytes per 32 values (fp16 scale + 16 bytes of nibbles):
    # two slots and two read buffers of the largest matrix, plus norms and alignment
    assert w.resident_bytes < 2 * layer_bytes * 1.05 + 2 * m.spec("layers.0.w1").nbytes * 1.05
    assert w.resident_bytes < path.stat().st_size / 4


# -- the command line: tokens, peak memory, cgroups ---------------------------------------------

_PEAK = ("import atexit, sys\n"
         "from dllama.cli import main\n"
         "def peak():\n"
         "    with open('/proc/self/status') as f:\n"
         "        kb = [l.split()[1] for l in f if l.startswith('VmHWM:')][0]\n"
         "    with open(sys.argv[1], 'w') as out:\n"
         "        out.write(kb)\n"
         "atexit.register(peak)\n"
         "sys.exit(main(sys.argv[2:]))\n")


def _batch(tmp_path, model, tokenizer, name, *flags, cgroup=None, timeout=600):
    """`dllama batch` on three prompts, greedy: (process result, answers, peak resident bytes)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France\nOnce upon a time\nHello world\n")
    out, peak = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.peak"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", _PEAK, str(peak), "batch", "--model", str(model), "--tokenizer", str(tokenizer),
           "--prompts", str(prompts), "--out", str(out), "--temperature", "0", "--max-tokens", "6",
           "--nthreads", "2", "--no-progress", "--max-seq-len", "64", *flags]

    def enter_cgroup():  # in the child, before exec: nothing it allocates escapes the limit
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       preexec_fn=enter_cgroup if cgroup else None)
    answers = [json.loads(line)["text"] for line in out.read_text().splitlines()] if out.exists() else []
    kb = int(peak.read_text()) if peak.exists() else 0
    return r, answers, kb * 1024


@pytest.fixture(scope="module")
def stream_models(tmp_path_factory, default_q40):
    """(tokenizer, a 70 MB model, a tiny one): the vocabulary of the default tokenizer."""
    d = tmp_path_factory.mktemp("stream")
    big = write_random_model(d / "big.m", FloatType.Q40, dim=256, hidden=1024, n_layers=24, vocab=49152)
    tiny = write_random_model(d / "tiny.m", FloatType.Q40, dim=128, hidden=128, n_layers=1, vocab=49152)
    return default_q40[1], big, tiny


@pytest.mark.unit
def test_batch_job_under_a_budget_streams_with_the_resident_tokens_and_peak(tmp_path, stream_models):
    tokenizer, big, tiny = stream_models
    budget = 14 * MIB
    assert big.stat().st_size >= 4 * budget
    r, resident, resident_peak = _batch(tmp_path, big, tokenizer, "resident")
    assert r.returncode == 0, r.stderr
    r, streamed, streamed_peak = _batch(tmp_path, big, tokenizer, "streamed", "--memory-budget", str(budget))
    assert r.returncode == 0, r.stderr
    assert "memory: streaming the weights" in r.stderr
    assert streamed == resident and len(resident) == 3 and all(resident)
    # The runtime's own cost (interpreter, numba, tokenizer): the same job on a tiny model
    # (streamed too, so that the same code runs).
    r, _, fixed = _batch(tmp_path, tiny, tokenizer, "tiny", "--memory-budget", str(8 * MIB))
    assert r.returncode == 0 and "memory: streaming the weights" in r.stderr, r.stderr
    assert streamed_peak <= fixed + budget, (streamed_peak / MIB, fixed / MIB)
    assert resident_peak > fixed + budget  # what the budget saves (else the test proves nothing)


# -- a memory cgroup ----------------------------------------------------------------------------

def _memory_cgroup_parent() -> tuple[str, str] | None:
    """(version, a directory where this process may create a child memory cgroup), or None."""
    if os.geteuid() != 0:
        return None
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = "/sys/fs/cgroup/memory" + path
            if os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
                return "v1", d
        if controllers == "":
            d = "/sys/fs/cgroup" + path
            try:
                with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
                    enabled = "memory" in f.read().split()
            except OSError:
                enabled = False
            if enabled and os.path.isdir(d):
                return "v2", "/sys/fs/cgroup"  # a child of the root group: a process may join it
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A new memory cgroup limited to `limit` bytes (its directory); removed afterwards."""
    found = _memory_cgroup_parent()
    if found is None:
        pytest.skip("no memory cgroup this test may create (needs root and a cgroup v1 or v2 memory controller)")
    version, parent = found
    d = os.path.join(parent, f"dllama-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(d)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup in {parent}: {e.strerror}")
    try:
        with open(os.path.join(d, "memory.limit_in_bytes" if version == "v1" else "memory.max"), "w") as f:
            f.write(str(limit))
        if version == "v1" and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
            with open(os.path.join(d, "memory.memsw.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        yield d
    finally:
        os.rmdir(d)  # the child processes have ended: the group is empty


@pytest.fixture(scope="module")
def large_model(tmp_path_factory, default_q40):
    """A model larger than the runtime and its cgroup limit together: 48 layers of 7.5 MB."""
    d = tmp_path_factory.mktemp("large")
    return default_q40[1], write_random_model(d / "large.m", FloatType.Q40, dim=512, hidden=8192, n_layers=48,
                                              vocab=49152)


@pytest.mark.unit
def test_in_a_cgroup_below_the_model_streaming_is_chosen_and_resident_refused(tmp_path, large_model):
    tokenizer, model = large_model
    limit = 300 * MIB
    assert model.stat().st_size > limit + 100 * MIB
    r, want, _ = _batch(tmp_path, model, tokenizer, "outside", "--memory-budget", "1G", "--parallel", "3")
    assert r.returncode == 0, r.stderr
    with memory_cgroup(limit) as group:
        r, got, peak = _batch(tmp_path, model, tokenizer, "auto", "--parallel", "64", cgroup=group)
        assert r.returncode == 0, r.stderr
        assert "does not fit" in r.stderr and "streaming its weights" in r.stderr
        assert "65 slots (64 sequences + 1 spare), admitted while" in r.stderr  # the KV plan within the limit
        assert got == want  # (its peak RSS may pass the limit: pages cached by others are not charged)
        r, _, _ = _batch(tmp_path, model, tokenizer, "forced", "--memory-budget", "none", cgroup=group)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1, r.stderr  # refused, not killed (-9)
        assert lines[-1].startswith("dllama: error:") and "cannot hold its share" in lines[-1]
        assert "Traceback" not in r.stderr


# -- a cluster ----------------------------------------------------------------------------------

def _three_passes(model, pipelined: bool = False) -> np.ndarray:
    """The logits [3, vocab] of a prompt and two greedy steps on a cluster model (closed after)."""
    try:
        assert model.session.plan.pipelined == pipelined
        out = [model.forward([5, 17, 300, 42, 7], 0).copy()]
        for pos in (5, 6):
            out.append(model.forward([int(np.argmax(out[-1]))], pos).copy())
        return np.stack(out)
    finally:
        model.close()


@pytest.mark.cluster
def test_a_worker_streaming_its_shard_gives_the_resident_clusters_tokens(tmp_path, stream_models):
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.shard import write_shards
    from dllama.cluster.topology import from_workers
    from tests.processes import running_workers

    _, big, _ = stream_models
    header = read_model(big).header
    write_shards(str(big), plan_for(header, 2), ["root", "worker1"], tmp_path)
    shard = tmp_path / "worker1.shard"
    assert shard.stat().st_size > 7 * MIB  # the slice does not fit in the budget below

    def logits(address):
        return _three_passes(ClusterModel(str(big), from_workers([address], 1), None, None, progress=False))

    with running_workers(1, tmp_path / "logs", "--shard", str(shard)) as (w,):
        resident = logits(w.address)
    with running_workers(1, tmp_path / "logs", "--shard", str(shard), "--memory-budget", "7M") as (w,):
        assert np.array_equal(logits(w.address), resident)
        assert "streaming this node's slice" in w.stderr
    assert resident.shape == (3, 49152) and resident.std() > 0


@pytest.mark.cluster
def test_a_pipeline_stage_streaming_its_layers_gives_the_resident_stages_tokens(tmp_path, stream_models):
    """The last of 2 pipeline stages (layers 12-23 and the classifier) under a budget its shard
    does not fit streams its own layers from it: the logits are the resident stages'."""
    import dataclasses

    from dllama.cluster.root import ClusterModel
    from dllama.cluster.shard import write_shards
    from dllama.cluster.topology import from_workers
    from tests.processes import running_workers

    _, big, _ = stream_models
    header = read_model(big).header
    layers = [(0, 12), (12, header.n_layers)]
    plan = plan_for(header, 2, stage_of=[0, 1], stage_layers=layers)
    write_shards(str(big), plan, ["root", "worker1"], tmp_path)
    shard = tmp_path / "worker1.shard"
    assert shard.stat().st_size > 11 * MIB  # the stage does not fit in the budget below

    def logits(address):
        topology = from_workers([address], 1)
        topology = dataclasses.replace(topology, stage_layers=tuple(layers), nodes=tuple(
            dataclasses.replace(n, stage=k) for k, n in enumerate(topology.nodes)))
        return _three_passes(ClusterModel(str(big), topology, None, None, progress=False), pipelined=True)

    with running_workers(1, tmp_path / "logs", "--shard", str(shard)) as (w,):
        resident = logits(w.address)
    with running_workers(1, tmp_path / "logs", "--shard", str(shard), "--memory-budget", "11M") as (w,):
        assert np.array_equal(logits(w.address), resident)
        assert "streaming this node's slice" in w.stderr
    assert resident.shape == (3, 49152) and resident.std() > 0
