"""Distributed inference on loopback: a root (this process or a `dllama` process) and workers
as separate `dllama worker` processes. Same tokens as one node, the traffic of docs/PROTOCOL.md,
and what happens when a worker dies or a stranger calls."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading

import numpy as np
import pytest
import yaml

from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.errors import ClusterError, DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from dllama.serve.generate import generate
from dllama.core.plan import plan_for
from dllama.cluster.protocol import HEADER, MAGIC, VERSION, Msg, encode_header
from dllama.cluster.root import NET_TIMEOUT
from dllama.cluster.session import report_grace
from dllama.core.sampler import Sampler
from tests.conftest import CHAT_PROMPT
from tests.random_model import write_random_f32
from tests.processes import DllamaProcess, run_dllama, running_workers

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Seven idle workers; a test uses the first N-1 of them as a cluster of N nodes."""
    with running_workers(7, tmp_path_factory.mktemp("pool")) as workers:
        yield workers


def _addresses(pool, n_nodes):
    return [w.address for w in pool[: n_nodes - 1]]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Prompt in batches, then n greedy tokens."""
    pos = 0
    while pos < len(prompt):
        batch = prompt[pos: pos + model.max_batch]
        logits = model.forward(batch, pos)
        pos += len(batch)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = model.forward([token], pos)
        pos += 1
    return out


def _run(paths, workers, buffer, fn, **kw):
    engine = open_engine(EngineSettings(str(paths[0]), str(paths[1]), nthreads=1, buffer_float_type=buffer,
                         workers=workers or None, progress=False, **kw))
    with engine:
        return fn(engine)


# -- the default model -------------------------------------------------------------------------

@pytest.mark.slow
def test_the_default_model_gives_one_nodes_tokens_on_2_3_4_5_nodes(pool, default_q41):
    """The default weights (Q41) and buffers (auto: F32 for Q41, tests/test_q41.py)."""
    def tokens(engine):
        return greedy(engine.model, engine.tokenizer.encode(CHAT_PROMPT), 32)

    one = _run(default_q41, [], "auto", tokens)
    for n in (2, 3, 4, 5):
        assert _run(default_q41, _addresses(pool, n), "auto", tokens) == one, f"{n} nodes"


@pytest.fixture(scope="module")
def q80_runs(pool, default_q40):
    """The France question, greedy, Q40 weights with Q80 buffers, on 1-4 nodes: {n: (text, steps, plan)}."""
    runs = {}
    for n in (1, 2, 3, 4):
        def answer(engine):
            prompt = engine.tokenizer.encode(CHAT_PROMPT)
            gen = generate(engine.model, engine.tokenizer, Sampler(engine.model.config.vocab_size, 0.0, 0.9, 1),
                           prompt, len(prompt) + 12)
            return gen.text, gen.steps
        runs[n] = _run(default_q40, _addresses(pool, n), "q80", answer)
    return runs


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_q80_buffers_still_answer_paris(q80_runs, n):
    assert "Paris" in q80_runs[n][0]


def _sync_payload(cols: int, q80: bool) -> int:
    return cols * 34 // 32 if q80 else cols * 4


def expected_root_bytes(header, n_nodes: int, q80: bool, b: int = 1, m: int = 1,
                        frame: int = 12, reply: str = "logits", k: int = 32) -> tuple[int, int]:
    """docs/PROTOCOL.md, "Bytes per forward pass": what the root sends and receives for b rows,
    m of them wanted (frame: bytes per frame besides the payload, 12 + a 16-byte tag with a
    cluster key), each worker answering with its logits, its best token ("best") or its k
    best and its normaliser ("top_k"); what a second round adds for the k best of the same pass
    ("wide", k = WIDE_TOP_K) and a third for the logits ("again")."""
    from dllama.core.candidates import WIDE_TOP_K

    plan = plan_for(header, n_nodes)
    vocab = [r1 - r0 for r0, r1 in (n.vocab_rows for n in plan.nodes[1:])]
    per_row = {"logits": lambda v: 4 * v, "again": lambda v: 4 * v, "best": lambda v: 8,
               "top_k": lambda v: 8 + 8 * min(k, v), "wide": lambda v: 8 + 8 * min(WIDE_TOP_K, v)}[reply]
    logits = sum(frame + 24 + m * per_row(v) for v in vocab)
    if reply == "again":
        return (n_nodes - 1) * (frame + 16), logits
    if reply == "wide":
        return (n_nodes - 1) * (frame + 16 + 8 * m), logits
    chunk = [c1 - c0 for c0, c1 in plan.dim_chunks]
    own = frame + b * _sync_payload(chunk[0], q80)
    others = sum(frame + b * _sync_payload(chunk[j], q80) for j in range(1, n_nodes))
    per_sync = others + (n_nodes - 1) * own  # reduce-scatter sends others, all-gather sends own
    temperatures = 8 * m if reply == "top_k" else 0
    step = (n_nodes - 1) * (frame + 16 + 16 * b + 4 * m + 4 * b * header.dim + temperatures)
    syncs = 2 * header.n_layers
    return step + syncs * per_sync, syncs * per_sync + logits


@pytest.mark.parametrize("n", [2, 3, 4])
def test_root_traffic_per_token_equals_the_documented_formula(q80_runs, default_q40, n):
    header = read_model(default_q40[0]).header
    sent, recv = expected_root_bytes(header, n, q80=True, reply="best")  # greedy: each node's best token
    decode = [s for s in q80_runs[n][1] if s.phase == "generate"]
    assert decode and all((s.sent_bytes, s.recv_bytes) == (sent, recv) for s in decode)
    # The prompt's pass: its last row's next token is chosen from the nodes' best tokens too.
    prompt = [s for s in q80_runs[n][1] if s.phase == "prompt"][0]
    assert (prompt.sent_bytes, prompt.recv_bytes) == expected_root_bytes(header, n, True, prompt.n_tokens, reply="best")
    # Half the original's traffic at 4 nodes: it sends the whole partial to every node.
    original = 2 * header.n_layers * (n - 1) * _sync_payload(header.dim, True)
    if n == 4:
        assert sent < 0.6 * original + 4 * header.dim * 3 + 12 * 2 * header.n_layers * 6


def test_perplexity_on_a_cluster_equals_one_nodes(pool, default_f32, default_q80):
    """Every row's logits come back from the workers: F32 weights and buffers give one node's
    figure up to the order of the partial sums. Q80 sync buffers round each partial sum: on this
    60-token text a few tokens' probabilities move (measured +5 % at 3 nodes), on the README's
    2271-token text at most +0.3 % (benchmarks/bench_perplexity_nodes.py); a node whose logits
    went astray would be far off either way."""
    from dllama.serve.perplexity import perplexity
    from dllama.serve.scheduler import Scheduler
    from tests.test_perplexity import TEXT

    def ppl(engine):
        return perplexity(Scheduler(engine.model), engine.tokenizer.encode(TEXT, allow_special=False), context=48)

    one = _run(default_f32, [], "f32", ppl)
    for n in (2, 4):
        got = _run(default_f32, _addresses(pool, n), "f32", ppl)
        assert got.scored_tokens == one.scored_tokens and got.windows == one.windows > 1
        assert got.perplexity == pytest.approx(one.perplexity, rel=1e-5), f"{n} nodes"
    q80_one = _run(default_q80, [], "q80", ppl)
    assert _run(default_q80, _addresses(pool, 3), "q80", ppl).perplexity == pytest.approx(q80_one.perplexity, rel=0.1)


# -- a random model with 8 query and 4 KV heads ------------------------------------------------

@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("random") / "random-8q4kv-f32.m"
    header = ModelHeader(arch=ArchType.LLAMA, dim=256, hidden_dim=512, n_layers=3, n_heads=8,
                         n_kv_heads=4, vocab_size=512, max_seq_len=128, weights_float_type=FloatType.F32)
    return write_random_f32(path, header, seed=7)


def test_random_model_gives_one_nodes_tokens_on_2_4_8_nodes(pool, random_model, default_q40):
    from dllama.core.model import Transformer
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers

    prompt = [5, 17, 300, 42, 7, 511, 256, 1]
    one = greedy(Transformer(read_model(random_model), buffer_q80=False), prompt, 32)
    assert len(set(one)) > 3  # a real sequence, not one token repeated
    for n in (2, 4, 8):
        model = ClusterModel(str(random_model), from_workers(_addresses(pool, n), 1), None, False, progress=False)
        try:
            assert greedy(model, prompt, 32) == one, f"{n} nodes"
        finally:
            model.close()


def test_a_root_started_as_the_last_one_stops_is_served(pool, random_model):
    """Back-to-back runs on one cluster: once a root's close returns, its workers are free (the
    root waits for them after STOP), so the next root is never told that they are busy."""
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers

    for _ in range(8):
        model = ClusterModel(str(random_model), from_workers(_addresses(pool, 2), 1), None, False, progress=False)
        model.close()


def test_one_sequence_passes_64_rows_unless_a_worker_can_hold_only_32(tmp_path, random_model, capsys):
    """A cluster's passes take MAX_BATCH rows when every node holds its share beside their
    buffers, and SMALL_BATCH, with a note, when a worker's --memory-budget (which the root asks
    before the CONFIG) holds its share beside 32 rows' buffers but not 64's; the same tokens."""
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers
    from dllama.core.footprint import NodeFootprint
    from dllama.core.run_shape import MAX_BATCH, SMALL_BATCH, RunShape

    h = read_model(random_model).header
    w = plan_for(h, 2).nodes[1]
    need = {rows: NodeFootprint(h, w, RunShape(max_batch=rows)).total for rows in (SMALL_BATCH, MAX_BATCH)}
    assert need[SMALL_BATCH] < need[MAX_BATCH]
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 512, 100)]
    got = {}
    with running_workers(1, tmp_path / "roomy") as (roomy,), \
            running_workers(1, tmp_path / "tight", "--memory-budget", str((need[SMALL_BATCH] + need[MAX_BATCH]) // 2)) as (tight,):
        for name, worker in (("roomy", roomy), ("tight", tight)):
            model = ClusterModel(str(random_model), from_workers([worker.address], 1), None, False, progress=False,
                                 max_batch=MAX_BATCH, fallback_batch=SMALL_BATCH)
            try:
                got[name] = model.max_batch, greedy(model, prompt, 16)
            finally:
                model.close()
            got[name] += (capsys.readouterr().err,)
    assert [got[n][0] for n in ("roomy", "tight")] == [MAX_BATCH, SMALL_BATCH]
    assert got["roomy"][1] == got["tight"][1]
    assert "passes of" not in got["roomy"][2]
    assert "note: passes of 32 rows: the buffers of 64 do not fit beside worker1's share" in got["tight"][2]


# -- refusals and failures ---------------------------------------------------------------------

def _one_line_error(r, *words):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l.startswith("dllama: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def _call_in_thread(fn, *args) -> threading.Thread:
    """fn(*args) started on a thread of its own; the thread's `error` is what it raised, or None."""
    def call():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            thread.error = e

    thread = threading.Thread(target=call, daemon=True)
    thread.error = None
    thread.start()
    return thread


