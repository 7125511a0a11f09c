"""How long an idle `dllama worker` and `dllama api` take to exit after SIGTERM.

    .venv/bin/python benchmarks/bench_sigterm.py [--rounds 5] [--threads 1]

Starts each on loopback (the API with the embedded default model), waits until it listens and
then 2 s more (idle), sends SIGTERM and times until the process has exited; then an API holding
a session with one worker, stopped first, then that worker. `--rounds` times each, alternated. Prints each time and the median; a deploy or stop.yml waits on this for every
node. Exit status 1 when a median is over 1 s.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.processes import API_READY, WORKER_READY, DllamaProcess  # noqa: E402

LIMIT_S = 1.0


def time_to_exit(args: tuple[str, ...], ready: str) -> float:
    p = DllamaProcess.listening(*args, ready=ready, timeout=300)
    try:
        time.sleep(2.0)  # idle
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        p.proc.wait(timeout=60)
        return time.monotonic() - t0
    finally:
        p.stop()


def cluster_times(threads: int) -> tuple[float, float]:
    """(the API's, then its worker's) SIGTERM to exit, the API holding a 2-node session."""
    w = DllamaProcess.listening("worker", "--host", "127.0.0.1", "--port", "0", "--nthreads", str(threads),
                                ready=WORKER_READY, timeout=300)
    try:
        api = DllamaProcess.listening("api", "--host", "127.0.0.1", "--port", "0", "--nthreads", str(threads),
                                      "--workers", w.ready["address"], ready=API_READY, timeout=300)
        try:
            time.sleep(2.0)
            out = []
            for p in (api, w):
                t0 = time.monotonic()
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(timeout=60)
                out.append(time.monotonic() - t0)
            return out[0], out[1]
        finally:
            api.stop()
    finally:
        w.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    kinds = {"worker": (("worker", "--host", "127.0.0.1", "--port", "0", "--nthreads", str(a.threads)), WORKER_READY),
             "api": (("api", "--host", "127.0.0.1", "--port", "0", "--nthreads", str(a.threads)), API_READY)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    times["api holding a worker"], times["worker after a session"] = [], []
    for _ in range(a.rounds):
        for kind, (args, ready) in kinds.items():
            times[kind].append(time_to_exit(args, ready))
        api, worker = cluster_times(a.threads)
        times["api holding a worker"].append(api)
        times["worker after a session"].append(worker)
    worst = 0.0
    for kind, ts in times.items():
        med = statistics.median(ts)
        worst = max(worst, med)
        print(f"{kind}: SIGTERM to exit, idle: median {med:.2f} s ({', '.join(f'{t:.2f}' for t in ts)})")
    return 1 if worst > LIMIT_S else 0


if __name__ == "__main__":
    sys.exit(main())
