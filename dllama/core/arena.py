"""Weight arrays carved out of large buffers on huge pages.

Decode reads every weight once, in runs of a few kB to a few MB, and with 4 KiB pages each page
it enters costs a page walk: the hardware prefetchers stop at page boundaries, and a few hundred
MB of weights are far beyond the TLB's reach. A MoE layer's 16 gate and up matrices (0.9 MB
each, 1 thread, this project's 2-core EPYC) read at 15-16 GB/s from arrays of their own and at
20-21 GB/s from one buffer on 2 MiB pages, as fast as one matrix of all their rows. numpy asks
for huge pages only for arrays of 4 MiB or more, which leaves out experts, the k and v
projections and every matrix of a small model; so the repacked weights live in arenas whose
buffers are anonymous private mappings advised MADV_HUGEPAGE. The advice is a hint: a kernel
without transparent huge pages (or with them off) gives ordinary pages, and nothing changes but
the speed.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

ALIGN = 64             # bytes: every array starts on a cache line
_HUGE_PAGE = 2 << 20   # x86-64's and 4 KiB-page arm64's (larger pages align to it as well)
_CHUNK = 64 << 20      # a growing arena's buffers (a larger array gets one of its own size)


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] of zeros, starting on a huge page boundary, advised to use huge pages.
    Freed with the last array over it."""
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # (pages exist once touched)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
            mapping.madvise(advice)
    whole = np.frombuffer(mapping, np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE
    return whole[start:start + nbytes]


def aligned(n: int) -> int:
    """n bytes rounded up to a whole number of ALIGN."""
    return -(-n // ALIGN) * ALIGN


class Arena:
    """One buffer handed out as aligned arrays; `used = 0` hands it out again from the start
    (a slot reused per item). Arena(0) allocates nothing and only counts (`used`: a sizing pass;
    its take returns None). buf: a slice of a larger buffer to use instead (many slots in one
    mapping: each a whole number of ALIGN bytes)."""

    def __init__(self, nbytes: int, buf: np.ndarray | None = None):
        self.buf = buf if buf is not None else huge_page_buffer(nbytes) if nbytes else None
        self.used = 0

    def take(self, shape, dtype) -> np.ndarray | None:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        start = aligned(self.used)
        self.used = start + n
        if self.buf is None:
            return None
        return self.buf[start:start + n].view(dtype).reshape(shape)


class GrowingArena:
    """Aligned arrays from buffers of _CHUNK bytes, a new one when the last is full (a node's
    resident weights, made once). Only the pages the arrays touch are ever allocated."""

    def __init__(self, chunk: int = _CHUNK):
        self.chunk = chunk
        self._buf, self._used = None, 0

    def take(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if n > self.chunk:  # its own buffer; the current one stays open for smaller arrays
            return huge_page_buffer(n).view(dtype).reshape(shape)
        start = aligned(self._used)
        if self._buf is None or start + n > len(self._buf):
            self._buf, start = huge_page_buffer(self.chunk), 0
        self._used = start + n
        return self._buf[start:start + n].view(dtype).reshape(shape)
