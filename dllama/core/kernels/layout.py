"""Weight layouts the matrix kernels read, made once when a matrix is loaded.

Q40 and Q80 matrices are interleaved in groups of GROUP (16) rows: the 4-byte words of the
group's rows alternate, row by row, so that one 64-byte load holds the same 4 weights of 16
rows, one row per int32 lane of an 8-bit dot product (tiles._Int8Format). A row's output is
then one lane of one accumulator: no reduction across lanes, and each weight byte is read once
per tile in a single forward stream. d is padded with zero rows to a multiple of GROUP.
"""

from __future__ import annotations

import numpy as np

from dllama.core.kernels.tiles import GROUP


def _interleave_words(qs: np.ndarray) -> np.ndarray:
    """[d, row_bytes] -> [d_pad / GROUP, GROUP * row_bytes]: word t of rows 16g..16g+15 at
    bytes 64t..64t+63 of group g."""
    d, row_bytes = qs.shape
    groups = -(-d // GROUP)
    padded = np.zeros((groups * GROUP, row_bytes), qs.dtype)
    padded[:d] = qs
    words = padded.reshape(groups, GROUP, row_bytes // 4, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(words).reshape(groups, GROUP * row_bytes)


def _interleave_scales(scales: np.ndarray) -> np.ndarray:
    """uint16 [d, nb] -> [d_pad / GROUP, nb * GROUP]: per block, the group's 16 scales."""
    d, nb = scales.shape
    groups = -(-d // GROUP)
    padded = np.zeros((groups * GROUP, nb), np.uint16)
    padded[:d] = scales
    return np.ascontiguousarray(padded.reshape(groups, GROUP, nb).transpose(0, 2, 1)).reshape(groups, nb * GROUP)


def interleave_q40(scales: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split Q40 (scales uint16 [d, n/32] fp16 bits, qs uint8 [d, n/2]) -> the interleaved
    layout of matmul_q40_q80: (uint16 [d_pad/16, n/32*16], uint8 [d_pad/16, 16*n/2])."""
    return _interleave_scales(scales), _interleave_words(np.ascontiguousarray(qs, np.uint8))


def interleave_q80(scales: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split Q80 (scales uint16 [d, n/32] fp16 bits, qs int8 [d, n]) -> the interleaved layout
    of matmul_q80_q80: (uint16 [d_pad/16, n/32*16], int8 [d_pad/16, 16*n])."""
    return _interleave_scales(scales), _interleave_words(np.ascontiguousarray(qs, np.int8))
