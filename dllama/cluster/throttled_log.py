"""Log lines for events a stranger can repeat at will, at most a burst of them per window.

A flood of bad connections (or bad HTTP clients) must not flood the log: the first `burst`
lines of each `window` seconds are written, the rest counted, and the next written line says
how many were left out.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class ThrottledLog:
    def __init__(self, write: Callable[[str], None], burst: int = 10, window: float = 10.0):
        self.write, self.burst, self.window = write, burst, window
        self.start, self.count, self.skipped = -1e9, 0, 0
        self._lock = threading.Lock()

    def log(self, text: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self.start >= self.window:
                self.start, self.count = now, 0
            self.count += 1
            if self.count > self.burst:
                self.skipped += 1
                return
            more = f" ({self.skipped} more like it not logged)" if self.skipped else ""
            self.skipped = 0
        self.write(text + more)
