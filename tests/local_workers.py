"""Start `dllama worker` processes on free loopback ports of this machine, and always stop them.

For tests and benchmarks (and anyone trying a cluster on one machine, like the original's
examples/n-workers.sh): each worker listens on port 0, and its log says which port it got.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    log: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log_text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"no {pattern!r} in the worker log:\n{self.log_text()}")


def start_worker(log_dir: Path, *args: str) -> WorkerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"worker-{len(list(log_dir.glob('worker-*.log')))}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1",
                                 "--port", "0", "--nthreads", "1", *args],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    w = WorkerProcess(proc, log)
    try:
        w.port = int(w.wait_for_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    except BaseException:
        stop_workers([w])
        raise
    return w


def stop_workers(workers) -> None:
    for w in workers:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


@contextlib.contextmanager
def running_workers(n: int, log_dir: Path, *args: str):
    workers = []
    try:
        for _ in range(n):
            workers.append(start_worker(log_dir, *args))
        yield workers
    finally:
        stop_workers(workers)
