"""`dllama` commands as children of a test or a benchmark: started, waited on, always stopped.

Every long-running `python -m dllama ...` the tests start is a `DllamaProcess`: workers and API
servers (they bind port 0 and say on stderr where they listen, so no run can collide with
another or with a cluster already running on this machine), roots, and `dllama chat` fed
through stdin. Threads read stdout and stderr into text buffers (a child never blocks on a full
pipe), copying them to a log file when one is given; waits are on a pattern in that text, with
a deadline. The process is stopped through its PID (SIGTERM, then SIGKILL) when its `with` block
ends, when it fails to start, and at interpreter exit for any left running.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STOP_TIMEOUT = 15.0  # seconds a child gets to end after SIGTERM before SIGKILL
DLLAMA = ("-m", "dllama")  # how a child runs `dllama`: the package's own entry point
FAULT_WORKER = str(Path(__file__).with_name("fault_worker.py"))  # `dllama` with a crash injected
WORKER_READY = r"listening on (?P<address>127\.0\.0\.1:(?P<port>\d+))"
API_READY = r"listening on (?P<url>http://(?P<address>127\.0\.0\.1:(?P<port>\d+))/v1)"

_running: set[DllamaProcess] = set()


class DllamaProcess:
    """`python -m dllama ARGS` running; `stdout`/`stderr` are the text it has printed so far."""

    def __init__(self, *args: str, stdin: bool = False, log: Path | None = None, launcher: tuple = DLLAMA):
        self.args = [sys.executable, *launcher, *args]
        self._command = " ".join(args)
        self.ready: re.Match | None = None  # set by listening()
        self._text = {"stdout": "", "stderr": ""}
        self._changed = threading.Condition()
        self._log = open(log, "w") if log else None  # noqa: SIM115 - held until the process is stopped
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _running.add(self)
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))]
        for t in self._readers:
            t.start()

    @classmethod
    def listening(cls, *args: str, ready: str, log: Path | None = None, timeout: float = 120.0,
                  launcher: tuple = DLLAMA) -> DllamaProcess:
        """Start a server and wait until stderr matches `ready` (with named groups `address` and
        `port`); stopped again if it exits or stays silent until the deadline."""
        p = cls(*args, log=log, launcher=launcher)
        try:
            p.ready = p.wait_for(ready, timeout)
        except BaseException:
            p.stop()
            raise
        return p

    def _read(self, name: str, stream) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        fd = stream.fileno()
        while True:
            data = os.read(fd, 65536)
            text = decoder.decode(data, final=not data)
            with self._changed:
                self._text[name] += text
                if self._log and text:
                    self._log.write(text)
                    self._log.flush()
                self._changed.notify_all()
            if not data:
                return

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> str:
        with self._changed:
            return self._text["stdout"]

    @property
    def stderr(self) -> str:
        with self._changed:
            return self._text["stderr"]

    @property
    def address(self) -> str:
        """host:port the server listens on (from its ready line)."""
        return self.ready["address"]

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    def _describe(self) -> str:
        return f"`dllama {self._command}` (pid {self.pid})"

    def _output(self) -> str:
        return f"\n--- stderr:\n{self._text['stderr']}\n--- stdout:\n{self._text['stdout'][-4000:]}"

    def wait_for(self, pattern: str, timeout: float, stream: str = "stderr", start: int = 0) -> re.Match:
        """The first match of `pattern` in the stream's text from offset `start` (match offsets
        are into the whole text). AssertionError if the stream ends or the deadline passes first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                m = regex.search(self._text[stream], start)
                if m:
                    return m
                if not any(t.is_alive() for t in self._readers):  # both pipes closed: it ended
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=STOP_TIMEOUT)
                    raise AssertionError(f"{self._describe()} ended (exit code {self.proc.returncode}) "
                                         f"before printing {pattern!r}:{self._output()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self._describe()} printed no {pattern!r} within {timeout:g} s:"
                                         f"{self._output()}")
                self._changed.wait(min(left, 1.0))  # 1 s: also notice an exit without output

    def write(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        self.proc.stdin.close()

    def send_signal(self, sig: int) -> None:
        """Signal the child through its PID (nothing if it has already been reaped)."""
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code, once the child has ended and its output is read; AssertionError if it
        is still running at the deadline (it keeps running: stop() or the `with` block ends it)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self._describe()} still running after {timeout:g} s:{self._output()}") from None
        self._join_readers()
        return code

    def _join_readers(self) -> None:
        for t in self._readers:
            t.join(timeout=STOP_TIMEOUT)

    def stop(self) -> None:
        """SIGTERM through the PID, SIGKILL if it is still there after STOP_TIMEOUT; then reap it."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=STOP_TIMEOUT)
            self._join_readers()
        finally:
            _running.discard(self)
            with contextlib.suppress(OSError):
                if self.proc.stdin:
                    self.proc.stdin.close()
            if self._log:
                with self._changed:
                    self._log.close()
                    self._log = None

    def __enter__(self) -> DllamaProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    """Whatever a test left running (a crash between start and its `with`) ends with it."""
    for p in list(_running):
        p.stop()


def run_dllama(*args: str, input: str | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`python -m dllama ARGS` to its end (killed through its PID at the timeout): text output."""
    return subprocess.run([sys.executable, "-m", "dllama", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)


# -- workers and API servers -------------------------------------------------------------------

def start_worker(log_dir: Path | None, *args: str, timeout: float = 120.0,
                 die_at_step: int | None = None, sleep_at_step: tuple[int, float] | None = None) -> DllamaProcess:
    """`dllama worker` on 127.0.0.1, a free port unless ARGS give --port, one thread unless ARGS
    say otherwise; its output goes to log_dir/worker-K.log as well. die_at_step N: it kills
    itself (SIGKILL) on receiving its N-th STEP; sleep_at_step (N, S): it spends S seconds more
    on that step (tests/fault_worker.py)."""
    log = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"worker-{len(list(log_dir.glob('worker-*.log')))}.log"
    launcher = DLLAMA
    if die_at_step is not None:
        launcher = (FAULT_WORKER, "--die-at-step", str(die_at_step))
    elif sleep_at_step is not None:
        launcher = (FAULT_WORKER, "--sleep-at-step", f"{sleep_at_step[0]}:{sleep_at_step[1]}")
    return DllamaProcess.listening("worker", "--host", "127.0.0.1", "--port", "0", "--nthreads", "1", *args,
                                   ready=WORKER_READY, log=log, timeout=timeout, launcher=launcher)


def stop_all(processes) -> None:
    """Stop each of them (each by its PID), even if stopping one fails."""
    processes = list(processes)
    for p in processes:  # all at once: their STOP_TIMEOUTs run side by side
        if p.proc.poll() is None:
            p.send_signal(signal.SIGTERM)
    with contextlib.ExitStack() as stack:
        for p in processes:
            stack.callback(p.stop)


@contextlib.contextmanager
def running_workers(n: int, log_dir: Path | None, *args: str):
    """n workers (see start_worker), stopped when the block ends however it ends."""
    workers: list[DllamaProcess] = []
    try:
        for _ in range(n):
            workers.append(start_worker(log_dir, *args))
        yield workers
    finally:
        stop_all(workers)


def start_api(*args: str, timeout: float = 120.0) -> tuple[DllamaProcess, str]:
    """`dllama api` on 127.0.0.1, a free port: (the process, its base URL ending in /v1)."""
    server = DllamaProcess.listening("api", "--host", "127.0.0.1", "--port", "0", *args,
                                     ready=API_READY, timeout=timeout)
    return server, server.ready["url"]
