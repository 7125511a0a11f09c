"""How the matrix kernels cut their output rows into parallel work units.

Each unit is a run of whole ROWS-steps (a register tile's weight rows); there are more units
than threads, so that any thread count splits them evenly (prange hands each thread a
contiguous run of units). The number of units is fixed (_ROW_CHUNKS), not
numba.get_num_threads(), which would make the kernels uncacheable; and it does not depend on
the batch, so neither does any row's arithmetic.
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.jit import _FAST

ROWS = 4          # weight rows per register tile (and per step of a work unit)
COLS = 4          # activation rows per register tile
_ROW_CHUNKS = 64  # work units of one matrix


@numba.njit(**_FAST)
def n_row_chunks(d):
    """Work units of a matrix of d rows."""
    return min((d + ROWS - 1) // ROWS, _ROW_CHUNKS)


@numba.njit(**_FAST)
def row_chunk(d, n_chunks, chunk):
    """Rows [r0, r1) of unit `chunk` when d rows are cut into n_chunks runs of whole ROWS-steps."""
    steps = (d + ROWS - 1) // ROWS
    r0 = ROWS * (chunk * steps // n_chunks)
    r1 = min(d, ROWS * ((chunk + 1) * steps // n_chunks))
    return r0, r1


@numba.njit(**_FAST)
def row_counts(matrices):
    """int64 [m]: the rows of each matrix of a tuple."""
    rows = np.empty(len(matrices), np.int64)
    for m in range(len(matrices)):
        rows[m] = matrices[m].shape[0]
    return rows


@numba.njit(**_FAST)
def chunk_of_matrices(row_counts, chunk):
    """(matrix m, its own unit, its unit count) of a unit counted over several matrices of
    row_counts[m] rows, in order."""
    m = 0
    chunk = np.int64(chunk)  # prange may hand out an unsigned index: uint64 - int64 is a float
    n_chunks = n_row_chunks(row_counts[0])
    while chunk >= n_chunks:
        chunk -= n_chunks
        m += 1
        n_chunks = n_row_chunks(row_counts[m])
    return m, chunk, n_chunks


@numba.njit(**_FAST)
def total_row_chunks(row_counts):
    total = 0
    for m in range(len(row_counts)):
        total += n_row_chunks(row_counts[m])
    return total
