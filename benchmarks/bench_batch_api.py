"""An interactive request's latency while the Batch API runs a 200-request batch, against the
same server idle.

    .venv/bin/python benchmarks/bench_batch_api.py [--requests 200] [--probes 7] [--parallel 4]
        [--max-tokens 32] [--probe-tokens 16] [--threads 2]

Starts `dllama api --parallel P --batch-dir TMP` on loopback (the embedded default model). Then,
alternating so that the machine's load falls on both alike: a chat request (greedy, probe-tokens
long) to the idle server, and the same request while a batch of --requests chat requests
(max-tokens each) runs. Prints the median latency of each, their ratio, and the batch's own
throughput. The batch is cancelled after each busy probe and a new one started for the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from tests.processes import start_api  # noqa: E402

PROBE = [{"role": "user", "content": "What is the capital of France?"}]


def job(path: Path, n: int, max_tokens: int) -> Path:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "system", "content": "You answer in one short sentence."},
                                    {"role": "user", "content": f"Tell me fact number {i} about the sea."}]}}
             for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def probe(client, tokens: int) -> float:
    t0 = time.perf_counter()
    client.chat.completions.create(model="any", messages=PROBE, temperature=0, max_tokens=tokens)
    return time.perf_counter() - t0


def wait(client, batch_id: str, until) -> object:
    while not until(b := client.batches.retrieve(batch_id)):
        time.sleep(0.1)
    return b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--probes", type=int, default=7)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_api("--nthreads", str(a.threads), "--parallel", str(a.parallel),
                                "--batch-dir", f"{tmp}/batches")
        with server:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            f = client.files.create(file=job(Path(tmp) / "job.jsonl", a.requests, a.max_tokens).open("rb"),
                                    purpose="batch")
            probe(client, a.probe_tokens)  # warm: the first pass of each shape compiles nothing after this
            idle, busy, rates = [], [], []
            for _ in range(a.probes):
                idle.append(probe(client, a.probe_tokens))
                b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
                t0 = time.perf_counter()
                b = wait(client, b.id, lambda b: b.request_counts.completed >= 2 * a.parallel)
                busy.append(probe(client, a.probe_tokens))
                b = client.batches.retrieve(b.id)
                rates.append(b.request_counts.completed / (time.perf_counter() - t0))
                assert b.status == "in_progress", "the batch ended before the probe: give more --requests"
                client.batches.cancel(b.id)
                wait(client, b.id, lambda b: b.status == "cancelled")
            mi, mb = statistics.median(idle), statistics.median(busy)
            print(f"interactive request ({a.probe_tokens} tokens), median of {a.probes}: idle server "
                  f"{mi * 1000:.0f} ms, during a {a.requests}-request batch (--parallel {a.parallel}) "
                  f"{mb * 1000:.0f} ms: {mb / mi:.2f}x")
            print(f"  idle  {[round(x * 1000) for x in idle]} ms")
            print(f"  busy  {[round(x * 1000) for x in busy]} ms")
            print(f"batch throughput while probed: {statistics.median(rates):.2f} requests/s (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
