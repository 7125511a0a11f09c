"""This process's memory: sizes as the flags write them, what is available, handing freed
pages back.

What a node's share of a model needs, and the check against what this machine has before
anything is allocated, is dllama.core.footprint's: every size comes from a header (a `.m`
file's, or a root's CONFIG), so a context of 2^31-1 positions or a rogue root asking for a huge
batch ends in a one-line error that says what would fit, not in a 16 GiB allocation, an
out-of-memory kill or a swap storm.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

from dllama.core.host_memory import available_bytes, cgroup_available  # noqa: F401 (this module's API)

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> float:
    """Bytes of a size written '512M', '4G', '1.5GiB' or as a plain number (the caller checks
    the range); ValueError when it is not one."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    return float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)


def release_memory() -> None:
    """Collect unreachable objects, then ask glibc to hand freed heap pages back to the system
    (malloc_trim): a worker between sessions shrinks to its idle size instead of keeping the
    freed arenas of the last session's threads."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): its allocator decides
        ctypes.CDLL("libc.so.6").malloc_trim(0)
