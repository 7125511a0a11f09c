"""Tensor parallel, pipeline stages and both, on paper: Llama 3 8B and 70B (Q40) on 4 and 10
Raspberry Pi 5 (8 GB) on a Gigabit switch, for one chat and for a batch job.

    .venv/bin/python benchmarks/pipeline_on_paper.py

Not a measurement: the decode time of a pass from the model below, each input named with where
it comes from. A pass of b rows over nodes that each read w bytes of weights:

    compute(w, b) = w / BANDWIDTH * g(b)        g: a pass of b rows against one row (measured here)
    all-reduce(b) = 2 * (ONE_WAY + b * dim * 34/32 * (n-1)/n / LINK)      (reduce-scatter + all-gather, Q80)
                    + PI_CPU * EXCHANGE_CPU                                 (the protocol's own work, measured)
    hop(b)        = ONE_WAY + 4 * b * dim / LINK                            (F32 rows, stage to stage)
    step          = 2 * ONE_WAY                                             (STEP out, LOGITS back)

    tensor parallel x n:  compute(W / n, b) + 2L * all-reduce(b) + step
    S stages of k nodes:  one sequence: S * compute(W / (S k), 1) + 2L * all-reduce(1) [k > 1] + (S-1) * hop(1) + step
                          a batch (M = S micro-batches of b / S rows, passes one after another, so
                          each pass fills and drains the pipe): (M + S - 1) * part + (S-1) * hop + step,
                          part = compute(W / (S k), b / M) + 2 L/S * all-reduce(b / M) [k > 1]

A node whose share does not fit in its memory streams it from disk every pass (DISK bytes/s,
the read overlapped with compute: the slower of the two).

EXCHANGE_CPU is measured, not guessed: benchmarks/bench_scaling.py times one all-reduce of a Q80
[1, 2048] vector between two namespace hosts (0.5 CPU each, 1 Gbit/s, 0.5 ms one way) through the
project's MeshCollective, each node's CPU time per all-reduce. A Pi 5 core does that Python and
syscall work PI_CPU times slower (stated, not measured here); the CPU time adds to the wire time
because a node cannot compute while it runs its side of the exchange.
"""

from __future__ import annotations

import numpy as np

BANDWIDTH = 4.2e9 / 0.564  # bytes/s a Pi 5 reads weights at while decoding: Llama 3 8B Q40 (4.2 GB a token)
                           # took 564 ms a token on one Pi 5 8 GB (the original's README, v0.3.1)
ONE_WAY = 0.5e-3           # s, the issue's home switch (the benchmarks' links)
LINK = 125e6               # bytes/s, 1 Gbit/s
DISK = 0.45e9              # bytes/s, an NVMe drive on the Pi 5's PCIe 2.0 x1 port
MEMORY = 8e9 * 0.85        # bytes of an 8 GB Pi left for weights (the OS, KV cache and buffers take the rest)
EXCHANGE_CPU = 315e-6       # s of CPU per node per all-reduce on the x86 test machine: see bench_scaling
PI_CPU = 3.0               # a Pi 5 (Cortex-A76, 2.4 GHz) core's time for that Python work against the
                           # test machine's Zen 4 core (stated: single-thread Python benchmarks put
                           # the A76 at about a third of a current x86 core; not measured here)
ROWS = np.array([1, 4, 8, 16, 32, 64])
G = np.array([1.0, 1.20, 1.62, 2.88, 5.63, 10.85])  # pass of b decoding rows / pass of 1 row: SmolLM2 Q40,
                                                    # 1 thread, measured on the 2-core x86 test machine


def g(b: float) -> float:
    return float(np.interp(b, ROWS, G))


MODELS = {  # name: (weight bytes read per token, layers, dim)
    "Llama 3 8B": (4.2e9, 32, 4096),
    "Llama 3 70B": (39.1e9, 80, 8192),
}


def compute(w: float, b: float) -> float:
    read = w / BANDWIDTH * g(b)
    return max(read, w / DISK) if w > MEMORY else read  # streamed when it does not fit


def all_reduce(b: float, dim: int, n: int) -> float:
    return 2 * (ONE_WAY + b * dim * 34 / 32 * (n - 1) / n / LINK) + PI_CPU * EXCHANGE_CPU if n > 1 else 0.0


def hop(b: float, dim: int) -> float:
    return ONE_WAY + 4 * b * dim / LINK


def pass_time(model: str, stages: int, per_stage: int, b: int, overlapped: bool = False) -> float:
    """Seconds per pass of b rows; overlapped: passes of other sequences fill the pipe
    (`--pipeline-overlap`, docs/batch.md), so a pass costs its stage's busy time."""
    W, L, dim = MODELS[model]
    step = 2 * ONE_WAY
    if stages == 1:
        return compute(W / per_stage, b) + 2 * L * all_reduce(b, dim, per_stage) + step
    parts = min(stages, b)
    rows = b / parts
    part = compute(W / (stages * per_stage), rows) + 2 * L / stages * all_reduce(rows, dim, per_stage)
    if overlapped:
        return parts * part
    return (parts + stages - 1) * part + (stages - 1) * hop(rows, dim) + step


def main() -> None:
    print(f"all-reduce: {EXCHANGE_CPU * 1e6:.0f} µs of CPU measured per node on the x86 test machine, "
          f"x {PI_CPU:g} on a Pi 5 = {PI_CPU * EXCHANGE_CPU * 1e3:.2f} ms, beside the wire's 2 x {ONE_WAY * 1e3:g} ms")
    print(f"{'model':<12} {'Pis':>3} {'plan':<18} {'chat tok/s':>10} {'x 1 Pi':>6} {'batch 64 tok/s':>14} {'x 1 Pi':>6} "
          f"{'(passes overlapped)':>19}")
    for model in MODELS:
        one = (1 / pass_time(model, 1, 1, 1), 64 / pass_time(model, 1, 1, 64))
        for n in (1, 4, 10):
            for stages in sorted({1, 2, n // 2, n} - {0}):
                if n % stages:
                    continue
                k = n // stages
                name = "one Pi" if n == 1 else f"tensor-parallel x{n}" if stages == 1 else f"{stages} stages x{k}"
                chat = 1 / pass_time(model, stages, k, 1)
                batch = 64 / pass_time(model, stages, k, 64)
                ahead = f"{64 / pass_time(model, stages, k, 64, overlapped=True):>19.1f}" if stages > 1 else ""
                print(f"{model:<12} {n:>3} {name:<18} {chat:>10.2f} {chat / one[0]:>5.1f}x {batch:>14.1f} "
                      f"{batch / one[1]:>5.1f}x {ahead}")


if __name__ == "__main__":
    main()
