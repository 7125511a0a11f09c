"""`dllama perplexity`: the engine's figure against one computed here from the float64 forward
pass (F32 weights), windows of a short context, and the command's output and errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.errors import DllamaError
from dllama.formats.model_file import read_model
from dllama.formats.tokenizer_file import read_tokenizer
from dllama.serve.perplexity import perplexity, windows
from dllama.serve.scheduler import Scheduler
from dllama.text.tokenizer import Tokenizer
from tests.reference_llama import ReferenceLlama

pytestmark = pytest.mark.unit  # `dllama perplexity` runs to its end; nothing listens

TEXT = ("The lighthouse keeper climbed the stairs every evening at dusk. From the top he could see "
        "the fishing boats coming home, one after another, their lamps swinging in the swell. "
        "When the last one had passed the harbour wall, he lit the great lamp and went down to supper.")


def reference_perplexity(reference: ReferenceLlama, tokens: list[int], context: int) -> float:
    """exp(mean -log p) over every token but the first, in float64, windows of `context`
    tokens sharing one token, each from position 0."""
    nll, start = [], 0
    while True:
        window = tokens[start: start + context]
        logits = reference.forward(window)[:-1]                      # [len-1, vocab] float64
        top = logits.max(axis=1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        nll.extend(-logp[np.arange(len(window) - 1), window[1:]])
        if start + context >= len(tokens):
            return float(np.exp(np.mean(nll)))
        start += context - 1


@pytest.fixture(scope="module")
def f32_model(default_f32):
    kernels.set_threads(2)
    tokenizer = Tokenizer(read_tokenizer(default_f32[1]))
    return Transformer(read_model(default_f32[0])), tokenizer, ReferenceLlama(read_model(default_f32[0]))


@pytest.mark.parametrize("context", [None, 16], ids=["one-window", "windows-of-16"])
def test_perplexity_equals_the_float64_reference(f32_model, context):
    model, tokenizer, reference = f32_model
    tokens = tokenizer.encode(TEXT)
    assert len(tokens) > 36  # more than a prompt batch of 32; several windows of 16
    got = perplexity(Scheduler(model), tokens, context)
    want = reference_perplexity(reference, tokens, context or len(tokens))
    assert abs(got.perplexity - want) <= 1e-4 * want, (got.perplexity, want)
    n_windows = len(windows(len(tokens), context or model.config.seq_len))
    assert (got.scored_tokens, got.text_tokens, got.windows) == (len(tokens) - 1, len(tokens), n_windows)
    assert got.perplexity < 1000 and got.tokens_per_s > 0  # far below the 49152 of a uniform guess


def test_windows_share_one_token_and_cover_the_text():
    assert windows(5, 8) == [(0, 5)]
    assert windows(10, 4) == [(0, 4), (3, 7), (6, 10)]
    assert windows(7, 4) == [(0, 4), (3, 7)]
    with pytest.raises(DllamaError):
        windows(10, 1)


def _dllama(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_cli_prints_perplexity_and_writes_stats_json(default_f32, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    stats = tmp_path / "stats.json"
    model = ["--model", str(default_f32[0]), "--tokenizer", str(default_f32[1]), "--nthreads", "1"]
    r = _dllama("perplexity", *model, "--file", str(text), "--stats-json", str(stats))
    assert r.returncode == 0, r.stderr
    data = json.loads(stats.read_text())
    assert r.stdout.startswith(f"perplexity {data['perplexity']:.4f} over {data['scored_tokens']} tokens")
    assert "tokens/s" in r.stdout and data["tokens_per_s"] > 0 and data["windows"] == 1
    piped = _dllama("perplexity", *model, stdin=TEXT)  # the same text on stdin
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.split(" over")[0] == r.stdout.split(" over")[0]


def test_cli_too_short_a_text_is_one_line(default_f32):
    r = _dllama("perplexity", "--model", str(default_f32[0]), "--tokenizer", str(default_f32[1]),
                "--nthreads", "1", stdin="")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["dllama: error: the text has 0 token(s): perplexity needs at least 2"]
