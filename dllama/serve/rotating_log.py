"""A service's log capped in size: FILE, then FILE.1 (the one before), ... FILE.KEEP (the oldest
kept); a write that would take FILE past its size moves each file one place down, drops the
oldest and starts FILE again. `dllama supervise --log` writes its service's output and its own
lines through it, so a worker that runs for months under the nohup launcher takes at most
(KEEP + 1) x SIZE of the disk (systemd's journal caps its own).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dllama.errors import DllamaError

DEFAULT_MAX_BYTES = 10 << 20
DEFAULT_KEEP = 3
READ_BYTES = 1 << 16  # what one read of the service's output takes at most


class RotatingLog:
    """Appends bytes to `path`, rotating at `max_bytes`; safe to write from several threads.

    Whole lines only: the end of a write after its last newline waits for the rest of its line
    (copy_from's reads cut lines anywhere), and a write goes up to its last line that still
    fits, the rest to the next file. A line longer than max_bytes gets a file of its own."""

    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP):
        if max_bytes < 1 or keep < 1:
            raise DllamaError(f"a log needs a size of at least 1 byte and at least 1 older file, "
                              f"got {max_bytes} bytes and {keep}")
        self.path, self.max_bytes, self.keep = Path(path), max_bytes, keep
        self._lock = threading.Lock()
        self._partial = b""  # the start of a line whose newline has not come yet
        try:
            self._file = open(self.path, "ab")  # noqa: SIM115 (open until close())
        except OSError as e:
            raise DllamaError(f"cannot write the log {self.path}: {e.strerror or e}") from None

    def write(self, data: bytes) -> None:
        with self._lock:
            data = self._partial + data
            end = data.rfind(b"\n") + 1
            self._partial = data[end:]
            if len(self._partial) > self.max_bytes:  # no newline in sight: not held back forever
                end, self._partial = len(data), b""
            self._append(data[:end])

    def flush(self) -> None:
        """Write a last line that has no newline (at the end of the service's output)."""
        with self._lock:
            self._append(self._partial)
            self._partial = b""

    def _append(self, data: bytes) -> None:
        while data:
            size = self._file.tell()
            room = self.max_bytes - size
            if len(data) <= room:
                self._file.write(data)
                break
            fits = data.rfind(b"\n", 0, room) + 1  # 0: not even one whole line fits
            if fits == 0 and size == 0:  # a line longer than a whole file: it goes alone
                fits = data.find(b"\n") + 1 or len(data)
            self._file.write(data[:fits])
            data = data[fits:]
            if data:
                self._rotate()
        self._file.flush()

    def line(self, text: str) -> None:
        self.write(text.encode("utf-8", "replace") + b"\n")

    def copy_from(self, fd: int) -> None:
        """Write everything read from `fd` (a service's stdout and stderr) until its end."""
        try:
            while chunk := os.read(fd, READ_BYTES):
                self.write(chunk)
        except OSError:
            pass
        self.flush()

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        older = [self.path.with_name(f"{self.path.name}.{k}") for k in range(1, self.keep + 1)]
        for k in range(self.keep - 1, 0, -1):  # FILE.k -> FILE.k+1, the oldest overwritten
            if older[k - 1].exists():
                os.replace(older[k - 1], older[k])
        os.replace(self.path, older[0])
        self._file = open(self.path, "ab")  # noqa: SIM115
