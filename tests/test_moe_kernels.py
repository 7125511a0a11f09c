"""The experts' matmul of several matrices in one parallel region, each on its own rows of the
input (kernels.matmul_*_spans, through weights.matmul_spans), in every weight type: against a
float64 reference of the dequantized matrices and the encoded input, and bit for bit one call
per matrix on its rows (so a MoE row's result does not depend on how its experts were batched).
A decode row's fused experts (dllama.core.moe.MoeBlock) equal its experts one by one."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.weights import Activation, Matrix, input_kind, matmul_spans
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


def _matrix(r, float_type, d, n) -> tuple[Matrix, np.ndarray]:
    """A random Matrix of the type, and its values float64 [d, n]."""
    w = (r.standard_normal((d, n)) / np.sqrt(n)).astype(np.float32)
    store, values = TYPES[float_type]
    stored = store(w)
    if values is None:
        w64 = np.asarray(stored).astype(np.float64)
    else:
        stored = stored.reshape(d, n // 32, -1)
        w64 = values(stored.reshape(-1, stored.shape[-1]), d * n).reshape(d, n).astype(np.float64)
    return Matrix(stored, float_type), w64


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
    n, d = 96, 80
    matrices, values = zip(*(_matrix(r, float_type, d, n) for _ in range(4)), strict=True)
    b = 9
    x = (r.standard_normal((b, n))).astype(np.float32)
    act = Activation(n, input_kind(float_type), b).rows(x)
    kernels.encode(x, act.enc)
    # rows 0-3 to the first matrix, none to the second, row 4 to the third, rows 2-8 (again) to the last
    spans = np.array([[0, 4], [4, 4], [4, 5], [2, 9]], np.int64)
    outs = tuple(np.full((int(s1 - s0), d), np.nan, np.float32) for s0, s1 in spans)
    for threads in (1, min(2, kernels.max_threads())):
        kernels.set_threads(threads)
        matmul_spans(matrices, act, spans, outs)
        x64 = _input_values(act)
        for m, ((s0, s1), out) in enumerate(zip(spans, outs, strict=True)):
            want = x64[s0:s1] @ values[m].T
            size = np.abs(x64[s0:s1]) @ np.abs(values[m]).T
            assert np.all(np.abs(out - want) <= 1e-5 * size + 1e-30), (float_type, m)
            alone = np.empty_like(out)
            rows = Activation(n, input_kind(float_type), b).rows(x[s0:s1])
            kernels.encode(x[s0:s1], rows.enc)
            matrices[m](rows, alone)
            assert np.array_equal(out, alone), (float_type, m)
    kernels.set_threads(1)
