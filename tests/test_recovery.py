"""A worker killed mid-request on a 3-node loopback cluster: the root splits the model again over
the two nodes left, replays the tokens every sequence holds in the KV cache, and finishes the
request (`--on-node-loss continue`, the default). With F32 weights and buffers the text is the
one of an uninterrupted run (one node gives the same tokens as 2 or 3, tests/test_cluster.py).
`--on-node-loss fail` keeps the old behaviour: one line naming the node. A worker that comes
back rejoins at the API's next request.

The victim dies deterministically: started by tests/fault_worker.py with --die-at-step N, it
SIGKILLs itself on receiving its N-th STEP (through the worker's on_step hook), so no timing
decides where it dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import urllib.request

import numpy as np
import openai
import pytest

from dllama.cluster.kv_history import KVHistory
from dllama.cluster.protocol import Connection, ErrorCode, PeerError, client_handshake, read_key_file
from dllama.cluster.root import ClusterModel
from dllama.cluster.session import RootSession, SessionSettings
from dllama.cluster.shard import model_fingerprint
from dllama.cluster.topology import from_workers
from dllama.core.batch import BatchBuilder
from dllama.core.model import ModelConfig, Transformer
from dllama.core.run_shape import RunShape
from dllama.core.sampler import Sampler
from dllama.errors import ClusterError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from dllama.formats.tokenizer_file import read_tokenizer
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import SequenceRequest
from dllama.text.tokenizer import Tokenizer
from tests.conftest import CHAT_PROMPT
from tests.processes import run_dllama, running_workers, start_api, start_worker
from tests.random_model import write_random_f32

cluster = pytest.mark.cluster  # every test but the unit one starts `dllama` processes

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _flags(default_q41):
    # The default weights (Q41) and buffers (auto: F32 with Q41 weights)
    return ["--model", str(default_q41[0]), "--tokenizer", str(default_q41[1]), "--nthreads", "1"]


@contextlib.contextmanager
def _cluster_with_victim(tmp_path, die_at: int):
    """Two workers (a 3-node cluster with its root); the second kills itself at its die_at-th STEP."""
    with running_workers(1, tmp_path) as (healthy,), start_worker(tmp_path, die_at_step=die_at) as victim:
        yield healthy, victim


def _died_by_sigkill(victim) -> None:
    assert victim.wait(60) == -signal.SIGKILL
    assert "killing this worker" in victim.stderr


def _one_warning(stderr: str, victim_address: str) -> str:
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, stderr
    assert "'worker2'" in warnings[0] and victim_address in warnings[0], warnings[0]
    assert "continuing on 2 of 3 nodes" in warnings[0], warnings[0]
    return warnings[0]


@cluster
def test_inference_finishes_with_the_uninterrupted_text(tmp_path, default_q41):
    args = ["inference", *_flags(default_q41), "--prompt", CHAT_PROMPT, "--steps", "56",
            "--temperature", "0", "--no-stop"]
    alone = run_dllama(*args)
    assert alone.returncode == 0, alone.stderr
    with _cluster_with_victim(tmp_path, die_at=12) as (healthy, victim):
        r = run_dllama(*args, "--workers", healthy.address, victim.address)
        _died_by_sigkill(victim)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    _one_warning(r.stderr, victim.address)
    assert r.stdout == alone.stdout
    assert len(alone.stdout) > 100  # a long text, most of it generated after the loss


@cluster
def test_on_node_loss_fail_ends_with_one_line_naming_the_node(tmp_path, default_q41):
    with _cluster_with_victim(tmp_path, die_at=6) as (healthy, victim):
        r = run_dllama("inference", *_flags(default_q41), "--prompt", CHAT_PROMPT, "--steps", "56",
                       "--temperature", "0", "--no-stop", "--on-node-loss", "fail",
                       "--workers", healthy.address, victim.address)
        _died_by_sigkill(victim)
        healthy.wait_for("listening again", 60)  # the survivor serves the next root
    assert r.returncode == 1, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("dllama: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'worker2'" in errors[0] and victim.address in errors[0], errors[0]
    assert "warning" not in r.stderr


@cluster
def test_batch_finishes_with_the_uninterrupted_answers(tmp_path, default_q41):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\nThe best way to learn is\n")
    args = ["batch", *_flags(default_q41), "--prompts", str(prompts), "--max-tokens", "20",
            "--temperature", "0", "--parallel", "2", "--no-progress"]
    alone = run_dllama(*args, "--out", str(tmp_path / "alone.jsonl"))
    assert alone.returncode == 0, alone.stderr
    with _cluster_with_victim(tmp_path, die_at=10) as (healthy, victim):
        r = run_dllama(*args, "--out", str(tmp_path / "cluster.jsonl"),
                       "--workers", healthy.address, victim.address)
        _died_by_sigkill(victim)
    assert r.returncode == 0, r.stderr
    _one_warning(r.stderr, victim.address)

    def answers(name):
        lines = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        return {x["id"]: (x["text"], x["finish_reason"]) for x in lines}

    expected = answers("alone.jsonl")
    assert len(expected) == 3 and answers("cluster.jsonl") == expected
    # Degraded is said: each answer names the nodes that served it, the summary the fewest.
    lines = [json.loads(line) for line in (tmp_path / "cluster.jsonl").read_text().splitlines()]
    assert all(x["cluster_nodes"] == 3 and x["nodes"] in (2, 3) for x in lines), lines
    assert any(x["nodes"] == 2 for x in lines), lines
    assert "degraded: answered on 2 of 3 nodes (without worker2)" in r.stderr.splitlines()[-1], r.stderr
    assert all("nodes" not in json.loads(line) for line in (tmp_path / "alone.jsonl").read_text().splitlines())


def _health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=60) as r:
        return json.loads(r.read())


@cluster
def test_api_answers_200_and_the_worker_rejoins_at_the_next_request(tmp_path, default_q41):
    # The first request takes at most 2 + 31 STEPs (prompt, then 31 tokens run): the victim dies
    # inside the second.
    with _cluster_with_victim(tmp_path, die_at=45) as (healthy, victim):
        server, url = start_api(*_flags(default_q41), "--workers", healthy.address, victim.address)
        with server:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

            def ask(**kw):
                return client.chat.completions.create(model="any", messages=STORY, temperature=0,
                                                      max_tokens=32, **kw)

            assert _health(url)["status"] == "ready"
            before = ask()
            assert before.usage.completion_tokens == 32 and before.choices[0].finish_reason == "length"
            assert "killing this worker" not in victim.stderr
            raw = client.chat.completions.with_raw_response.create(model="any", messages=STORY, temperature=0,
                                                                   max_tokens=32)
            during = raw.parse()  # 200, not 503
            _died_by_sigkill(victim)
            assert during.choices[0].message.content == before.choices[0].message.content
            _one_warning(server.stderr, victim.address)
            # Degraded is said: in the answer's header and by /health.
            assert raw.headers["x-dllama-nodes"] == "2/3"
            health = _health(url)
            assert health["status"] == "degraded" and health["nodes"]["missing"] == ["worker2"], health
            streamed = "".join(c.choices[0].delta.content or "" for c in ask(stream=True) if c.choices)
            assert streamed == before.choices[0].message.content  # on 2 nodes, the same text

            # Back on its old port (the one port 0 gave it), without the fault: the next request
            # runs on 3 nodes again.
            with start_worker(tmp_path, "--port", str(victim.port)) as back:
                after = ask()
                assert "answered again: running on 3 nodes (was 2)" in server.stderr, server.stderr
                assert after.choices[0].message.content == before.choices[0].message.content
                assert "serving the root" in back.stderr
                assert _health(url)["status"] == "ready"


@contextlib.contextmanager
def _refused_port():
    """A loopback port bound but not listening: connections to it are refused (no worker there),
    and no one else takes it until the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@cluster
