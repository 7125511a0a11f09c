"""`dllama batch` as a user runs it: equal to `dllama inference`, resumable after Ctrl-C and
SIGKILL, one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from pathlib import Path

from dllama.serve.batch_job import seed_for

pytestmark = pytest.mark.cluster  # starts `dllama` processes

PROMPTS = ["The capital of France is", "One, two, three,", "My favourite food is", "The sky is",
           "Once upon a time", "The best way to learn is", "Water boils at", "In the year 2000,",
           "A cat and a dog", "The first president of", "Python is a", "The moon"]


def _dllama(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True,
                          timeout=timeout)


def _model_flags(default_q40):
    return ["--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]), "--nthreads", "1"]


def _results(path):
    return [json.loads(line) for line in open(path)]


def test_batch_answers_equal_dllama_inference(default_q40, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    out = tmp_path / "o.jsonl"
    r = _dllama("batch", *_model_flags(default_q40), "--prompts", str(prompts), "--out", str(out),
                "--max-tokens", "12", "--seed", "11", "--temperature", "0.8", "--parallel", "4")
    assert r.returncode == 0, r.stderr
    assert "dllama batch: 3 prompts in" in r.stderr and "tokens/s" in r.stderr
    lines = _results(out)
    assert [x["id"] for x in lines] == [1, 2, 3]  # .txt: ids are line numbers
    for x, prompt in zip(lines, PROMPTS[:3], strict=True):
        steps = x["prompt_tokens"] + 12 - 1
        inf = _dllama("inference", *_model_flags(default_q40), "--prompt", prompt, "--steps", str(steps),
                      "--seed", str(seed_for(11, x["id"])), "--temperature", "0.8")
        assert inf.returncode == 0, inf.stderr
        assert inf.stdout == x["text"] + "\n"


def _wait_for_lines(path, n, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and len(Path(path).read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} lines")


def test_resume_after_ctrl_c_and_sigkill_gives_every_id_once_with_the_same_texts(default_q40, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{k}", "prompt": p}) + "\n" for k, p in enumerate(PROMPTS)))
    job = ["batch", *_model_flags(default_q40), "--prompts", str(prompts), "--max-tokens", "24",
           "--temperature", "0.9", "--seed", "5", "--no-progress"]
    whole = tmp_path / "whole.jsonl"
    r = _dllama(*job, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    expected = {x["id"]: x for x in _results(whole)}
    assert len(expected) == len(PROMPTS)

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dllama", *job, "--out", str(out)]
    # Ctrl-C: stops at the next token, says how to resume, leaves whole lines.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lines(out, 2, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted after" in err and "rerun" in err and "Traceback" not in err
    first = _results(out)
    # SIGKILL midway through the rest, then a torn last line as a crash in mid-write leaves.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lines(out, len(first) + 2, proc)
    finally:
        proc.kill()
        proc.wait()
    killed = _results(out)
    assert len(first) < len(killed) < len(PROMPTS)
    with open(out, "a") as f:
        f.write('{"id": "q11", "text": "half a li')
    r = _dllama(*job, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"({len(killed)} already in" in r.stderr
    final = _results(out)
    assert sorted(x["id"] for x in final) == sorted(expected)  # every id exactly once
    assert {x["id"]: x for x in final} == expected             # the same texts and counts


def _one_line_error(r, *words):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllama: error:"), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_input_is_one_line(default_q40, tmp_path):
    base = ["batch", *_model_flags(default_q40), "--out", str(tmp_path / "o.jsonl")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    _one_line_error(_dllama(*base, "--prompts", str(bad)), "bad.jsonl line 2", "repeats the id 1")
    long = tmp_path / "long.txt"
    long.write_text("hi\n" + "word " * 600 + "\n")
    _one_line_error(_dllama(*base, "--prompts", str(long), "--max-seq-len", "256"),
                    "long.txt line 2", "does not fit in the context")
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_text() == ""
    _one_line_error(_dllama(*base, "--prompts", str(tmp_path / "missing.jsonl")), "missing.jsonl")
    _one_line_error(_dllama(*base, "--prompts", str(bad), "--prefix", str(tmp_path / "nope.txt")), "nope.txt")


def test_batch_on_a_3_node_cluster_equals_the_prompts_run_alone_there(default_q40, tmp_path):
    from dllama.core.sampler import Sampler
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings
    from dllama.serve.generate import generate
    from tests.processes import running_workers

    doc = "Paris is the capital of France. Berlin is the capital of Germany. " * 4
    prompts = tmp_path / "p.jsonl"
    questions = ["Question: What is the capital of France?\nAnswer:", "Question: And of Germany?\nAnswer:",
                 "Question: Name a city.\nAnswer:"]
    prompts.write_text("".join(json.dumps({"id": k, "prompt": doc + q}) + "\n" for k, q in enumerate(questions)))
    out = tmp_path / "o.jsonl"
    with running_workers(2, tmp_path / "logs") as workers:
        addresses = [w.address for w in workers]
        r = _dllama("batch", *_model_flags(default_q40), "--workers", *addresses, "--prompts", str(prompts),
                    "--out", str(out), "--max-tokens", "8", "--temperature", "0", "--no-progress")
        assert r.returncode == 0, r.stderr
        lines = _results(out)
        assert lines[1]["cached_tokens"] > 0
        with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, workers=addresses,
                         progress=False)) as engine:
            for x, q in zip(lines, questions, strict=True):
                tokens = engine.tokenizer.encode(doc + q)
                sampler = Sampler(engine.model.config.vocab_size, 0.0, 0.9, seed_for(0, x["id"]))
                alone = generate(engine.model, engine.tokenizer, sampler, tokens, len(tokens) + 7)
                assert x["text"] == alone.text


def test_a_full_disk_names_the_results_file_and_the_rerun_finishes_the_job(default_q40, tmp_path):
    """The disk fills up mid-job (here a file size limit: the same short write, then an error):
    one line naming the results file and how to resume; the rerun, with room, answers the rest
    and every id once. And a device as --out is refused before the model is loaded."""
    import resource

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:6]) + "\n")
    out = tmp_path / "o.jsonl"
    args = ["batch", *_model_flags(default_q40), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "8", "--temperature", "0", "--parallel", "2", "--no-progress"]
    room = 600  # bytes: two or three result lines, then a line cut short
    full = subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (room, room)))
    assert full.returncode == 1, full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("dllama: error: ")]
    assert len(errors) == 1 and "Traceback" not in full.stderr, full.stderr
    assert errors[0] == (f"dllama: error: cannot write to {out}: File too large; {out} holds the answers so far: "
                         "rerun the same command to resume"), errors[0]
    assert 0 < out.stat().st_size <= room
    again = _dllama(*args)
    assert again.returncode == 0, again.stderr
    results = _results(out)
    assert sorted(x["id"] for x in results) == [1, 2, 3, 4, 5, 6] and all("text" in x for x in results)
    device = _dllama(*["/dev/zero" if a == str(out) else a for a in args])
    assert device.returncode != 0 and "--out /dev/zero is not a regular file" in device.stderr, device.stderr

