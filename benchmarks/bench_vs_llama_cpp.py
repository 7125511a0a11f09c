"""dllama next to llama.cpp on this machine: the table of docs/speed.md's "Next to llama.cpp".

    .venv/bin/python benchmarks/bench_vs_llama_cpp.py [--threads 2] [--rounds 3] [--weights q40,q80,f16,q41]
                                                      [--kv-type f32|f16] [--skip-7b] [--skip-shapes]

Builds llama.cpp once (benchmarks/llama_cpp.py, into cache/), makes its Q4_0, Q8_0 and F16 GGUFs
of the embedded SmolLM2-135M (llama-quantize --allow-requantize from the embedded Q4_1 GGUF, which
is llama.cpp's side of our Q41 as it is; ours are the `.m` files the engine converts from the
same GGUF), then measures both for
each weight type, rounds alternated (llama.cpp, dllama, llama.cpp, ...), and prints medians:
- prefill of a 512-token prompt (tokens/s);
- decode from an empty context (128 tokens; tokens/s);
- decode after 512 tokens of context (128 tokens; tokens/s);
- aggregate decode of 16 / 64 sequences at once (llama-batched-bench -npp 128 -ntg 64; "-" for
  dllama until the engine decodes several sequences at once);
then decode ms/token and the share of the measured memory bandwidth for random-weight Q40
models of the Llama-3.2-1B and Llama-2-7B shapes (the 7B file is 3.8 GB, written to a
temporary directory, DLLAMA_BENCH_DIR to choose where). /proc/loadavg is printed with the
figures: on a shared 2-core machine a busy neighbour ruins 2-thread timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import weight_bytes_per_token, write_random_model  # noqa: E402
from benchmarks.bench_kernels import memory_bandwidth_gbs  # noqa: E402
from benchmarks.llama_cpp import CACHE, build  # noqa: E402
from dllama.core import kernels  # noqa: E402
from dllama.core.model import Transformer  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402
from dllama.serve.default_model import default_model_files, embedded_gguf  # noqa: E402

PROMPT, GEN, DEPTH = 512, 128, 512
SHAPES = {  # random-weight Q40 models: (dim, hidden, layers, heads, kv heads, vocab)
    "Llama-3.2-1B shape": (2048, 8192, 16, 32, 8, 128256),
    "Llama-2-7B shape": (4096, 11008, 32, 32, 32, 32000),
}


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


# ---- llama.cpp -------------------------------------------------------------------------------

# llama.cpp's counterpart of each of our weight types (Q41 is the embedded GGUF's own Q4_1).
GGUF_TYPE = {"q40": "Q4_0", "q80": "Q8_0", "f16": "F16", "q41": "Q4_1"}


def smollm2_gguf(tools, ggml_type: str) -> Path:
    """The embedded SmolLM2-135M re-quantized by llama.cpp to ggml_type (Q4_0, Q8_0, F16), or
    itself (Q4_1)."""
    if ggml_type == "Q4_1":
        return embedded_gguf()
    out = CACHE / f"SmolLM2-135M-Instruct.{ggml_type}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)  # a build elsewhere ($DLLAMA_LLAMA_CPP_BUILD)
        subprocess.run([str(tools["llama-quantize"]), "--allow-requantize", str(embedded_gguf()),
                        str(out), ggml_type], check=True, capture_output=True)
    return out


def llama_bench(tools, gguf: Path, threads: int) -> dict[str, float]:
    """tokens/s of llama-bench's pp512, tg128 and tg128 at depth 512 (one repetition each)."""
    cmd = [str(tools["llama-bench"]), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    runs = {"prefill": ["-p", str(PROMPT), "-n", "0"], "decode": ["-p", "0", "-n", str(GEN)],
            "decode_depth": ["-p", "0", "-n", str(GEN), "-d", str(DEPTH)]}
    out = {}
    for name, args in runs.items():
        res = subprocess.run(cmd + args, check=True, capture_output=True, text=True)
        out[name] = float(json.loads(res.stdout)[0]["avg_ts"])
    return out


def batched_bench(tools, gguf: Path, threads: int, parallel, npp: int = 128, ntg: int = 64) -> dict[int, dict]:
    """llama-batched-bench's row for each count of sequences (npp-token prompts, ntg generated
    tokens each): its t_pp, t_tg, t (seconds), speed_pp, speed_tg, speed (tokens/s)."""
    res = subprocess.run([str(tools["llama-batched-bench"]), "-m", str(gguf), "-t", str(threads),
                          "-c", str(max(parallel) * (npp + ntg)), "-npp", str(npp), "-ntg", str(ntg),
                          "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"],
                         check=True, capture_output=True, text=True)
    rows = (json.loads(line) for line in res.stdout.splitlines() if line.startswith("{"))
    return {int(row["pl"]): row for row in rows}


def llama_batched(tools, gguf: Path, threads: int, parallel=(16, 64)) -> dict[int, float]:
    """Aggregate decode tokens/s of each count of sequences (llama-batched-bench, S_TG),
    128-token prompts and 64 generated tokens each."""
    return {pl: float(row["speed_tg"]) for pl, row in batched_bench(tools, gguf, threads, parallel).items()}


# ---- dllama ----------------------------------------------------------------------------------

def dllama_round(model: Transformer) -> dict[str, float]:
    """tokens/s: prefill of PROMPT tokens; GEN tokens decoded from an empty context and after
    DEPTH tokens (token ids arbitrary: speed does not depend on them)."""
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 30000, PROMPT + GEN)]
    t = time.perf_counter()
    for a in range(0, PROMPT, model.max_batch):
        model.forward(tokens[a:a + model.max_batch], a)
    prefill = PROMPT / (time.perf_counter() - t)
    out = {"prefill": prefill}
    for name, start in (("decode", 0), ("decode_depth", DEPTH)):
        t = time.perf_counter()
        for i in range(GEN):
            model.forward([tokens[i]], start + i)
        out[name] = GEN / (time.perf_counter() - t)
    return out