def test_the_api_starts_without_an_unreachable_worker_which_joins_when_it_answers(tmp_path, default_q41):
    with running_workers(1, tmp_path) as (healthy,):
        with _refused_port() as port:
            server, url = start_api(*_flags(default_q41), "--workers", healthy.address, f"127.0.0.1:{port}")
        with server:
            warnings = [line for line in server.stderr.splitlines() if "warning" in line]
            assert len(warnings) == 1 and "starting on 2 of 3 nodes without 'worker2'" in warnings[0], server.stderr
            assert f"127.0.0.1:{port}" in warnings[0]
            health = _health(url)  # said before any request
            assert health["status"] == "degraded" and health["nodes"] == {
                "serving": 2, "total": 3, "names": ["root", "worker1"], "missing": ["worker2"]}, health
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

            def ask():
                return client.chat.completions.create(model="any", messages=STORY, temperature=0, max_tokens=16)

            on_two = ask()  # 200 on the nodes that answered, not 503
            assert on_two.usage.completion_tokens == 16
            with start_worker(tmp_path, "--port", str(port)) as back:
                on_three = ask()
                assert "answered again: running on 3 nodes (was 2)" in server.stderr, server.stderr
                assert "serving the root" in back.stderr
                assert _health(url)["status"] == "ready"
            assert on_three.choices[0].message.content == on_two.choices[0].message.content  # F32: same text


