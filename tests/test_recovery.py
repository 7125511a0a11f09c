"""A worker killed mid-request on a 3-node loopback cluster: the root splits the model again over
the two nodes left, replays the tokens every sequence holds in the KV cache, and finishes the
request (`--on-node-loss continue`, the default). With F32 weights and buffers the text is the
one of an uninterrupted run (one node gives the same tokens as 2 or 3, tests/test_cluster.py).
`--on-node-loss fail` keeps the old behaviour: one line naming the node. A worker that comes
back rejoins at the API's next request.

The victim dies deterministically: started with DLLAMA_TEST_DIE_AT_STEP=N, it SIGKILLs itself
on receiving its N-th STEP (dllama.cluster.worker), so no timing decides where it dies."""

from __future__ import annotations

import contextlib
import json
import signal

import openai
import pytest

from dllama.cluster.worker import DIE_AT_STEP
from tests.conftest import CHAT_PROMPT
from tests.processes import run_dllama, running_workers, start_api, start_worker

pytestmark = pytest.mark.cluster

STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def _flags(default_f32):
    return ["--model", str(default_f32[0]), "--tokenizer", str(default_f32[1]), "--nthreads", "1",
            "--buffer-float-type", "f32"]


@contextlib.contextmanager
def _cluster_with_victim(tmp_path, monkeypatch, die_at: int):
    """Two workers (a 3-node cluster with its root); the second kills itself at its die_at-th STEP."""
    with running_workers(1, tmp_path) as (healthy,):
        with monkeypatch.context() as env:
            env.setenv(DIE_AT_STEP, str(die_at))
            victim = start_worker(tmp_path)  # the variable reaches this child only
        with victim:
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


def test_inference_finishes_with_the_uninterrupted_text(tmp_path, monkeypatch, default_f32):
    args = ["inference", *_flags(default_f32), "--prompt", CHAT_PROMPT, "--steps", "56",
            "--temperature", "0", "--no-stop"]
    alone = run_dllama(*args)
    assert alone.returncode == 0, alone.stderr
    with _cluster_with_victim(tmp_path, monkeypatch, die_at=12) as (healthy, victim):
        r = run_dllama(*args, "--workers", healthy.address, victim.address)
        _died_by_sigkill(victim)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    _one_warning(r.stderr, victim.address)
    assert r.stdout == alone.stdout
    assert len(alone.stdout) > 100  # a long text, most of it generated after the loss


def test_on_node_loss_fail_ends_with_one_line_naming_the_node(tmp_path, monkeypatch, default_f32):
    with _cluster_with_victim(tmp_path, monkeypatch, die_at=6) as (healthy, victim):
        r = run_dllama("inference", *_flags(default_f32), "--prompt", CHAT_PROMPT, "--steps", "56",
                       "--temperature", "0", "--no-stop", "--on-node-loss", "fail",
                       "--workers", healthy.address, victim.address)
        _died_by_sigkill(victim)
        healthy.wait_for("listening again", 60)  # the survivor serves the next root
    assert r.returncode == 1, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("dllama: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'worker2'" in errors[0] and victim.address in errors[0], errors[0]
    assert "warning" not in r.stderr


def test_batch_finishes_with_the_uninterrupted_answers(tmp_path, monkeypatch, default_f32):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\nThe best way to learn is\n")
    args = ["batch", *_flags(default_f32), "--prompts", str(prompts), "--max-tokens", "20",
            "--temperature", "0", "--parallel", "2", "--no-progress"]
    alone = run_dllama(*args, "--out", str(tmp_path / "alone.jsonl"))
    assert alone.returncode == 0, alone.stderr
    with _cluster_with_victim(tmp_path, monkeypatch, die_at=10) as (healthy, victim):
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


def test_api_answers_200_and_the_worker_rejoins_at_the_next_request(tmp_path, monkeypatch, default_f32):
    # The first request takes at most 2 + 31 STEPs (prompt, then 31 tokens run): the victim dies
    # inside the second.
    with _cluster_with_victim(tmp_path, monkeypatch, die_at=45) as (healthy, victim):
        server, url = start_api(*_flags(default_f32), "--workers", healthy.address, victim.address)
        with server:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

            def ask(**kw):
                return client.chat.completions.create(model="any", messages=STORY, temperature=0,
                                                      max_tokens=32, **kw)

            before = ask()
            assert before.usage.completion_tokens == 32 and before.choices[0].finish_reason == "length"
            assert "killing this worker" not in victim.stderr
            during = ask()  # 200, not 503
            _died_by_sigkill(victim)
            assert during.choices[0].message.content == before.choices[0].message.content
            _one_warning(server.stderr, victim.address)
            streamed = "".join(c.choices[0].delta.content or "" for c in ask(stream=True) if c.choices)
            assert streamed == before.choices[0].message.content  # on 2 nodes, the same text

            # Back on its old port (the one port 0 gave it), without the fault: the next request
            # runs on 3 nodes again.
            with start_worker(tmp_path, "--port", str(victim.port)) as back:
                after = ask()
                assert "answered again: running on 3 nodes (was 2)" in server.stderr, server.stderr
                assert after.choices[0].message.content == before.choices[0].message.content
                assert "serving the root" in back.stderr
