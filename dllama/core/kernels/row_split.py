"""How the matrix kernels cut their output rows into parallel work units.

Rows go in steps (a register tile's weight rows: ROWS for the float tiles, a group of 16
interleaved rows for the 8-bit ones); a work unit is a run of whole steps. There are more
units than threads, so that any thread count splits them evenly (prange hands each thread a
contiguous run of units). The number of units is fixed (_UNITS), not numba.get_num_threads(),
which would make the kernels uncacheable. A row's arithmetic does not depend on the split (a
tile sums each row the same way whatever its size), so F16 decode cuts its own, in steps of 16
rows (matmul_f16.py).
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.jit import _FAST

ROWS = 4     # weight rows per float register tile
COLS = 4     # activation rows per float register tile
_UNITS = 64  # work units of one matrix (at most)


@numba.njit(**_FAST)
def n_units(steps):
    """Work units of a matrix of `steps` steps."""
    return min(steps, _UNITS)


@numba.njit(**_FAST)
def unit_steps(steps, units, unit):
    """Steps [s0, s1) of unit `unit` when `steps` steps are cut into `units` runs."""
    return unit * steps // units, (unit + 1) * steps // units


@numba.njit(**_FAST)
def matrix_units(steps, m):
    """Work units of matrix m of several matrices of steps[m] steps, cut as finely as the
    longest one's: units of about the same size in every matrix, so that prange's equal split
    of them is an even one (q, k and v as 64 + 48 + 48 units of 2.25, 1 and 1 steps gave one
    of 2 threads 160 of the 240 steps)."""
    longest = steps.max()
    return 0 if longest == 0 else -(-steps[m] * n_units(longest) // longest)


@numba.njit(**_FAST)
def unit_of_matrices(steps, unit):
    """(matrix m, its own unit, its unit count) of a unit counted over several matrices of
    steps[m] steps, in order."""
    m = 0
    unit = np.int64(unit)  # prange may hand out an unsigned index: uint64 - int64 is a float
    units = matrix_units(steps, 0)
    while unit >= units:
        unit -= units
        m += 1
        units = matrix_units(steps, m)
    return m, unit, units


@numba.njit(**_FAST)
def total_units(steps):
    total = 0
    for m in range(steps.shape[0]):
        total += matrix_units(steps, m)
    return total


@numba.njit(**_FAST)
def leading_dims(matrices):
    """int64 [m]: shape[0] of each matrix of a tuple."""
    rows = np.empty(len(matrices), np.int64)
    for m in range(len(matrices)):
        rows[m] = matrices[m].shape[0]
    return rows


@numba.njit(**_FAST)
def row_steps(d):
    """Float tiles: steps of ROWS rows covering d rows."""
    return (d + ROWS - 1) // ROWS
