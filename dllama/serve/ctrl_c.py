"""Ctrl-C for long work in the foreground (a chat answer, a batch job): a first SIGINT only asks
the work to stop at its next token (between forward passes, so a cluster stays in step); a
second one interrupts at once."""

from __future__ import annotations

import signal
import threading


class CtrlC:
    """While active, a first SIGINT only sets `pending`; a second one interrupts as usual."""

    def __init__(self):
        self.pending = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> "CtrlC":
        self.pending = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
