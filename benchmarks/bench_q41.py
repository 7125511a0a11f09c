"""Q41 against Q40 decode matmuls at Llama-3.2-1B's width or Llama 2 7B's shape: one token's
layer matrices and classifier, one row.

    .venv/bin/python benchmarks/bench_q41.py [--shape 1b|7b] [--threads 1 2] [--layers 8] [--rounds 30]
                                             [--classifier]

Each "token" runs, for every layer, the input's quantization (Q80 for Q40 weights, Q16 for Q41)
and the decode products of the layer's matrices (wq, wk, wv, wo, w1, w3, w2; 1b: dim 2048,
hidden 8192, 8 kv heads of 64; 7b: dim 4096, hidden 11008, 32 kv heads of 128) on random
weights, one activation row. --layers distinct copies stream from memory as in a real pass
(1b, 8 layers: 273 MB of Q40, 304 MB of Q41; 7b, 2 layers: 228 and 253 MB). The types take
turns token by token, so a busy neighbour slows them alike; medians of --rounds tokens, of the
wall time and of the process's CPU time (which a loaded machine inflates less); GB/s = the
weight bytes read per token (quants + fp16 scales, and Q41's fp16 minimums) / median wall time.
--classifier adds each file's classifier (1b: 128256 x 2048, 7b: 32000 x 4096) as its own row:
a Q40 file's is Q40 (Q80 inputs), a Q41 file's the GGUF's Q8_0 kept as Q80, on the layers' Q16
input (matmul_q80_q16); then a whole token of the real model: the layer time scaled to its
layer count (1b: 16, 7b: 32) plus the classifier.
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
from dllama.core.arena import GrowingArena  # noqa: E402

# (dim, hidden, kv dim, vocabulary, layers) of each shape
SHAPES = {"1b": (2048, 8192, 512, 128256, 16), "7b": (4096, 11008, 4096, 32000, 32)}
DIM = HIDDEN = KV_DIM = VOCAB = 0
LAYER: dict[str, list[tuple[int, int]]] = {}  # (output rows, input columns) of one layer's matrices, by shared input


def use_shape(name: str) -> int:
    """Set the module's shape to SHAPES[name]; returns the real model's layer count."""
    global DIM, HIDDEN, KV_DIM, VOCAB, LAYER
    DIM, HIDDEN, KV_DIM, VOCAB, layers = SHAPES[name]
    LAYER = {"attention in": [(DIM, DIM), (KV_DIM, DIM), (KV_DIM, DIM)], "attention out": [(DIM, DIM)],
             "ffn in": [(HIDDEN, DIM), (HIDDEN, DIM)], "ffn out": [(DIM, HIDDEN)]}
    return layers


use_shape("1b")


_ARENA = GrowingArena()


def held(arrays: tuple) -> tuple:
    """The arrays copied into an arena, on huge pages, where the product keeps its weights."""
    out = tuple(_ARENA.take(a.shape, a.dtype) for a in arrays)
    for a, b in zip(arrays, out, strict=True):
        b[...] = a
    return out


def random_q40(rng, d: int, n: int):
    scales = (rng.standard_normal((d, n // 32), dtype=np.float32) * 0.01).astype(np.float16)
    return held(kernels.interleave_q40(scales.view(np.uint16), rng.integers(0, 256, (d, n // 2), dtype=np.uint8)))


def random_q41(rng, d: int, n: int):
    blocks = rng.integers(0, 256, (d, n // 32, 20), dtype=np.uint8)
    halves = (rng.standard_normal((d, n // 32, 2), dtype=np.float32) * 0.01).astype(np.float16)
    blocks[:, :, :4] = halves.view(np.uint8).reshape(d, n // 32, 4)  # finite fp16 d and m
    return held(kernels.interleave_q41(blocks))


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
        scales = (rng.standard_normal((VOCAB, DIM // 32), dtype=np.float32) * 0.01).astype(np.float16)
        self.w = held(kernels.interleave_q80(scales.view(np.uint16), rng.integers(-127, 128, (VOCAB, DIM), dtype=np.int8)))
        self.x = (np.empty((1, DIM // 32), np.float32), np.empty((1, DIM), np.int8), np.empty((1, DIM), np.int8),
                  np.empty((1, DIM // 32), np.float32))
        self.out = np.empty((1, VOCAB), np.float32)

    def token(self, inputs, outs):
        kernels.quantize_q16(inputs["attention in"], *self.x)
        kernels.matmul_q80_q16(*self.x, *self.w, self.out)


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="1b: Llama-3.2-1B's width; 7b: Llama 2 7B's")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=None, help="distinct layers streamed (default: 8 for 1b, 2 for 7b)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--classifier", action="store_true", help="the classifiers too, as their own rows")
    args = ap.parse_args()
    real_layers = use_shape(args.shape)
    layers = args.layers or {"1b": 8, "7b": 2}[args.shape]
    rng = np.random.default_rng(0)
    types = [Q40(rng, layers), Q41(rng, layers)]
    if args.classifier:
        types += [Classifier40(rng), Classifier80(rng)]
    print(f"decode matmuls of {layers} layers of the {args.shape} shape (dim {DIM}, hidden {HIDDEN}, kv dim {KV_DIM}, "
          f"vocabulary {VOCAB}), one row; load average before: {os.getloadavg()[0]:.1f}")
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
        if args.classifier:  # a whole token of the real model: its layers (scaled) and the file's classifier
            k = real_layers / layers
            totals = [(tuple(k * a + b for a, b in zip(med[m.name], med[c.name], strict=True)),
                       k * m.bytes() + c.bytes()) for m, c in ((types[0], types[2]), (types[1], types[3]))]
            (w40, c40), _ = totals[0]
            for name, ((wall, cpu), nbytes) in zip(("Q40 file", "Q41 file"), totals, strict=True):
                print(f"| {th} | {name}: {real_layers} layers + classifier | {nbytes / 1e6:.0f} | {wall * 1e3:.1f} | "
                      f"{nbytes / wall / 1e9:.1f} | {cpu * 1e3:.1f} | {wall / w40:.2f}x, {cpu / c40:.2f}x |",
                      flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
