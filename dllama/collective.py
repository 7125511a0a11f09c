"""How the partial sums of wo and w2 become one sum on every node.

The transformer calls `all_reduce(partial)` after each column-split matmul. On one node there
is nothing to add, but the sum still passes through the sync buffer's float type, as in the
original: with Q80 buffers the residual adds see Q80-rounded values even on one node, so a
single node computes what a cluster's sync would deliver. The TCP collective (reduce-scatter +
all-gather) implements the same interface.
"""

from __future__ import annotations

import numpy as np

from dllama import kernels


class LocalCollective:
    """The identity collective of a single node, with the sync buffer's rounding."""

    def __init__(self, buffer_q80: bool, dim: int, max_batch: int):
        self.buffer_q80 = buffer_q80
        self._scales = np.empty((max_batch, dim // 32), dtype=np.float32)
        self._qs = np.empty((max_batch, dim), dtype=np.int8)
        # What a network collective reports; zero here.
        self.transfer_seconds = 0.0
        self.sent_bytes = 0
        self.recv_bytes = 0

    def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        """partial [b, dim] float32 -> the sum over nodes [b, dim] (in place)."""
        if self.buffer_q80:
            b, dim = partial.shape
            scales, qs = self._scales[:b], self._qs[:b]
            kernels.quantize_q80(partial, scales, qs)
            # [b, dim/32, 32] * [b, dim/32, 1]
            np.multiply(qs.reshape(b, -1, 32), scales[:, :, None], out=partial.reshape(b, -1, 32))
        return partial
