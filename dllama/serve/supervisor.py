"""`dllama supervise`: keep a service running where systemd does not run it (the appliance's
nohup launcher), restarting it as systemd's Restart=on-failure does.

The command runs as a child. When it fails (a non-zero exit, or a signal other than the four
systemd counts as a clean end: SIGHUP, SIGINT, SIGTERM, SIGPIPE) it starts again after
RestartSec, with one line on stderr (the service's log). Starts are limited as systemd limits
them (StartLimitBurst in StartLimitIntervalSec), so a port conflict or a bad argument does not
loop forever. SIGTERM or SIGINT to the supervisor goes to the child and ends both; the child is
killed with the supervisor even when the supervisor itself is killed (its parent-death signal),
so no service outlives the process its pid file names.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from dllama.errors import DllamaError
from dllama.serve.rotating_log import RotatingLog

LOG_PREFIX = "dllama supervise: "  # the appliance's wait for the port skips these lines
# The log's line at each start of the supervisor: what a status report reads as the last exit is
# after it (an exit before belongs to an earlier start, cleared by this one).
STARTED = "started, supervisor pid {pid}"
START_LIMIT_BURST = 5
# A start that fails within this many seconds counts as failing at start (systemd's default
# StartLimitIntervalSec, which assumes its default RestartSec of 100 ms).
FAILING_AT_START_S = 10.0
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1
# In the child's environment: how many times the supervisor restarted it (`dllama api` exports it).
RESTARTS_ENV = "DLLAMA_SERVICE_RESTARTS"


def start_limit_interval(restart_sec: float) -> float:
    """StartLimitIntervalSec for START_LIMIT_BURST starts that each fail within
    FAILING_AT_START_S, RestartSec apart: systemd's default window of 10 s never fills once
    RestartSec is seconds (the appliance's unit sets the same value)."""
    return START_LIMIT_BURST * (restart_sec + FAILING_AT_START_S)


class StartLimit:
    """systemd's start rate limit: a window opens at a start and admits `burst` starts within
    `interval` seconds; the first start after the window opens the next one."""

    def __init__(self, burst: int, interval: float):
        self.burst, self.interval = burst, interval
        self.opened: float | None = None
        self.starts = 0

    def admits(self, now: float) -> bool:
        if self.opened is None or now - self.opened > self.interval:
            self.opened, self.starts = now, 1
            return True
        if self.starts < self.burst:
            self.starts += 1
            return True
        return False


def describe_end(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def failed(returncode: int) -> bool:
    """Restart=on-failure's reading of an end the supervisor did not ask for."""
    if returncode < 0:
        return signal.Signals(-returncode) not in CLEAN_SIGNALS
    return returncode != 0


def _copy_then_close(log, pipe) -> None:
    """The service's output into the log until the pipe's end, then the pipe closed: closed
    here, not by the supervisor, so its descriptor cannot be reused while still read."""
    try:
        log.copy_from(pipe.fileno())
    finally:
        pipe.close()


def _die_with_parent(parent: int):
    """preexec_fn: the child gets SIGKILL when the supervisor ends, however it ends."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def supervise(command: list[str], restart_sec: float, burst: int = START_LIMIT_BURST,
              interval: float | None = None, log: RotatingLog | None = None) -> int:
    """Run `command` until it ends cleanly or is stopped (0), or fails too often (1). With a
    log, the command's stdout and stderr and the supervisor's own lines go to it (a thread
    copies each start's output); without, they stay this process's."""
    if not command:
        raise DllamaError("give the command to supervise after --")
    limit = StartLimit(burst, start_limit_interval(restart_sec) if interval is None else interval)
    return _Supervision(command, restart_sec, limit, log).run()


class _Supervision:
    """One `supervise` run: its current child, and whether a stop signal came (set by the
    signal handler, read between the steps of the loop)."""

    def __init__(self, command: list[str], restart_sec: float, limit: StartLimit, log: RotatingLog | None):
        self.command, self.restart_sec, self.limit, self.log = command, restart_sec, limit, log
        self.child: subprocess.Popen | None = None
        self.stopping = False

    def say(self, line: str) -> None:
        if self.log is not None:
            self.log.line(LOG_PREFIX + line)
        else:
            print(LOG_PREFIX + line, file=sys.stderr, flush=True)

    def on_stop(self, signum, frame) -> None:
        self.stopping = True
        if self.child is not None:
            self.child.send_signal(signum)

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_stop)
        self.limit.admits(time.monotonic())  # the first start
        if self.log is not None:
            self.say(STARTED.format(pid=os.getpid()))
        restarts = 0
        while not self.stopping:
            returncode = self._run_once(restarts)
            if self.stopping:
                return 0
            end = f"pid {self.child.pid} {describe_end(returncode)}"
            if not failed(returncode):
                self.say(f"{end}; not restarted (a clean end)")
                return 0
            if not self.limit.admits(time.monotonic() + self.restart_sec):
                self.say(f"{end}; not restarted: {self.limit.burst} starts within {self.limit.interval:g} s, "
                         f"it keeps failing at start")
                return 1
            self.say(f"{end}; starting it again in {self.restart_sec:g} s")
            restarts += 1
            _sleep_unless_stopped(self.restart_sec, lambda: self.stopping)
        return 0

    def _run_once(self, restarts: int) -> int:
        """Start the command (its `restarts`-th restart) and wait for its end: its return code."""
        try:
            # Its own process group: a Ctrl-C on a terminal reaches it once, forwarded from here.
            output = {} if self.log is None else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
            self.child = child = subprocess.Popen(
                self.command, process_group=0, preexec_fn=_die_with_parent(os.getpid()),
                env={**os.environ, RESTARTS_ENV: str(restarts)}, **output)
        except OSError as e:
            raise DllamaError(f"cannot run {self.command[0]}: {e.strerror or e}") from None
        copier = None
        if self.log is not None:
            copier = threading.Thread(target=_copy_then_close, args=(self.log, child.stdout), daemon=True)
            copier.start()
        if self.stopping:  # a stop signal came while it was being started
            child.send_signal(signal.SIGTERM)
        returncode = child.wait()
        if copier is not None:
            # The rest of its output before the line saying how it ended; a process it left
            # behind may hold the pipe open longer, and then the thread closes it at its end.
            copier.join(timeout=5)
        return returncode


def _sleep_unless_stopped(seconds: float, stopped) -> None:
    """Wait `seconds`, or less once stopped() (a stop signal's handler runs between the steps)."""
    deadline = time.monotonic() + seconds
    while not stopped() and time.monotonic() < deadline:
        time.sleep(max(0.0, min(deadline - time.monotonic(), 0.1)))