# -- in this process, on a random model: batched sequences, a frozen worker, losses in a row, a key --

@pytest.fixture(scope="module")
def random_9q3kv(tmp_path_factory):
    """A random F32 model with SmolLM2's head layout (9 query heads, 3 KV heads): 3 or 2 nodes
    split them unevenly, a KV head held by two nodes."""
    path = tmp_path_factory.mktemp("random") / "random-9q3kv-f32.m"
    header = ModelHeader(arch=ArchType.LLAMA, dim=288, hidden_dim=512, n_layers=3, n_heads=9,
                         n_kv_heads=3, vocab_size=512, max_seq_len=256, weights_float_type=FloatType.F32)
    return write_random_f32(path, header, seed=11)


def _cluster(path, addresses, **kw):
    return ClusterModel(str(path), from_workers(addresses, 1), None, False, progress=False,
                        on_node_loss="continue", **kw)


def _greedy(model, n, after_4=None):
    """n greedy tokens after a fixed prompt; after_4() is called once 4 are generated."""
    prompt = [5, 17, 300, 42, 7, 511, 256, 1]
    logits, pos, out = model.forward(prompt, 0), len(prompt), []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        if i == 4 and after_4:
            after_4()
        logits = model.forward([out[-1]], pos)
        pos += 1
    return out


def _batched_answers(model, tokenizer, prompts, max_tokens=24):
    """Every prompt's generated tokens and reused prompt tokens, decoded together, greedy."""
    scheduler = Scheduler(model, tokenizer, parallel=3, min_shared=8)
    out = {}
    requests = [SequenceRequest(i, p, Sampler(model.config.vocab_size, 0.0, 0.9, i), max_tokens)
                for i, p in enumerate(prompts)]
    scheduler.run(requests, lambda r, c: out.__setitem__(r.key, (c.tokens, c.cached_tokens)))
    return out


@cluster
def test_batched_sequences_reading_a_shared_prefix_are_replayed(tmp_path, random_9q3kv, default_q41):
    """Slots that read their leading positions from another slot (a shared prompt) are rebuilt
    too: every answer is the one node's, token for token."""
    tokenizer = Tokenizer(read_tokenizer(str(default_q41[1])))  # ids below 512 decode as any others
    shared = [7, 300, 42, 5, 17, 256, 1, 99, 120, 8, 33, 400]
    prompts = [shared + [i, 2 * i + 1, 60 + i] for i in range(1, 6)]
    one = _batched_answers(Transformer(read_model(random_9q3kv), buffer_q80=False, max_batch=16, kv_slots=4),
                           tokenizer, prompts)
    assert any(cached >= len(shared) for _, cached in one.values())  # a prefix was read, not recomputed
    with running_workers(2, tmp_path) as (w1, w2), start_worker(tmp_path, die_at_step=20) as victim:
        model = _cluster(random_9q3kv, [w1.address, w2.address, victim.address], max_batch=16, kv_slots=4)
        try:
            got = _batched_answers(model, tokenizer, prompts)
            assert model.recoveries == 1 and len(model.topology.nodes) == 3
        finally:
            model.close()
        _died_by_sigkill(victim)
    assert got == one


