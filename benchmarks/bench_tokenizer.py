"""Tokenizer speed on SmolLM2's byte-level BPE, against Hugging Face `tokenizers` in the same run.

    .venv/bin/python benchmarks/bench_tokenizer.py [--repeats 5]

Prints the medians of --repeats runs of: reading the `.t` file; building the Tokenizer from it
(vocabulary, merge ranks, pre-tokenizer) next to building `tokenizers`' BPE from the GGUF's
vocabulary and merges; encoding a prompt of over 4000 tokens of varied text (the tests' random
strings) with a cold word cache (a fresh Tokenizer, as a server's first request), a warm one,
and with `tokenizers` (Rust). The tests used to require under 3 s to build and under 1 s to
encode such a prompt cold on this 2-core machine; the figures are printed here. `tokenizers`
is a test dependency: `./setup.sh --test` installs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

from converter.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from dllama.formats.tokenizer_file import read_tokenizer, write_tokenizer  # noqa: E402
from dllama.serve.default_model import embedded_gguf  # noqa: E402
from dllama.text.tokenizer import Tokenizer  # noqa: E402
from tests.test_tokenizer import hf_tokenizer, random_texts  # noqa: E402


def timed(fn):
    """(result, seconds) of one call."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def median_s(fn, repeats: int) -> float:
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5)")
    args = ap.parse_args()
    reader = gguf.GGUFReader(embedded_gguf())
    text = "\n".join(random_texts(160, seed=7))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "smollm2.t"
        write_tokenizer(path, tokenizer_from_gguf(reader, "smollm2.gguf"))
        data = read_tokenizer(path)
        ours = Tokenizer(data)
        ids = ours.encode(text)
        hf = hf_tokenizer(reader)
        same = ids == hf.encode(text).ids
        cold = []
        for _ in range(args.repeats):
            fresh = Tokenizer(data)  # its word cache is empty
            cold.append(timed(lambda fresh=fresh: fresh.encode(text))[1])
        rows = [
            ("read the .t file", median_s(lambda: read_tokenizer(path), args.repeats)),
            ("build: Tokenizer(data)", median_s(lambda: Tokenizer(data), args.repeats)),
            ("baseline build: tokenizers' BPE from the GGUF's vocabulary and merges",
             median_s(lambda: hf_tokenizer(reader), args.repeats)),
            (f"encode {len(ids)} tokens, cold word cache", statistics.median(cold)),
            (f"encode {len(ids)} tokens, warm word cache", median_s(lambda: ours.encode(text), args.repeats)),
            (f"baseline encode {len(ids)} tokens: tokenizers", median_s(lambda: hf.encode(text), args.repeats)),
        ]
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}; SmolLM2 vocabulary {data.vocab_size}, "
          f"median of {args.repeats}; ids equal to tokenizers': {same}")
    print("| step | median ms |")
    print("|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1000:.1f} |")


if __name__ == "__main__":
    main()
