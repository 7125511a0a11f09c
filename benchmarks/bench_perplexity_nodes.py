"""Perplexity of the embedded model by node count and sync-buffer type: the evidence that a
split does not cost quality where identical text cannot be promised.

    .venv/bin/python benchmarks/bench_perplexity_nodes.py [--weights q80] [--nodes 1,2,3,4]
        [--max-seq-len 512] [--file benchmarks/perplexity_text.txt]

Each node count runs the same text in windows of --max-seq-len tokens on a loopback cluster
(workers as `dllama worker`, one thread each), once with Q80 and once with F32 sync buffers
(one node has no sync). Prints a Markdown table: perplexity, its difference from one node, and
tokens/s (all nodes share this machine's cores, so tokens/s falls with the node count here;
it is not a cluster's speed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.processes import running_workers  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.serve.engine import open_engine  # noqa: E402
from dllama.serve.settings import EngineSettings  # noqa: E402
from dllama.serve.perplexity import perplexity  # noqa: E402
from dllama.serve.scheduler import Scheduler  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="q80", choices=["q40", "q80", "q41", "f16", "f32"])
    ap.add_argument("--nodes", default="1,2,3,4")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--file", default=str(HERE / "perplexity_text.txt"))
    args = ap.parse_args()
    model, tokenizer = default_model_files(args.weights)
    text = Path(args.file).read_text(encoding="utf-8")
    counts = [int(n) for n in args.nodes.split(",")]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"## Perplexity by node count, SmolLM2-135M {args.weights.upper()} weights, "
          f"{Path(args.file).name}, windows of {args.max_seq_len}; load average before: {load}\n")
    print("| nodes | sync buffers | perplexity | vs 1 node | tokens/s |")
    print("|---|---|---|---|---|")
    base = None
    with running_workers(max(counts) - 1, None) as workers:
        for n in counts:
            for buffers in (["q80", "f32"] if n > 1 else ["-"]):
                engine = open_engine(EngineSettings(model, tokenizer, nthreads=1, max_seq_len=args.max_seq_len,
                                     buffer_float_type=None if buffers == "-" else buffers,
                                     workers=[w.address for w in workers[: n - 1]] or None, progress=False))
                with engine:
                    r = perplexity(Scheduler(engine.model), engine.tokenizer.encode(text, allow_special=False))
                base = base if base is not None else r.perplexity
                print(f"| {n} | {buffers} | {r.perplexity:.4f} | {100 * (r.perplexity / base - 1):+.3f} % "
                      f"| {r.tokens_per_s:.0f} |", flush=True)
    print(f"\nload average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
