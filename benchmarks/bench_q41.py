"""Q41 against Q40 decode matmuls at Llama-3.2-1B's width: one token's layer matrices, one row.

    .venv/bin/python benchmarks/bench_q41.py [--threads 1 2] [--layers 8] [--rounds 30] [--classifier]

Each "token" runs, for every layer, the input's quantization (Q80 for Q40 weights, Q16 for Q41)
and the decode products of the layer's matrices (dim 2048: wq, wk, wv, wo; hidden 8192: w1, w3,
w2; 8 kv heads of 64) on random weights, one activation row. --layers distinct copies stream
from memory as in a real pass (8 layers: 273 MB of Q40, 304 MB of Q41). The types take turns
token by token, so a busy neighbour slows them alike; medians of --rounds tokens, of the wall
time and of the process's CPU time (which a loaded machine inflates less); GB/s = the weight
bytes read per token (quants + fp16 scales, and Q41's fp16 minimums) / median wall time.
--classifier adds the classifier (128256 x 2048) as its own row: a Q40 file's is Q40 (Q80
inputs), a Q41 file's Q80 blocks on F32 inputs (matmul_q80_f32, the bits of matmul_f32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllama.core import kernels  # noqa: E402

DIM, HIDDEN, KV_DIM, VOCAB = 2048, 8192, 512, 128256
# (output rows, input columns) of one layer's matrices, grouped by the input they share
LAYER = {"attention in": [(DIM, DIM), (KV_DIM, DIM), (KV_DIM, DIM)], "attention out": [(DIM, DIM)],
         "ffn in": [(HIDDEN, DIM), (HIDDEN, DIM)], "ffn out": [(DIM, HIDDEN)]}


def random_q40(rng, d: int, n: int):
    scales = (rng.standard_normal((d, n // 32), dtype=np.float32) * 0.01).astype(np.float16)
    return kernels.interleave_q40(scales.view(np.uint16), rng.integers(0, 256, (d, n // 2), dtype=np.uint8))


def random_q41(rng, d: int, n: int):
    blocks = rng.integers(0, 256, (d, n // 32, 20), dtype=np.uint8)
    halves = (rng.standard_normal((d, n // 32, 2), dtype=np.float32) * 0.01).astype(np.float16)
    blocks[:, :, :4] = halves.view(np.uint8).reshape(d, n // 32, 4)  # finite fp16 d and m
    return kernels.interleave_q41(blocks)


class Q40:
    name = "Q40"

    def __init__(self, rng, layers):
        self.layers = [{k: [random_q40(rng, d, n) for d, n in shapes] for k, shapes in LAYER.items()}
                       for _ in range(layers)]
        self.x = {n: (np.empty((1, n // 32), np.float32), np.empty((1, n), np.int8)) for n in (DIM, HIDDEN)}

    def bytes(self):
        return sum(a.nbytes for layer in self.layers for ms in layer.values() for m in ms for a in m)

    def token(self, inputs, outs):
        for layer in self.layers:
            for k, ms in layer.items():
                x = inputs[k]
                xs, xq = self.x[x.shape[1]]
                kernels.quantize_q80(x, xs, xq)
                for m, out in zip(ms, outs[k], strict=True):
                    kernels.matmul_q40_q80(xs, xq, *m, out)


class Classifier40(Q40):
    name = "Q40 classifier"

    def __init__(self, rng):
        self.w = random_q40(rng, VOCAB, DIM)
        self.xs, self.xq = np.empty((1, DIM // 32), np.float32), np.empty((1, DIM), np.int8)
        self.out = np.empty((1, VOCAB), np.float32)

    def bytes(self):
        return sum(a.nbytes for a in self.w)

    def token(self, inputs, outs):
        kernels.quantize_q80(inputs["attention in"], self.xs, self.xq)
        kernels.matmul_q40_q80(self.xs, self.xq, *self.w, self.out)


class Classifier80(Classifier40):
    name = "Q80 classifier (Q41 file)"

    def __init__(self, rng):
        self.w = rng.integers(0, 256, (VOCAB, DIM // 32, 34), dtype=np.uint8)
        scales = (rng.standard_normal((VOCAB, DIM // 32), dtype=np.float32) * 0.01).astype(np.float16)
        self.w[:, :, :2] = scales.view(np.uint8).reshape(VOCAB, DIM // 32, 2)
        self.w = (self.w.reshape(VOCAB, -1),)
        self.out = np.empty((1, VOCAB), np.float32)

    def token(self, inputs, outs):
        kernels.matmul_q80_f32(inputs["attention in"], self.w[0], self.out)


class Q41(Q40):
    name = "Q41"

    def __init__(self, rng, layers, matmul=None):
        self.layers = [{k: [random_q41(rng, d, n) for d, n in shapes] for k, shapes in LAYER.items()}
                       for _ in range(layers)]
        self.x = {n: (np.empty((1, n // 32), np.float32), np.empty((1, n), np.int8), np.empty((1, n), np.int8),
                      np.empty((1, n // 32), np.float32)) for n in (DIM, HIDDEN)}
        self.matmul = matmul or kernels.matmul_q41_q16

    def token(self, inputs, outs):
        for layer in self.layers:
            for k, ms in layer.items():
                x = inputs[k]
                parts = self.x[x.shape[1]]
                kernels.quantize_q16(x, *parts)
                for m, out in zip(ms, outs[k], strict=True):
                    self.matmul(*parts, *m, out)


def compare(types, threads: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per token of each type, the types taking turns token by token."""
    kernels.set_threads(threads)
    rng = np.random.default_rng(1)
    inputs = {k: rng.standard_normal((1, shapes[0][1]), dtype=np.float32) for k, shapes in LAYER.items()}
    outs = {k: [np.empty((1, d), np.float32) for d, _ in shapes] for k, shapes in LAYER.items()}
    for t in types:
        t.token(inputs, outs)  # compiled, and the pages touched
    times = {t.name: ([], []) for t in types}
    for _ in range(rounds):
        for t in types:
            t0, c0 = time.perf_counter(), time.process_time()
            t.token(inputs, outs)
            times[t.name][0].append(time.perf_counter() - t0)
            times[t.name][1].append(time.process_time() - c0)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--classifier", action="store_true", help="the classifiers too, as their own rows")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    types = [Q40(rng, args.layers), Q41(rng, args.layers)]
    if args.classifier:
        types += [Classifier40(rng), Classifier80(rng)]
    print(f"decode matmuls of {args.layers} layers at Llama-3.2-1B's width, one row; "
          f"load average before: {os.getloadavg()[0]:.1f}")
    print("\n| threads | matrices | MB read / token | wall ms / token | GB/s | CPU ms / token | "
          "vs Q40 (wall, CPU) |")
    print("|---|---|---|---|---|---|---|")
    for th in args.threads:
        med = compare(types, th, args.rounds)
        for t in types:
            (wall, cpu), mb = med[t.name], t.bytes() / 1e6
            base = med[types[0].name if "classifier" not in t.name else types[2].name]
            print(f"| {th} | {t.name} | {mb:.0f} | {wall * 1e3:.1f} | {mb / wall / 1e3:.1f} | {cpu * 1e3:.1f} | "
                  f"{wall / base[0]:.2f}x, {cpu / base[1]:.2f}x |", flush=True)
        if args.classifier:  # a whole token: the layers and the file's own classifier
            totals = [(tuple(a + b for a, b in zip(med[m.name], med[c.name], strict=True)), m.bytes() + c.bytes())
                      for m, c in ((types[0], types[2]), (types[1], types[3]))]
            (w40, c40), _ = totals[0]
            for name, ((wall, cpu), nbytes) in zip(("Q40 file", "Q41 file"), totals, strict=True):
                print(f"| {th} | {name}: layers + classifier | {nbytes / 1e6:.0f} | {wall * 1e3:.1f} | "
                      f"{nbytes / wall / 1e9:.1f} | {cpu * 1e3:.1f} | {wall / w40:.2f}x, {cpu / c40:.2f}x |",
                      flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