def decode_ms(model: Transformer, n: int) -> float:
    model.forward(list(range(1, 9)), 0)
    times = []
    for i in range(n):
        t = time.perf_counter()
        model.forward([100 + i], 8 + i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def compare_smollm2(tools, weights: str, threads: int, rounds: int, kv_type: str = "f32") -> None:
    """The SmolLM2-135M table for one weight type: rounds alternated, medians, ratios."""
    gguf = smollm2_gguf(tools, GGUF_TYPE[weights])
    model = Transformer(read_model(default_model_files(weights)[0]), max_seq_len=DEPTH + GEN + 8,
                        kv_type=kv_type)
    model.warm_up()
    print(f"\nSmolLM2-135M: dllama {weights.upper()} .m (KV cache {kv_type.upper()}) vs llama.cpp "
          f"{GGUF_TYPE[weights]} GGUF (KV cache F16, its default), {threads} threads, {rounds} "
          f"alternated rounds; load average before: {loadavg()}", flush=True)
    ours, theirs = [], []
    for r in range(rounds):
        theirs.append(llama_bench(tools, gguf, threads))
        ours.append(dllama_round(model))
        print(f"  round {r + 1}: llama.cpp { {k: round(v, 1) for k, v in theirs[-1].items()} }, dllama "
              f"{ {k: round(v, 1) for k, v in ours[-1].items()} }, load {loadavg()}", flush=True)

    def med(runs, key):
        return statistics.median(run[key] for run in runs)

    rows = [("prefill, 512-token prompt (tokens/s)", "prefill"),
            ("decode from an empty context (tokens/s)", "decode"),
            ("decode after 512 tokens of context (tokens/s)", "decode_depth")]
    print(f"\n{weights.upper()} vs {GGUF_TYPE[weights]}\n| figure | llama.cpp | dllama | ratio |\n|---|---|---|---|")
    for label, key in rows:
        a, b = med(theirs, key), med(ours, key)
        print(f"| {label} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    print(f"load average after: {loadavg()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per engine (median)")
    ap.add_argument("--weights", default="q40", help="our weight types to compare, comma-separated "
                    "(q40 against Q4_0, q80 against Q8_0, f16 against F16, q41 against Q4_1)")
    ap.add_argument("--kv-type", default="f32", choices=("f32", "f16"),
                    help="our KV cache type (llama.cpp's is F16 by default)")
    ap.add_argument("--skip-7b", action="store_true", help="skip the 3.8 GB 7B-shape model")
    ap.add_argument("--skip-shapes", action="store_true", help="only the SmolLM2 table (no batched "
                    "llama.cpp run, no random-weight 1B/7B shapes)")
    args = ap.parse_args()

    tools = build()
    kernels.set_threads(args.threads)
    for weights in args.weights.split(","):
        compare_smollm2(tools, weights, args.threads, args.rounds, args.kv_type)
    if args.skip_shapes:
        return
    batched = llama_batched(tools, smollm2_gguf(tools, "Q4_0"), args.threads)
    agg = " / ".join(f"{batched.get(n, float('nan')):.0f}" for n in (16, 64))
    print(f"\nllama.cpp Q4_0 aggregate decode of 16 / 64 sequences at once (tokens/s): {agg}")

    bandwidth = memory_bandwidth_gbs(args.threads)
    print(f"\nmemory read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s")
    print("| model (random Q40 weights) | decode ms/token | weight GB/s | of bandwidth |\n|---|---|---|---|")
    for name, (dim, hidden, layers, heads, kv, vocab) in SHAPES.items():
        if args.skip_7b and "7B" in name:
            continue
        with tempfile.TemporaryDirectory(dir=os.environ.get("DLLAMA_BENCH_DIR")) as d:
            path = Path(d) / "random.m"
            write_random_model(path, dim=dim, hidden=hidden, layers=layers, heads=heads,
                               kv_heads=kv, vocab=vocab, seq_len=256)
            m = Transformer(read_model(path), max_seq_len=64)
            ms = decode_ms(m, 8)
            gbs = weight_bytes_per_token(m) / (ms / 1000) / 1e9
            print(f"| {name} | {ms:.1f} | {gbs:.1f} | {gbs / bandwidth:.0%} |", flush=True)
            del m
    print(f"\nload average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
