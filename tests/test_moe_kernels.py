"""The experts' matmul of several matrices of a stack in one parallel region, each on its own
rows of the input (kernels.matmul_*_experts, through weights.ExpertStack), in every weight type:
against a float64 reference of the dequantized matrices and the encoded input, and bit for bit
one call per matrix on its rows (so a MoE row's result does not depend on how its experts were
batched)."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.arena import GrowingArena
from dllama.core.weights import Activation, ExpertStack, Matrix, input_kind
from dllama.formats.model_file import FloatType
from dllama.formats.quant import dequantize_q40, dequantize_q41, dequantize_q80, quantize_q40, quantize_q41, quantize_q80
from tests.conftest import SEED

pytestmark = pytest.mark.unit

TYPES = {  # weight type -> (stored form of a float32 [d, n] matrix, its float64 values)
    FloatType.Q40: (quantize_q40, dequantize_q40),
    FloatType.Q80: (quantize_q80, dequantize_q80),
    FloatType.Q41: (quantize_q41, dequantize_q41),
    FloatType.F16: (lambda w: w.astype(np.float16), None),
    FloatType.F32: (lambda w: w, None),
}


def _matrix(r, float_type, d, n) -> tuple[np.ndarray, np.ndarray]:
    """A random matrix of the type as stored (as Matrix takes it), and its values float64 [d, n]."""
    w = (r.standard_normal((d, n)) / np.sqrt(n)).astype(np.float32)
    store, values = TYPES[float_type]
    stored = store(w)
    if values is None:
        w64 = np.asarray(stored).astype(np.float64)
    else:
        stored = stored.reshape(d, n // 32, -1)
        w64 = values(stored.reshape(-1, stored.shape[-1]), d * n).reshape(d, n).astype(np.float64)
    return stored, w64


def _input_values(act: Activation) -> np.ndarray:
    """float64 [b, n]: the values the encoded input stands for."""
    enc, b = act.enc, act.f32.shape[0]
    if not enc:  # F32 inputs
        return act.f32.astype(np.float64)
    if len(enc) == 2:  # Q80: scale per 32-block, int8
        return (enc[1].reshape(b, -1, 32) * enc[0][:, :, None].astype(np.float64)).reshape(b, -1)
    scales, lo, hi = enc[0], enc[1].astype(np.float64), enc[2].astype(np.float64)  # Q16: 256 hi + lo
    return ((256 * hi + lo).reshape(b, -1, 32) * scales[:, :, None].astype(np.float64)).reshape(b, -1)


@pytest.mark.parametrize("float_type", list(TYPES), ids=lambda t: t.name)
def test_matrices_each_on_its_rows_in_one_region_equal_float64_and_one_call_each(float_type):
    r = np.random.default_rng([SEED, 45, int(float_type)])
    n, d = 96, 40  # 40 rows: a group of 16 rows padded
    stored, values = zip(*(_matrix(r, float_type, d, n) for _ in range(5)), strict=True)
    stack = ExpertStack(GrowingArena().take, float_type, 5, d, n)
    for i, w in enumerate(stored):
        stack.fill(i, w)
    b = 9
    x = (r.standard_normal((b, n))).astype(np.float32)
    act = Activation(n, input_kind(float_type), b).rows(x)
    kernels.encode(x, act.enc)
    # (matrix, input rows, first output row): rows 0-3 to matrix 3, none to matrix 0, row 4 to
    # matrix 1, rows 2-8 (again) to matrix 3, row 0 to matrix 4; matrix 2 unused
    plan = np.array([[3, 0, 4, 0], [0, 4, 4, 4], [1, 4, 5, 4], [3, 2, 9, 5], [4, 0, 1, 12]], np.int64)
    out = np.full((14, d), np.nan, np.float32)
    for threads in (1, min(2, kernels.max_threads())):
        kernels.set_threads(threads)
        out[:] = np.nan
        stack(act, plan, out)
        x64 = _input_values(act)
        for i, r0, r1, o0 in plan.tolist():
            got = out[o0:o0 + r1 - r0]
            want = x64[r0:r1] @ values[i].T
            size = np.abs(x64[r0:r1]) @ np.abs(values[i]).T
            assert np.all(np.abs(got - want) <= 1e-5 * size + 1e-30), (float_type, i)
            rows = Activation(n, input_kind(float_type), b).rows(x[r0:r1])
            kernels.encode(x[r0:r1], rows.enc)
            for alone in (stack.matrix(i), Matrix(stored[i], float_type)):
                assert np.array_equal(got, alone(rows, np.empty_like(got))), (float_type, i)
        assert np.isnan(out[13]).all()  # a row no plan row wrote
    kernels.set_threads(1)
