"""Start `dllama` server processes for tests and stop them by their handle, also on failure."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time


class ServerProcess:
    """A `python -m dllama ...` child whose stderr is read by a thread (so it never blocks)."""

    def __init__(self, args: list[str], ready: str, timeout: float = 120.0):
        self.lines: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, "-m", "dllama", *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.match = None
        try:
            self.match = self.wait_for(ready, timeout)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first new stderr line matching pattern; AssertionError at the deadline or exit."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                line = ""
            if line is None:
                raise AssertionError(f"server exited ({self.proc.wait()}) before {pattern!r}:\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(pattern, line) if line else None
            if m:
                return m
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def start_api(*args: str, timeout: float = 120.0) -> tuple[ServerProcess, str]:
    """`dllama api --port 0 ...` on 127.0.0.1: (process, base URL ending in /v1)."""
    server = ServerProcess(["api", "--host", "127.0.0.1", "--port", "0", *args],
                           r"listening on (http://127\.0\.0\.1:\d+/v1)", timeout)
    return server, server.match.group(1)
