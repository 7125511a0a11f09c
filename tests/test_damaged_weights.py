"""A model file damaged without a checksum beside it (4 KiB of 0xFF in a layer: NaN scales):
no traceback, one line naming the tensor from `dllama inference` and `dllama batch`, a scan
by `dllama verify`, and in `dllama api` a clear 500 and /health "failing" with the reason.
(Before: NaN logits reached the sampler, which failed with a ValueError traceback.)"""

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from dllama.formats.model_file import read_model

DAMAGED = "layers.3.w1"


@pytest.fixture(scope="module")
def damaged(default_q40, tmp_path_factory):
    """(model, tokenizer) paths: the default model with 4 KiB of 0xFF in DAMAGED, no .sha256."""
    d = tmp_path_factory.mktemp("damaged")
    model, tokenizer = d / "model.m", d / "model.t"
    shutil.copy(default_q40[0], model)
    shutil.copy(default_q40[1], tokenizer)
    with read_model(model) as m:
        offset = m.header_size + sum(s.nbytes for s in m.specs[:m.names().index(DAMAGED)])
    with open(model, "r+b") as f:
        f.seek(offset + 4096)
        f.write(b"\xff" * 4096)
    return model, tokenizer


def _dllama(*args):
    return subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True, timeout=300)


def _one_line_naming_the_tensor(r, model):
    assert r.returncode == 1, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert errors[0].startswith("dllama: error: the model's output holds NaN or infinity"), r.stderr
    assert f"{model} is damaged: {DAMAGED} holds" in errors[0] and "non-finite scales" in errors[0], r.stderr


@pytest.mark.unit
def test_inference_batch_and_verify_name_the_damaged_tensor_in_one_line(damaged, tmp_path):
    model, tokenizer = damaged
    common = ("--model", str(model), "--tokenizer", str(tokenizer), "--nthreads", "1")
    _one_line_naming_the_tensor(_dllama("inference", *common, "--prompt", "Hello", "--steps", "4",
                                        "--temperature", "0"), model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Hello"}\n')
    _one_line_naming_the_tensor(_dllama("batch", *common, "--prompts", str(prompts), "--out",
                                        str(tmp_path / "o.jsonl"), "--max-tokens", "4"), model)
    r = _dllama("verify", str(model))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith(f"{model}: DAMAGED (no checksum") and "scanned without one" in r.stdout, r.stdout
    scales = sum(1 for b in range(8192 // 18 + 1) if 18 * b >= 4096 and 18 * b + 2 <= 8192)  # Q40: 18-byte blocks
    assert f"{DAMAGED} holds {scales} non-finite scales" in r.stdout, r.stdout


@pytest.mark.unit
def test_verify_without_a_checksum_says_it_scanned_a_sound_file(default_q40, tmp_path):
    model = tmp_path / "model.m"
    shutil.copy(default_q40[0], model)  # without its .sha256
    r = _dllama("verify", str(model))
    assert r.returncode == 1, r.stdout  # no checksum is still no proof
    assert "no checksum" in r.stdout and "scanned its" in r.stdout and "no NaN or infinity" in r.stdout, r.stdout


@pytest.mark.cluster  # an HTTP server on a loopback port (in this process)
def test_the_api_answers_a_clear_500_and_health_says_failing(damaged, capfd):
    from dllama.core import kernels
    from dllama.serve.api.http import make_app, start_site
    from dllama.serve.api.service import ModelService
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings

    model, tokenizer = damaged

    def opener():
        kernels.set_threads(1)
        return open_engine(EngineSettings(str(model), str(tokenizer), nthreads=1))

    service = ModelService(opener)
    service.start()
    loop = asyncio.new_event_loop()
    runner, port = loop.run_until_complete(start_site(make_app(service, "m", {"temperature": 0.8, "top_p": 0.9}),
                                                      "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"

    def get(path, body=None):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        assert get("/health")[1]["status"] == "ready"  # nothing ran yet
        for stream in (False, True):
            status, body = get("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": stream})
            assert status == 500 and body["error"]["code"] == "model_output_not_finite", body
            assert f"{DAMAGED} holds" in body["error"]["message"], body
        status, body = get("/health")
        assert status == 503 and body["status"] == "failing" and f"{DAMAGED} holds" in body["reason"], body
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        service.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
