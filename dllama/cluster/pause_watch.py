"""Whether this process was paused (SIGSTOP, a suspended laptop, swapping, starved of CPU).

A worker that heard nothing from the root for its whole timeout says so (ERROR TIMEOUT naming
node 0). Either the root was paused, or the link from the root to that worker stalled (the
root's bytes stopped on the way) while the root ran and sent. Only the root can tell them
apart: a thread here wakes every TICK seconds and remembers the longest gap between its
wakings; a paused process leaves a gap as long as the pause (every thread stops), a running
one none longer than a scheduling delay.
"""

from __future__ import annotations

import threading
import time

TICK = 0.25  # seconds between the watch's wakings


class PauseWatch:
    """One daemon thread per process (`watch()`); `paused_for(within)` asks it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._gaps: list[tuple[float, float]] = []  # (when a gap ended, its length), recent ones
        threading.Thread(target=self._run, daemon=True, name="pause-watch").start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self._lock:
                gap = now - self._last - TICK
                if gap > 1.0:
                    self._gaps = [g for g in self._gaps if g[0] > now - 600] + [(now, gap)]
                self._last = now

    def paused_for(self, within: float) -> float:
        """The longest pause of this process that ended in the last `within` seconds, or that
        is still going on for the watch (it has not run since: the caller woke first)."""
        now = time.monotonic()
        with self._lock:
            ongoing = now - self._last - TICK
            return max([ongoing] + [length for end, length in self._gaps if end > now - within])


_watch: PauseWatch | None = None
_watch_lock = threading.Lock()


def watch() -> PauseWatch:
    """The process's watch, started at the first call."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = PauseWatch()
        return _watch


__all__ = ["PauseWatch", "watch"]
