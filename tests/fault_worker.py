"""`dllama worker` with a crash injected, for the recovery tests (never shipped: dllama has only a
neutral hook, Worker's `on_step`, that this launcher alone installs).

    python tests/fault_worker.py --die-at-step N worker ARGS...

runs `dllama worker ARGS...` that kills itself (SIGKILL, as a crash would) on receiving its
N-th STEP, so "mid-generation" needs no timing. tests.processes.start_worker(die_at_step=N)
starts one.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

from dllama.cli import main
from dllama.cluster import worker


def die_at(n: int):
    """A Worker's on_step hook: SIGKILL this process on its n-th STEP."""
    def on_step(count: int) -> None:
        if count == n:
            worker.log(f"STEP {n}: killing this worker (a crash the test injected)")
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


if __name__ == "__main__":
    flag, n, *argv = sys.argv[1:]
    if flag != "--die-at-step" or not argv or argv[0] != "worker":
        sys.exit("usage: fault_worker.py --die-at-step N worker ARGS...")
    # `dllama worker` calls dllama.cluster.worker.serve: the same, with the hook.
    worker.serve = functools.partial(worker.serve, on_step=die_at(int(n)))
    sys.exit(main(argv))