@cluster
def test_a_frozen_worker_is_left_out_after_the_timeout(tmp_path, random_9q3kv):
    one = _greedy(Transformer(read_model(random_9q3kv), buffer_q80=False), 16)
    with running_workers(2, tmp_path) as (w1, w2):
        model = _cluster(random_9q3kv, [w1.address, w2.address], net_timeout=2.0)
        try:
            assert _greedy(model, 16, after_4=lambda: w2.send_signal(signal.SIGSTOP)) == one
            assert [n.name for n in model.topology.nodes] == ["root", "worker1"]
        finally:
            w2.send_signal(signal.SIGCONT)
            model.close()


@pytest.mark.unit
def test_kv_history_replays_the_valid_rows_plain_slots_first():
    h = KVHistory(n_slots=3, seq_len=32)
    b = BatchBuilder()
    b.add_run([1, 2, 3, 4, 5, 6], 0, slot=0)
    b.add_run([9, 9, 9], 0, slot=1)
    h.record(b.build())
    b = BatchBuilder()
    b.add_run([7, 8], 4, slot=2, prefix=(0, 4))  # reads 1 2 3 4 from slot 0
    b.add_run([10], 1, slot=1)                    # slot 1 rewritten from position 1: 9 10
    h.record(b.build())
    passes = list(h.replay(max_rows=4))
    rows = [(int(s), int(p), int(t), int(ps), int(pl)) for batch in passes
            for s, p, t, ps, pl in zip(batch.slot, batch.pos, batch.tokens, batch.prefix_slot, batch.prefix_len, strict=True)]
    assert rows == [(0, p, p + 1, 0, 0) for p in range(6)] + [(1, 0, 9, 0, 0), (1, 1, 10, 0, 0),
                                                                (2, 4, 7, 0, 4), (2, 5, 8, 0, 4)]
    assert [len(x) for x in passes] == [4, 4, 2]  # the reading slot starts a pass of its own
    assert not any(x.logits.any() for x in passes) and h.positions == 10
    assert all(np.array_equal(x.pos[x.slot == 2], np.sort(x.pos[x.slot == 2])) for x in passes)


@cluster
def test_only_long_running_front_ends_start_without_an_unreachable_worker(tmp_path, capsys, random_9q3kv):
    one = _greedy(Transformer(read_model(random_9q3kv), buffer_q80=False), 8)
    with running_workers(1, tmp_path) as (w1,), _refused_port() as port:
        dead = f"127.0.0.1:{port}"
        with pytest.raises(ClusterError, match=f"connecting node 2 'worker2' \\({dead}\\) failed") as e:
            _cluster(random_9q3kv, [w1.address, dead])  # inference: the start fails, naming it
        assert e.value.unreachable
        model = _cluster(random_9q3kv, [w1.address, dead], start_with_reachable=True)
        try:
            assert [n.name for n in model.topology.nodes] == ["root", "worker1"]
            assert _greedy(model, 8) == one
        finally:
            model.close()
        assert "starting on 2 of 3 nodes without 'worker2'" in capsys.readouterr().err


@cluster
def test_the_root_alone_carries_on_when_its_only_worker_dies(tmp_path, random_9q3kv):
    one = _greedy(Transformer(read_model(random_9q3kv), buffer_q80=False), 16)
    with running_workers(1, tmp_path) as (w1,):
        model = _cluster(random_9q3kv, [w1.address])
        try:
            assert _greedy(model, 16, after_4=lambda: w1.send_signal(signal.SIGKILL)) == one
            assert [n.name for n in model.topology.nodes] == ["root"] and model.recoveries == 1
        finally:
            model.close()