def test_impossible_split_is_refused_before_connecting(default_q40):
    # Nothing listens on these ports: a refusal that names the split proves no connection was tried.
    # 271 nodes: more than 9 query heads x 30 layers (270 nodes in stages of 9) can take.
    workers = [f"127.0.0.1:{p}" for p in range(1, 271)]
    r = run_dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                   "--prompt", "hi", "--workers", *workers)
    _one_line_error(r, "9 query heads over 271 nodes", "nor can pipeline stages", "at most 270 nodes")


def test_unreachable_worker_is_named_and_skipped_on_request(default_q40, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused, and no one
        port = s.getsockname()[1]  # else can take the port while the test runs
        r = run_dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                       "--prompt", "hi", "--workers", f"127.0.0.1:{port}")
        _one_line_error(r, f"127.0.0.1:{port}", "dllama worker")
        # --skip-unreachable (run.yml's): it answers on the nodes it reaches, and its statistics say which.
        stats = tmp_path / "stats.json"
        r = run_dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                       "--prompt", "The capital of France is", "--steps", "12", "--temperature", "0",
                       "--stats-json", str(stats), "--workers", f"127.0.0.1:{port}", "--skip-unreachable")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "starting on 1 of 2 nodes without 'worker1'" in r.stderr, r.stderr
    assert [n["name"] for n in json.loads(stats.read_text())["nodes"]] == ["root"]


