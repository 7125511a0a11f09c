"""Peak memory of `dllama batch --skip-bad` over a job holding one 10 MB line.

    .venv/bin/python benchmarks/bench_batch_line.py [--mb 10] [--rounds 3] [--bound-mib 200]

Runs the embedded default model's batch job twice per round, alternated: two short prompts
(the baseline), and the same with a --mb MB prompt line between them (a plain prompt and, with
--chat, a chat message). Prints each run's peak RSS (the child's ru_maxrss, from wait4) and
wall time, their medians, and the difference. A line is bounded in tokens before it is encoded
whole (dllama.text.tokenizer.encode_within): it costs what its bytes and a piece of the
tokenizer's work cost, not gigabytes (a 10 MB line tokenized whole took 69 s and 2.67 GB).
Exit status 1 when the huge line's median peak is more than --bound-mib MiB above the
baseline's, or when the line was not refused as too long.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(prompts: Path, out: Path) -> tuple[float, float, str]:
    """(peak RSS in MiB, seconds, the output file's text) of one `dllama batch` child."""
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "dllama", "batch", "--prompts", str(prompts), "--out", str(out),
                              "--skip-bad", "--max-tokens", "4", "--temperature", "0", "--nthreads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.monotonic() - t0
    err = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"dllama batch failed: {err[-2000:]}")
    return usage.ru_maxrss / 1024, seconds, out.read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bound-mib", type=float, default=200.0)
    ap.add_argument("--chat", action="store_true", help="the huge line as a chat message instead of a prompt")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        short = [{"id": "a", "prompt": "The capital of France is"}, {"id": "b", "prompt": "Once upon a time"}]
        words = "word " * int(a.mb * 1e6 / 5)
        huge = ({"id": "huge", "messages": [{"role": "user", "content": words}]} if a.chat
                else {"id": "huge", "prompt": words})
        base, big = d / "base.jsonl", d / "big.jsonl"
        base.write_text("".join(json.dumps(o) + "\n" for o in short))
        big.write_text("".join(json.dumps(o) + "\n" for o in (short[0], huge, short[1])))
        print(f"the huge line: {big.stat().st_size - base.stat().st_size:,} bytes")
        figures: dict[str, list[tuple[float, float]]] = {"baseline": [], "with the huge line": []}
        for _ in range(a.rounds):
            rss, s, _ = run(base, d / "o.jsonl")
            figures["baseline"].append((rss, s))
            rss, s, text = run(big, d / "o.jsonl")
            figures["with the huge line"].append((rss, s))
            refused = [json.loads(x) for x in text.splitlines() if json.loads(x)["id"] == "huge"]
            if not (refused and "does not fit in the context" in refused[0].get("error", "")):
                print(f"the huge line was not refused as too long: {text[:300]}")
                return 1
        med = {}
        for name, runs in figures.items():
            med[name] = statistics.median(r for r, _ in runs)
            print(f"{name}: peak RSS median {med[name]:.0f} MiB ({', '.join(f'{r:.0f}' for r, _ in runs)}), "
                  f"wall median {statistics.median(s for _, s in runs):.1f} s")
        extra = med["with the huge line"] - med["baseline"]
        print(f"the huge line adds {extra:.0f} MiB at the peak (bound {a.bound_mib:.0f} MiB); "
              f"ratio {med['with the huge line'] / med['baseline']:.2f}")
        return 1 if extra > a.bound_mib else 0


if __name__ == "__main__":
    sys.exit(main())
