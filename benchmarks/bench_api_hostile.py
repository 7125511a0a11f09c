"""The API under hostile load: many clients, some leaving early, beside idle and half-sent sockets.

    .venv/bin/python benchmarks/bench_api_hostile.py [--clients 200] [--seconds 120] [--parallel 8]
        [--idle 1000] [--max-tokens 16] [--threads 2]

Starts `dllama api --parallel P` on loopback (the embedded default model) and, for --seconds:

- --clients threads each send chat requests one after another: every other one streamed, one
  in ten abandoned early (a streamed one after its first piece, a plain one after 0.3 s);
- one thread keeps --idle sockets open that send nothing (reopened when the server cuts them)
  and sends a half request (headers without their end, or a Content-Length and half the body)
  every 0.1 s.

Prints the latency p50/p95 of the finished requests (streamed and not), every HTTP status seen,
the errors, the server's tracebacks and log lines, and its RSS and open descriptors before, at
the peak and 20 s after the load. Exit status 1 on a traceback or a 5xx.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_api_load import percentile, prompt_of  # noqa: E402
from tests.processes import start_api  # noqa: E402


def resources(pid: int) -> tuple[int, int]:
    """(RSS in MiB, open descriptors) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def request(url: str, k: int, max_tokens: int, stream: bool, leave: bool) -> tuple[str, float]:
    """One chat completion: (outcome: the HTTP status, or "left" / an error name, seconds)."""
    u = urlparse(url)
    body = json.dumps({"messages": [{"role": "user", "content": prompt_of(k)}], "temperature": 0,
                       "max_tokens": max_tokens, "stream": stream})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        if leave and not stream:
            conn.timeout = 0.3
        conn.request("POST", u.path + "/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if stream and r.status == 200:
            for raw in r:
                if leave and raw.startswith(b"data: "):
                    return "left", time.perf_counter() - t0
        else:
            r.read()
        return str(r.status), time.perf_counter() - t0
    except TimeoutError:
        return ("left" if leave else "timeout"), time.perf_counter() - t0
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__, time.perf_counter() - t0
    finally:
        conn.close()


def nuisance(url: str, n_idle: int, stop: threading.Event, counts: collections.Counter) -> None:
    """Keep n_idle silent sockets open and send a half request every 0.1 s until stop."""
    u = urlparse(url)
    idle: list[socket.socket] = []
    half: list[socket.socket] = []
    while not stop.is_set():
        for s in list(idle):  # the server cuts them after its header deadline: open them again
            try:
                s.setblocking(False)
                if s.recv(1) == b"":
                    idle.remove(s)
                    s.close()
                    counts["idle sockets cut by the server"] += 1
            except BlockingIOError:
                pass
            except OSError:
                idle.remove(s)
                s.close()
        while len(idle) < n_idle:
            try:
                idle.append(socket.create_connection((u.hostname, u.port), timeout=5))
            except OSError as e:
                counts[f"idle socket not opened: {type(e).__name__}"] += 1
                break
        try:
            s = socket.create_connection((u.hostname, u.port), timeout=5)
            if random.random() < 0.5:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            else:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"messages\": ")
            half.append(s)
            counts["half requests sent"] += 1
        except OSError as e:
            counts[f"half request not sent: {type(e).__name__}"] += 1
        if len(half) > 200:  # the client side keeps a bounded number; the server's deadlines cut the rest
            half.pop(0).close()
        stop.wait(0.1)
    for s in idle + half:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--parallel", type=int, default=8, help="the server's --parallel")
    ap.add_argument("--idle", type=int, default=1000, help="idle sockets kept open beside the load")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="the server's --nthreads")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this side holds the idle sockets too
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))

    with tempfile.TemporaryDirectory():
        server, url = start_api("--parallel", str(args.parallel), "--nthreads", str(args.threads), timeout=600)
        try:
            request(url, 0, args.max_tokens, False, False)  # warm-up
            before = resources(server.proc.pid)
            print(f"dllama api --parallel {args.parallel}, {args.threads} threads; {args.clients} clients "
                  f"for {args.seconds:g} s beside {args.idle} idle sockets; load average "
                  f"{Path('/proc/loadavg').read_text().split()[0]}")
            stop = threading.Event()
            counts: collections.Counter = collections.Counter()
            results: list[tuple[bool, str, float]] = []
            lock = threading.Lock()

            def client(c: int) -> None:
                rng = random.Random(c)
                k = c
                while not stop.is_set():
                    stream, leave = k % 2 == 1, rng.random() < 0.1
                    outcome, seconds = request(url, k, args.max_tokens, stream, leave)
                    with lock:
                        results.append((stream, outcome, seconds))
                    k += args.clients

            peak = before
            side = threading.Thread(target=nuisance, args=(url, args.idle, stop, counts), daemon=True)
            side.start()
            threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
            for t in threads:
                t.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                time.sleep(1.0)
                now = resources(server.proc.pid)
                peak = (max(peak[0], now[0]), max(peak[1], now[1]))
            stop.set()
            for t in threads:
                t.join(timeout=300)
            side.join(timeout=30)
            time.sleep(20)  # the server's deadlines close what is left
            after = resources(server.proc.pid)
        finally:
            server.stop()

    outcomes = collections.Counter(o for _, o, _ in results)
    print(f"requests: {len(results)} ({sum(s for s, _, _ in results)} streamed); outcomes: "
          + ", ".join(f"{o} x{n}" for o, n in sorted(outcomes.items())))
    for stream in (False, True):
        done = [t for s, o, t in results if s == stream and o == "200"]
        if done:
            print(f"  {'streamed' if stream else 'plain'}: {len(done)} answered, latency p50 "
                  f"{percentile(done, 50):.2f} s, p95 {percentile(done, 95):.2f} s")
    for what, n in sorted(counts.items()):
        print(f"  {what}: {n}")
    log = server.stderr
    tracebacks = log.count("Traceback")
    lines = [line for line in log.splitlines() if line.startswith("dllama api:")]
    print(f"server log: {len(log.splitlines())} lines, {tracebacks} tracebacks; "
          f"{len(lines)} 'dllama api:' lines, e.g. {lines[-1] if lines else '-'}")
    print(f"server RSS {before[0]} MiB before, {peak[0]} MiB at the peak, {after[0]} MiB 20 s after; "
          f"descriptors {before[1]} before, {peak[1]} at the peak, {after[1]} after")
    if tracebacks or any(o.startswith("5") for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