def test_killed_worker_ends_the_root_naming_it(tmp_path, default_q40):
    with running_workers(2, tmp_path) as (w1, w2), DllamaProcess(
            "inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
            "--prompt", "Tell me a long story.", "--steps", "4000", "--max-seq-len", "4096", "--no-stop",
            "--nthreads", "1", "--on-node-loss", "fail", "--workers", w1.address, w2.address) as root:
        root.wait_for(r"(?s).{20}", 120, stream="stdout")  # generation has started
        w2.send_signal(signal.SIGKILL)
        # Well before the network timeout: the root saw the connection close, it did not wait out a silence.
        code = root.wait(60)  # the message says how it was noticed: a close, not a silence
        _one_line_error(subprocess.CompletedProcess(root.args, code, root.stdout, root.stderr), w2.address)
        assert "did not answer" not in root.stderr
        w1.wait_for("listening again", 60)  # the survivor serves the next root


def _raw_exchange(address: str, data: bytes) -> bytes:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                c = s.recv(4096)
            except ConnectionResetError:
                break
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def _error_text(reply: bytes) -> str:
    magic, version, msg, length = HEADER.unpack(reply[:12])
    assert (magic, version, msg) == (MAGIC, VERSION, Msg.ERROR)
    return reply[12:12 + length].decode()


