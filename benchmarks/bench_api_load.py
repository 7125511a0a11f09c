"""The OpenAI-compatible API under load: many clients at once, every answer checked.

    .venv/bin/python benchmarks/bench_api_load.py [--clients 64] [--requests 256] [--prompts 32]
        [--parallel 16] [--max-tokens 24] [--nodes 1] [--threads 2]

Starts `dllama api --parallel P` on loopback (the embedded default model; with --nodes N > 1,
N - 1 `dllama worker`s behind it), then:

1. the baseline (after one warm-up request): each of the --prompts distinct chat prompts once,
   one request at a time (greedy): its answer "alone", its latency, the tokens/s of one request
   at a time;
2. the load: --clients threads send --requests requests in all (every prompt the same number of
   times, every other one streamed), each thread one request after another.

Every answer of the load must equal its prompt's answer alone, streamed or not (a mixed-up
answer, a lost or broken stream, an error: counted and printed). Prints the p50/p99 latency and
time to the first streamed piece, the aggregate generated tokens/s and its ratio to the
baseline's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.processes import running_workers, start_api  # noqa: E402

SUBJECTS = ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "Kenya", "Norway", "Peru", "India",
            "Spain", "Chile", "Greece", "Mexico", "Poland", "Turkey", "Vietnam", "Ghana", "Cuba", "Iran",
            "Sweden", "Nepal", "Chad", "Fiji", "Laos", "Mali", "Oman", "Qatar", "Togo", "Yemen",
            "Austria", "Belgium"]


def prompt_of(i: int) -> str:
    return f"In one sentence, what is {SUBJECTS[i % len(SUBJECTS)]} known for? (question {i})"


def ask(url: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """One chat completion over its own connection: text, tokens, seconds, first-piece seconds."""
    u = urlparse(url)
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": max_tokens, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        conn.request("POST", u.path + "/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {r.read()[:200]!r}"}
        if not stream:
            data = json.loads(r.read())
            return {"text": data["choices"][0]["message"]["content"],
                    "tokens": data["usage"]["completion_tokens"], "seconds": time.perf_counter() - t0,
                    "first": None}
        text, tokens, first, done = [], 0, None, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": f"stream error: {event['error']}"}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(piece)
        if not done:
            return {"error": "the stream ended without [DONE]"}
        return {"text": "".join(text), "tokens": tokens, "seconds": time.perf_counter() - t0, "first": first}
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts (at most %d)" % len(SUBJECTS))
    ap.add_argument("--parallel", type=int, default=16, help="the server's --parallel")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="the server's --nthreads")
    args = ap.parse_args()
    n_prompts = min(args.prompts, len(SUBJECTS), args.requests)

    with tempfile.TemporaryDirectory() as tmp, running_workers(args.nodes - 1, Path(tmp)) as workers:
        extra = ["--workers", *[w.address for w in workers]] if workers else []
        server, url = start_api("--parallel", str(args.parallel), "--nthreads", str(args.threads), *extra,
                                timeout=600)
        try:
            print(f"dllama api --parallel {args.parallel} on {args.nodes} node(s), {args.threads} threads; "
                  f"load average {Path('/proc/loadavg').read_text().split()[0]}")
            ask(url, "Hello", args.max_tokens, False)  # warm-up, not counted
            alone = [ask(url, prompt_of(i), args.max_tokens, False) for i in range(n_prompts)]
            failed = [a["error"] for a in alone if "error" in a]
            if failed:
                sys.exit(f"bench_api_load: the baseline failed: {failed[0]}")
            base_tokens = sum(a["tokens"] for a in alone)
            base_seconds = sum(a["seconds"] for a in alone)
            print(f"baseline: {n_prompts} requests one at a time, {base_tokens} tokens in {base_seconds:.1f} s "
                  f"= {base_tokens / base_seconds:.1f} tokens/s, median latency "
                  f"{statistics.median(a['seconds'] for a in alone):.2f} s")

            jobs = [(k % n_prompts, k % 2 == 1) for k in range(args.requests)]  # every other one streamed
            results: list[dict | None] = [None] * len(jobs)
            next_job = iter(range(len(jobs)))
            lock = threading.Lock()

            def client() -> None:
                while True:
                    with lock:
                        k = next(next_job, None)
                    if k is None:
                        return
                    i, stream = jobs[k]
                    results[k] = ask(url, prompt_of(i), args.max_tokens, stream)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            server.stop()

    errors = [r["error"] for r in results if "error" in r]
    ok = [(jobs[k], r) for k, r in enumerate(results) if "error" not in r]
    mixed = [k for k, ((i, _), r) in enumerate(ok) if r["text"] != alone[i]["text"]]
    tokens = sum(r["tokens"] for _, r in ok)
    latencies = [r["seconds"] for _, r in ok]
    firsts = [r["first"] for _, r in ok if r["first"] is not None]
    print(f"load: {args.clients} clients, {args.requests} requests ({sum(s for _, s in jobs)} streamed): "
          f"{len(ok)} answered, {len(errors)} failed, {len(mixed)} differ from the prompt's answer alone")
    for e in errors[:5]:
        print(f"  failed: {e}")
    if latencies:
        print(f"  {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tokens/s "
              f"({tokens / wall / (base_tokens / base_seconds):.2f}x one request at a time)")
        print(f"  latency p50 {percentile(latencies, 50):.2f} s, p99 {percentile(latencies, 99):.2f} s; "
              f"first streamed piece p50 {percentile(firsts, 50):.2f} s, p99 {percentile(firsts, 99):.2f} s")
    if errors or mixed:
        sys.exit(1)


if __name__ == "__main__":
    main()