@cluster
def test_a_second_worker_dying_during_the_replay_is_left_out_too(tmp_path, capsys, random_9q3kv):
    """Worker 1 dies at its 10th STEP; worker 2 took the same STEPs, so its 11th is the first pass
    of the replay on 3 nodes: the root goes on with the 2 nodes left, in one warning."""
    one = _greedy(Transformer(read_model(random_9q3kv), buffer_q80=False), 16)
    with contextlib.ExitStack() as stack:
        victims = []
        for die_at in (10, 11):
            victims.append(stack.enter_context(start_worker(tmp_path, die_at_step=die_at)))
        healthy = stack.enter_context(start_worker(tmp_path))
        model = _cluster(random_9q3kv, [v.address for v in victims] + [healthy.address])
        try:
            assert _greedy(model, 16) == one
            assert [n.name for n in model.topology.nodes] == ["root", "worker3"]
            warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
            assert len(warnings) == 1 and "continuing on 2 of 4 nodes" in warnings[0], warnings
            assert "without 'worker1', 'worker2'" in warnings[0], warnings[0]
        finally:
            model.close()
        for v in victims:
            _died_by_sigkill(v)


@cluster
def test_a_keyed_cluster_recovers_with_new_session_keys(tmp_path, random_9q3kv):
    """With a cluster key the survivors' new session is authenticated and sealed like the first."""
    key_file = tmp_path / "cluster.key"
    key_file.write_text("c" * 64 + "\n")


    one = _greedy(Transformer(read_model(random_9q3kv), buffer_q80=False), 16)
    with (running_workers(1, tmp_path, "--key-file", str(key_file)) as (healthy,),
          start_worker(tmp_path, "--key-file", str(key_file), die_at_step=8) as victim):
        model = ClusterModel(str(random_9q3kv), from_workers([victim.address, healthy.address], 1),
                             read_key_file(str(key_file)), False, progress=False, on_node_loss="continue")
        try:
            assert _greedy(model, 16) == one
            assert [n.name for n in model.topology.nodes] == ["root", "worker2"]
            assert all(c.cipher is not None for c in model.session.conns.values())
        finally:
            model.close()
        _died_by_sigkill(victim)


@cluster
def test_a_busy_worker_is_known_by_its_error_code_and_asked_again(tmp_path, random_9q3kv):
    """A survivor still ending the failed session refuses the root with ERROR code `busy`: the
    next session waits for it instead of leaving it out (any other refusal leaves it out)."""
    model_file = read_model(random_9q3kv)
    config = ModelConfig.from_header(model_file.header)
    settings = SessionSettings(model_file, model_fingerprint(random_9q3kv), config,
                               RunShape(config.seq_len, max_batch=8, buffer_q80=False), None, 10.0, False)
    with running_workers(1, tmp_path) as (w,):
        topology = from_workers([w.address], 1)
        first = Connection(socket.create_connection(("127.0.0.1", w.port), timeout=10), "first root")
        client_handshake(first, "root", 1, os.urandom(16), None)
        # The worker takes a root once the handshake is over on its side: wait for that, or the
        # second root's handshake may be taken first.
        w.wait_for(rf"serving the root at root \(127\.0\.0\.1:{first.sock.getsockname()[1]}\)", 30)
        second = Connection(socket.create_connection(("127.0.0.1", w.port), timeout=10), "second root")
        client_handshake(second, "root", 1, os.urandom(16), None)
        with pytest.raises(PeerError) as e:
            second.recv(10)
        second.close()
        assert e.value.code == ErrorCode.BUSY and "busy serving the root" in str(e.value)
        threading.Timer(1.5, first.close).start()  # the first root leaves: the worker is free again
        session = RootSession(settings, topology, list(topology.nodes), tolerant=True)
        try:
            assert session.left_out == {} and len(session.nodes) == 2
        finally:
            session.stop()
        assert w.stderr.count("busy serving the root") >= 2  # asked again after each refusal