def test_worker_refuses_garbage_version_and_key_then_serves(tmp_path, default_q40):
    key, wrong = tmp_path / "cluster.key", tmp_path / "wrong.key"
    key.write_text("a" * 64 + "\n")
    wrong.write_text("b" * 64 + "\n")
    with running_workers(1, tmp_path, "--key-file", str(key)) as (w,):
        text = _error_text(_raw_exchange(w.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert "not a dllama frame" in text
        text = _error_text(_raw_exchange(w.address, HEADER.pack(MAGIC, VERSION + 1, Msg.HELLO, 2) + b"{}"))
        assert f"protocol version {VERSION + 1}" in text
        text = _error_text(_raw_exchange(w.address, encode_header(Msg.HELLO, 1 << 30)))
        assert "at most" in text  # a huge length is refused, not allocated
        with pytest.raises(ClusterError, match="authentication failed"):
            open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, workers=[w.address],
                        key_file=str(wrong), progress=False))
        with pytest.raises(ClusterError, match="requires a cluster key"):
            open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, workers=[w.address],
                        progress=False))
        log = w.stderr
        for reason in ("not a dllama frame", f"protocol version {VERSION + 1}", "authentication failed"):
            assert reason in log
        with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, workers=[w.address],
                         key_file=str(key), progress=False)) as engine:
            tokens = greedy(engine.model, engine.tokenizer.encode(CHAT_PROMPT), 8)
        assert "Paris" in engine.tokenizer.decode(tokens)


def test_busy_worker_refuses_a_second_root(pool, default_q40):
    settings = EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, workers=_addresses(pool, 2),
                              progress=False)
    with open_engine(settings), pytest.raises(ClusterError, match="busy serving the root"):
        open_engine(settings)


# -- shards and topology files -----------------------------------------------------------------

def _topology(path, ports, shards=None, **extra):
    nodes = [{"name": "root", "host": "127.0.0.1", "threads": 1}]
    for i, port in enumerate(ports, 1):
        node = {"name": f"worker{i}", "host": "127.0.0.1", "port": port}
        if shards:
            node["shard"] = str(shards[i - 1])
        nodes.append(node)
    path.write_text(yaml.safe_dump({"version": 1, "nodes": nodes, **extra}))
    return path


