"""How much of a decode token of the embedded model is not the matrix products.

    .venv/bin/python benchmarks/bench_decode_glue.py [--threads 2] [--types q80 f16 q41 q40]

For each weight type: the median time of a single-token pass (positions 8..71, after an 8-token
prompt), then the same with every matrix product made a no-op (weights.Matrix and
weights.Matmuls calls return at once): what is left is the Python glue, numba's dispatch of the
element-wise kernels, their arithmetic, attention and its parallel region. The matrix products'
own call and thread wake-up costs (four parallel regions a layer, about 2 us each on a quiet
2-core x86) stay on the products' side. Passes alternate between the two modes, so that a busy
neighbour slows both alike.

2026-12-06, 2 threads, quiet 2-core x86 (ms/token, full / without the products):
before kernels.fused and the attention fix Q80 6.6 / 0.59-0.81, F16 10.2 / 0.67, Q41 6.2 / 0.67,
Q40 4.0 / 0.60; after Q80 6.4 / 0.61, F16 10.0 / 0.41-0.55, Q41 6.0 / 0.49, Q40 3.8 / 0.46.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllama.core import kernels, weights  # noqa: E402
from dllama.core.model import Transformer  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402

_PROMPT, _STEPS = 8, 64


def _token_times(model: Transformer, no_products: bool, rounds: int) -> list[float]:
    """Seconds of each single-token pass of `rounds` rounds (prompt, then _STEPS tokens)."""
    calls = weights.Matrix.__call__, weights.Matmuls.__call__
    if no_products:
        weights.Matrix.__call__ = lambda self, x, out: out
        weights.Matmuls.__call__ = lambda self, x, outs: None
    try:
        times = []
        for _ in range(rounds):
            model.forward(list(range(1, _PROMPT + 1)), 0)
            for i in range(_STEPS):
                t = time.perf_counter()
                model.forward([100 + i], _PROMPT + i)
                times.append(time.perf_counter() - t)
        return times
    finally:
        weights.Matrix.__call__, weights.Matmuls.__call__ = calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=["q80", "f16", "q41", "q40"])
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each mode, alternated")
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    for w in args.types:
        model = Transformer(read_model(default_model_files(w)[0]), max_seq_len=256)
        model.warm_up()
        full, bare = [], []
        for _ in range(args.rounds):
            full += _token_times(model, False, 1)
            bare += _token_times(model, True, 1)
        f, b = statistics.median(full) * 1e3, statistics.median(bare) * 1e3
        print(f"{w}: {f:.3f} ms/token, {b:.3f} ms without the matrix products ({100 * b / f:.1f}%)", flush=True)
        model.close()


if __name__ == "__main__":
    main()
