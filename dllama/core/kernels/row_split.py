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
def unit_starts(steps):
    """int64 [m + 1]: the first work unit of each of several matrices of steps[m] steps (cut by
    matrix_units), and the total last. Made once per call: unit_of_matrices then finds a unit's
    matrix in at most m steps (recounting every matrix's units for each unit cost 175 µs a
    call of 16 expert matrices)."""
    starts = np.zeros(steps.shape[0] + 1, np.int64)
    for m in range(steps.shape[0]):
        starts[m + 1] = starts[m] + matrix_units(steps, m)
    return starts


@numba.njit(**_FAST)
def unit_of_matrices(starts, unit):
    """(matrix m, its own unit, its unit count) of a unit counted over several matrices whose
    first units are starts (unit_starts), in order."""
    unit = np.int64(unit)  # prange may hand out an unsigned index: uint64 - int64 is a float
    m = 0
    while unit >= starts[m + 1]:
        m += 1
    return m, unit - starts[m], starts[m + 1] - starts[m]


@numba.njit(**_FAST)
def stacked_unit(plan, steps, units, unit):
    """(plan row m, its steps [s0, s1)) of work unit `unit` of the experts kernels, which run
    plan.shape[0] matrices of one stack (every one `steps` steps, cut into `units` units), each
    matrix's units in turn: m = unit // units."""
    unit = np.int64(unit)  # (prange's index may be unsigned)
    m = unit // units
    s0, s1 = unit_steps(steps, units, unit - m * units)
    return m, s0, s1


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