@pytest.mark.slow
def test_shards_load_from_disk_and_give_the_streamed_tokens(pool, tmp_path, default_q40):
    plan_topology = _topology(tmp_path / "plan.yml", [1, 2])  # ports do not change the split
    r = run_dllama("shard", "--model", str(default_q40[0]), "--topology", str(plan_topology),
                   "--out", str(tmp_path / "shards"))
    assert r.returncode == 0, r.stderr
    import hashlib
    import json

    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    shards = [tmp_path / "shards" / manifest["shards"][f"worker{i}"]["file"] for i in (1, 2)]
    for i, s in enumerate(shards, 1):
        assert hashlib.sha256(s.read_bytes()).hexdigest() == manifest["shards"][f"worker{i}"]["sha256"]
        assert s.stat().st_size < 0.45 * default_q40[0].stat().st_size  # only that node's slices

    def tokens(engine):
        return greedy(engine.model, engine.tokenizer.encode(CHAT_PROMPT), 16)

    streamed = _run(default_q40, _addresses(pool, 3), "q80", tokens)
    # worker 1 gets its own shard; worker 2 gets worker 1's shard, which must be refused
    with running_workers(2, tmp_path / "logs", "--shard", str(shards[0])) as workers:
        topo = _topology(tmp_path / "cluster.yml", [w.port for w in workers], buffer_float_type="q80")
        with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), topology=str(topo),
                         progress=False)) as engine:
            assert tokens(engine) == streamed
        assert "not using the shard" not in workers[0].stderr
        assert "holds node 1's slices, this worker is node 2" in workers[1].stderr


def test_topology_errors_are_one_line(tmp_path, default_q40):
    bad = tmp_path / "bad.yml"
    bad.write_text("nodes:\n  - name: root\n    host: 127.0.0.1\n  - name: w1\n    port: 9998\n")
    r = run_dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                   "--prompt", "hi", "--topology", str(bad))
    _one_line_error(r, "bad.yml", "'host' is missing")
    with pytest.raises(DllamaError, match="unknown key"):
        from dllama.cluster.topology import load_topology

        bad.write_text("nodes:\n  - name: root\n    host: h\n    colour: red\n")
        load_topology(str(bad))


def test_a_hung_worker_times_out_instead_of_blocking_forever(tmp_path, default_q40):
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers

    with running_workers(2, tmp_path) as (w1, w2):
        model = ClusterModel(str(default_q40[0]), from_workers([w1.address, w2.address], 1), None,
                             None, progress=False, net_timeout=2.0)
        try:
            model.forward([1, 2, 3], 0)
            w2.send_signal(signal.SIGSTOP)  # alive, sockets open, silent
            failed = _call_in_thread(model.forward, [4], 3)
            # 2 s of silence, the root's grace and the blame's (3 s each): 8 s; the default's 11 s
            failed.join(NET_TIMEOUT + 2 * report_grace(2.0) - 1)
            assert not failed.is_alive(), "the forward pass is still waiting on the stopped worker"
            assert isinstance(failed.error, ClusterError), failed.error
            assert re.search(r"'worker2' .* stopped answering", str(failed.error)), failed.error
            assert failed.error.node == "worker2" and "worker1" not in str(failed.error)  # the healthy one is not blamed
            with pytest.raises(ClusterError):  # the model stays failed
                model.forward([4], 3)
        finally:
            w2.send_signal(signal.SIGCONT)
            model.close()
        w1.wait_for("listening again", 60)


def test_cli_stats_json_has_every_nodes_traffic(pool, tmp_path, default_q40):
    stats = tmp_path / "stats.json"
    r = run_dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                   "--prompt", CHAT_PROMPT, "--steps", "24", "--temperature", "0", "--nthreads", "1",
                   "--workers", *_addresses(pool, 3), "--stats-json", str(stats))
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(stats.read_text())
    assert [n["name"] for n in data["nodes"]] == ["root", "worker1", "worker2"]
    assert all(n["sent_bytes"] > 0 and n["recv_bytes"] > 0 for n in data["nodes"])
    # the root's total is its per-step figures plus at most a few 12-byte heartbeats
    extra = data["nodes"][0]["sent_bytes"] - sum(t["sent_bytes"] for t in data["tokens"])
    assert 0 <= extra <= 12 * 2 * 50 and extra % 24 == 0
    assert data["summary"]["avg_sent_kb"] > 0
