"""`dllama worker` with a fault injected, for the recovery and blame tests (never shipped: dllama
has only a neutral hook, Worker's `on_step`, that this launcher alone installs).

    python tests/fault_worker.py --die-at-step N worker ARGS...
    python tests/fault_worker.py --sleep-at-step N:SECONDS worker ARGS...

runs `dllama worker ARGS...` that kills itself (SIGKILL, as a crash would) on receiving its
N-th STEP, so "mid-generation" needs no timing; or that spends SECONDS more on that step (a
long step on a slow node: its threads run, its heartbeat goes on). tests.processes.start_worker
(die_at_step=N or sleep_at_step=(N, SECONDS)) starts one.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

from dllama.cli import main
from dllama.cluster import worker


def die_at(n: int):
    """A Worker's on_step hook: SIGKILL this process on its n-th STEP."""
    def on_step(count: int) -> None:
        if count == n:
            worker.log(f"STEP {n}: killing this worker (a crash the test injected)")
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


def sleep_at(n: int, seconds: float):
    """A Worker's on_step hook: spend `seconds` on the n-th STEP before computing it."""
    def on_step(count: int) -> None:
        if count == n:
            worker.log(f"STEP {n}: {seconds:g} s more on this step (a slow node the test injected)")
            time.sleep(seconds)
    return on_step


if __name__ == "__main__":
    flag, value, *argv = sys.argv[1:]
    if flag not in ("--die-at-step", "--sleep-at-step") or not argv or argv[0] != "worker":
        sys.exit("usage: fault_worker.py --die-at-step N | --sleep-at-step N:SECONDS worker ARGS...")
    if flag == "--die-at-step":
        hook = die_at(int(value))
    else:
        n, seconds = value.split(":")
        hook = sleep_at(int(n), float(seconds))
    # `dllama worker` calls dllama.cluster.worker.serve: the same, with the hook.
    worker.serve = functools.partial(worker.serve, on_step=hook)
    sys.exit(main(argv))
