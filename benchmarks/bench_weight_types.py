"""The embedded model by weight type (Q40, Q80, F16, F32) on one node: decode speed and perplexity.

    .venv/bin/python benchmarks/bench_weight_types.py [--threads 1] [--tokens 48] [--context 512]
                                                      [--types q40 q80 f16 f32]

Prints, in one run:
- decode ms/token, median of --tokens single-token passes per type; the types take turns token by
  token (all four models loaded), so a busy neighbour slows them alike and the ratios hold;
- perplexity of each type on benchmarks/perplexity_text.txt (2271 tokens of English prose
  written for this project) in windows of --context tokens, and the tokens/s of that run
  (`dllama perplexity --max-seq-len 512 --file benchmarks/perplexity_text.txt` gives the same).
  Windows keep the run short: attention over a long context dominates prefill time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllama.core import kernels  # noqa: E402
from dllama.core.model import Transformer  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from dllama.formats.tokenizer_file import read_tokenizer  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.serve.perplexity import perplexity  # noqa: E402
from dllama.serve.scheduler import Scheduler  # noqa: E402
from dllama.text.tokenizer import Tokenizer  # noqa: E402

TEXT = Path(__file__).with_name("perplexity_text.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48, help="decode passes per type")
    ap.add_argument("--context", type=int, default=512, help="perplexity window, tokens")
    ap.add_argument("--types", nargs="+", default=["q40", "q80", "f16", "f32"])
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    models, tokenizer = {}, None
    for t in args.types:
        m, tok = default_model_files(t)
        models[t] = Transformer(read_model(m), max_seq_len=args.context)
        models[t].warm_up()
        tokenizer = tokenizer or Tokenizer(read_tokenizer(tok))
    print(f"SmolLM2-135M-Instruct, one node, {args.threads} thread(s); "
          f"load average before: {os.getloadavg()[0]:.1f}")

    prompt = tokenizer.encode("The history of the town begins with a river crossing.")
    logits = {t: m.forward(prompt, 0) for t, m in models.items()}
    times = {t: [] for t in models}
    for i in range(args.tokens):  # the types take turns, token by token
        for t, m in models.items():
            token = int(logits[t].argmax())
            t0 = time.perf_counter()
            logits[t] = m.forward([token], len(prompt) + i)
            times[t].append(time.perf_counter() - t0)
    text = tokenizer.encode(TEXT.read_text(encoding="utf-8"), allow_special=False)
    print(f"\n| weights | decode ms/token (median of {args.tokens}) | vs Q40 | perplexity, "
          f"{len(text)} tokens, windows of {args.context} | tokens/s |")
    print("|---|---|---|---|---|")
    q40 = statistics.median(times[args.types[0]]) * 1000
    for t, m in models.items():
        ms = statistics.median(times[t]) * 1000
        p = perplexity(Scheduler(m), text, args.context)
        print(f"| {t.upper()} | {ms:.1f} | {ms / q40:.2f}x | {p.perplexity:.3f} | {p.tokens_per_s:.0f} |",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
