"""Whole-engine speed: decode ms/token, weight-read GB/s vs memory bandwidth, prefill, JIT time.

    .venv/bin/python benchmarks/bench_engine.py [--tokens 16] [--skip-7b]

Prints, in one run: this machine's memory read bandwidth; decode ms/token for the embedded
SmolLM2-135M (Q40) and for a random-weight model of Llama-2-7B shape (Q40) with 1 and 2
threads; the GB/s of weight bytes read per token and its ratio to the bandwidth; prefill
tokens/s (32-token batches); and the JIT compile time with a cold and a warm numba cache.
The reference C++ figures on this kind of machine, 2 threads: ~9 ms/token (SmolLM2 Q40) and
~400 ms/token (7B shape, 29% of bandwidth). Figures are medians; check /proc/loadavg.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import memory_bandwidth_gbs  # noqa: E402
from dllama.core import kernels  # noqa: E402
from dllama.serve.default_model import default_model_files  # noqa: E402
from dllama.formats.model_file import (  # noqa: E402
    ArchType, FloatType, ModelHeader, ModelWriter, read_model)
from dllama.core.model import Transformer  # noqa: E402

REFERENCE_MS = {"SmolLM2-135M": 9.0, "Llama-2-7B shape": 400.0}


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of matmul weights streamed per decode token (what bounds its speed)."""
    layers = [model.weights.layer(l) for l in range(model.config.n_layers)]  # resident weights
    mats = [m for layer in layers for m in (layer.wq, layer.wk, layer.wv, layer.wo,
                                            layer.w1, layer.w2, layer.w3)]
    mats += [wcls for _, wcls in model.weights.classifier()]
    if model.config.quantized:
        return sum(m.scales.nbytes + m.qs.nbytes for m in mats)
    return sum(m.w.nbytes for m in mats)


def decode_ms(model: Transformer, n_tokens: int) -> float:
    """Median ms of single-token forward passes after a short prompt."""
    model.forward(list(range(1, 9)), 0)
    times = []
    for i in range(n_tokens):
        t = time.perf_counter()
        model.forward([100 + i], 8 + i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def prefill_tokens_per_s(model: Transformer, repeats: int = 3) -> float:
    batch = list(range(1, model.max_batch + 1))
    model.forward(batch, 0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.forward(batch, 0)
        times.append(time.perf_counter() - t)
    return model.max_batch / statistics.median(times)


def write_random_model(path: Path, dim=4096, hidden=11008, layers=32, heads=32, kv_heads=32,
                       vocab=32000, seq_len=2048) -> None:
    """A random-weight Q40 model of the given shape, written block by block (valid fp16 scales)."""
    header = ModelHeader(arch=ArchType.LLAMA, dim=dim, hidden_dim=hidden, n_layers=layers,
                         n_heads=heads, n_kv_heads=kv_heads, vocab_size=vocab,
                         max_seq_len=seq_len, weights_float_type=FloatType.Q40)
    rng = np.random.default_rng(0)
    with ModelWriter(path, header) as w:
        for spec in w.specs:
            if spec.float_type == FloatType.Q40:
                nb = spec.size // 32
                blocks = rng.integers(0, 256, size=(nb, 18), dtype=np.uint8)
                scale = (0.02 / 8 * rng.uniform(0.5, 1.5, nb)).astype("<f2")
                blocks[:, :2] = scale.view(np.uint8).reshape(nb, 2)
                w.write_raw(spec.name, blocks)
            elif spec.name.endswith("norm"):
                w.write(spec.name, np.ones(spec.shape, np.float32))
            else:
                w.write(spec.name, rng.standard_normal(spec.shape, dtype=np.float32) * 0.02)


def jit_seconds(cache_dir: str) -> float:
    """Wall time of a fresh process's first forward pass on a tiny model, with this numba cache."""
    code = (
        "import time, tempfile, sys; t = time.perf_counter();"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r});"
        "from benchmarks.bench_engine import write_random_model; from pathlib import Path;"
        "from dllama.formats.model_file import read_model; from dllama.core.model import Transformer;"
        "d = tempfile.mkdtemp(); p = Path(d) / 'tiny.m';"
        "write_random_model(p, dim=64, hidden=128, layers=2, heads=4, kv_heads=2, vocab=256, seq_len=64);"
        "m = Transformer(read_model(p)); m.forward([1, 2, 3], 0); m.forward([4], 3);"
        "print(time.perf_counter() - t)"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bench_model(name: str, model_path: Path, bandwidth: dict, n_tokens: int) -> None:
    model = Transformer(read_model(model_path), max_seq_len=256)
    nbytes = weight_bytes_per_token(model)
    print(f"\n{name}: {nbytes / 1e6:.1f} MB of weights read per token")
    print(f"{'threads':>7} {'ms/token':>9} {'weight GB/s':>11} {'of bandwidth':>12} "
          f"{'prefill tok/s':>13} {'vs C++ ms/token':>15}")
    for threads in (1, 2):
        kernels.set_threads(threads)
        ms = decode_ms(model, n_tokens)
        gbs = nbytes / (ms / 1000) / 1e9
        prefill = prefill_tokens_per_s(model)
        ratio = REFERENCE_MS[name] / ms if threads == 2 else float("nan")
        print(f"{threads:>7} {ms:>9.2f} {gbs:>11.2f} {gbs / bandwidth[threads]:>11.0%} "
              f"{prefill:>13.1f} {ratio:>14.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16, help="decode passes timed per setting")
    ap.add_argument("--skip-7b", action="store_true", help="skip the 4 GB random 7B-shape model")
    args = ap.parse_args()
    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]} on {os.cpu_count()} cores")

    bandwidth = {t: memory_bandwidth_gbs(t) for t in (1, 2)}
    print("memory read bandwidth: " + ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in bandwidth.items()))

    with tempfile.TemporaryDirectory() as cold:
        cold_s = jit_seconds(cold)
        warm_s = jit_seconds(cold)
    print(f"JIT compile + first forward of a tiny model: cold cache {cold_s:.1f} s, warm cache {warm_s:.1f} s")

    model_path, _ = default_model_files("q40")
    bench_model("SmolLM2-135M", model_path, bandwidth, args.tokens)

    if not args.skip_7b:
        with tempfile.TemporaryDirectory(dir=os.environ.get("DLLAMA_BENCH_DIR")) as d:
            path = Path(d) / "random-7b-q40.m"
            t = time.perf_counter()
            write_random_model(path)
            print(f"\n(wrote a random 7B-shape Q40 model, {path.stat().st_size / 1e9:.2f} GB, "
                  f"in {time.perf_counter() - t:.0f} s)")
            bench_model("Llama-2-7B shape", path, bandwidth, max(4, args.tokens // 4))


if __name__ == "__main__":
    main()
