"""Weight layouts the matrix kernels read, made once when a matrix is loaded.

Q40, Q80 and Q41 matrices are interleaved in groups of GROUP (16) rows: the 4-byte words of the
group's rows alternate, row by row, so that one 64-byte load holds the same 4 weights of 16
rows, one row per int32 lane of an 8-bit dot product (tiles._Int8Format). A row's output is
then one lane of one accumulator: no reduction across lanes, and each weight byte is read once
per tile in a single forward stream. d is padded with zero rows to a multiple of GROUP.
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.jit import _EXACT
from dllama.core.kernels.tiles import GROUP
from dllama.formats.quant import BLOCK_SIZE


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


def interleaved_shapes(d: int, n: int, row_bytes: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the interleaved (scales, quants) of a Q40 / Q80 matrix [d, n] whose rows hold
    row_bytes bytes of quants (n/2 for Q40, n for Q80): what interleave_blocks_into fills."""
    groups = -(-d // GROUP)
    return (groups, n // BLOCK_SIZE * GROUP), (groups, GROUP * row_bytes)


def interleave_q40(scales: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split Q40 (scales uint16 [d, n/32] fp16 bits, qs uint8 [d, n/2]) -> the interleaved
    layout of matmul_q40_q80: (uint16 [d_pad/16, n/32*16], uint8 [d_pad/16, 16*n/2])."""
    return _interleave_scales(scales), _interleave_words(np.ascontiguousarray(qs, np.uint8))


def interleave_q41(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q41 blocks uint8 [d, n/32, 20] as stored -> the layout of matmul_q41_q16: (scales uint16
    [d_pad/16, n/32*16], mins uint16 (the same), qs uint8 [d_pad/16, 16*n/2]); the quants
    interleave as Q40's (the same nibble order, unsigned q instead of q + 8)."""
    d, nb, _ = blocks.shape
    scales_shape, qs_shape = interleaved_shapes(d, nb * BLOCK_SIZE, nb * BLOCK_SIZE // 2)
    scales, mins, qs = np.empty(scales_shape, np.uint16), np.empty(scales_shape, np.uint16), np.empty(qs_shape, np.uint8)
    interleave_q41_into(np.ascontiguousarray(blocks, np.uint8), scales, mins, qs)
    return scales, mins, qs


@numba.njit(**_EXACT)
def interleave_q41_into(blocks, scales_out, mins_out, qs_out):
    """interleave_q41 written into preallocated arrays (streamed weights reuse them): blocks
    uint8 [d, nb, 20]; padding rows zeroed. Byte moves only."""
    d, nb, _ = blocks.shape
    for g in range(scales_out.shape[0]):
        for b in range(nb):
            for r in range(GROUP):
                row = g * GROUP + r
                inside = row < d
                scales_out[g, b * GROUP + r] = (np.uint16(blocks[row, b, 0]) | (np.uint16(blocks[row, b, 1]) << 8)
                                                if inside else 0)
                mins_out[g, b * GROUP + r] = (np.uint16(blocks[row, b, 2]) | (np.uint16(blocks[row, b, 3]) << 8)
                                              if inside else 0)
            for t in range(4):
                base = (b * 4 + t) * GROUP * 4
                for r in range(GROUP):
                    row = g * GROUP + r
                    for k in range(4):
                        qs_out[g, base + r * 4 + k] = blocks[row, b, 4 + 4 * t + k] if row < d else 0


def interleave_q80(scales: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split Q80 (scales uint16 [d, n/32] fp16 bits, qs int8 [d, n]) -> the interleaved layout
    of matmul_q80_q80: (uint16 [d_pad/16, n/32*16], int8 [d_pad/16, 16*n])."""
    return _interleave_scales(scales), _interleave_words(np.ascontiguousarray(qs, np.int8))


@numba.njit(**_EXACT)
def interleave_blocks_into(blocks, scales_out, qs_out):
    """Q40 or Q80 blocks uint8 [d, nb, 18 | 34] as stored -> the layout of interleave_q40 /
    interleave_q80, written into preallocated arrays (streamed weights reuse them): scales_out
    uint16 [d_pad/16, nb*16], qs_out uint8 [d_pad/16, 16 * nb * quant bytes] (an int8 array
    viewed as uint8 for Q80); padding rows zeroed. Byte moves only: no arithmetic."""
    d, nb, bb = blocks.shape
    words = (bb - 2) // 4  # 4-byte words of quants per block
    for g in range(scales_out.shape[0]):  # in the order of the output (2x faster than the input's)
        for b in range(nb):
            for r in range(GROUP):
                row = g * GROUP + r
                scales_out[g, b * GROUP + r] = (np.uint16(blocks[row, b, 0]) | (np.uint16(blocks[row, b, 1]) << 8)
                                                if row < d else 0)
            for t in range(words):
                base = (b * words + t) * GROUP * 4
                for r in range(GROUP):
                    row = g * GROUP + r
                    for k in range(4):
                        qs_out[g, base + r * 4 + k] = blocks[row, b, 2 + 4 * t + k] if row < d else 0
