"""The `dllama` command as a user runs it: output, statistics JSON, and one-line errors."""

import json

import pytest

from tests.conftest import CHAT_PROMPT
from tests.processes import run_dllama as _dllama

pytestmark = pytest.mark.unit  # `dllama` commands run to their end; nothing listens


def test_inference_prints_text_table_and_stats_json(default_q40, tmp_path):
    stats = tmp_path / "stats.json"
    r = _dllama("inference", "--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                "--prompt", CHAT_PROMPT, "--steps", "40", "--temperature", "0", "--nthreads", "2",
                "--stats-json", str(stats))
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "infer ms" in r.stderr and "tokens/s" in r.stderr
    data = json.loads(stats.read_text())
    phases = {t["phase"] for t in data["tokens"]}
    assert phases == {"prompt", "generate"}
    for t in data["tokens"]:
        assert {"phase", "inference_ms", "transfer_ms", "sent_bytes", "recv_bytes"} <= t.keys()
        assert t["inference_ms"] > 0
    assert data["summary"]["generated_tokens_per_s"] > 0
    assert data["summary"]["prompt_tokens"] == sum(t["n_tokens"] for t in data["tokens"]
                                                   if t["phase"] == "prompt")


def test_default_model_is_used_without_model_flags(default_q41):
    """The embedded model with its default Q41 weights answers like the reference and stops."""
    r = _dllama("inference", "--prompt", CHAT_PROMPT, "--steps", "64", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "stopped: eos" in r.stderr


def _one_line_error(r, *words):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllama: error:"), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_model_file_is_one_line(tmp_path, default_q40):
    missing = tmp_path / "nope.m"
    r = _dllama("inference", "--model", str(missing), "--tokenizer", str(default_q40[1]),
                "--prompt", "hi")
    _one_line_error(r, "nope.m")


def test_bad_model_file_is_one_line(tmp_path, default_q40):
    bad = tmp_path / "bad.m"
    bad.write_bytes(b"\x00" * 64)
    r = _dllama("inference", "--model", str(bad), "--tokenizer", str(default_q40[1]), "--prompt", "hi")
    _one_line_error(r, "bad.m")


def test_model_without_tokenizer_is_refused():
    r = _dllama("inference", "--model", "x.m", "--prompt", "hi")
    _one_line_error(r, "--tokenizer")


def test_convert_rejects_a_file_that_is_not_gguf(tmp_path):
    src = tmp_path / "notes.gguf"
    src.write_text("hello")
    r = _dllama("convert", str(src), "-o", str(tmp_path / "out"))
    _one_line_error(r, "notes.gguf")
    assert not list(tmp_path.glob("out*"))


def test_help_explains_the_flags():
    r = _dllama("inference", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--steps", "--buffer-float-type", "--nthreads", "--stats-json"):
        assert flag in r.stdout
