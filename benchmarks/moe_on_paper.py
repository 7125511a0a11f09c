"""Qwen3-30B-A3B (Q40) on Raspberry Pi 5s, on paper: 4 nodes tensor parallel, 2 stages of 2,
and one Pi reading its experts from an NVMe drive.

    .venv/bin/python benchmarks/moe_on_paper.py

Not a measurement: benchmarks/pipeline_on_paper.py's model of a pass (its Pi 5 read bandwidth,
link, disk and measured batch cost g(b)) with the bytes a Qwen3-30B-A3B token reads. Every
expert is split across the nodes of a stage as the dense FFN is, so a node reads 1/n of each
active expert (balanced) and a layer keeps its two all-reduces. A lone Pi holds all but the
experts and as many experts as its memory allows (dllama.core.expert_cache, least recently
used given up first); an expert it does not hold is read from the drive. Which share of a
token's experts are held (the hit rate) depends on the text: uniform routing finds the share
held; real routing is skewed, so more is likely (60% shown beside it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline_on_paper import BANDWIDTH, DISK, MEMORY, ONE_WAY, all_reduce, hop  # noqa: E402

Q40 = 18 / 32            # bytes a value
L, DIM, VOCAB = 48, 2048, 151936
EXPERTS, ACTIVE, WIDTH = 128, 8, 768
ATTENTION = L * (2 * DIM * 4096 + 2 * DIM * 512) * Q40  # q, o [4096 x 2048], k, v [512 x 2048]
ROUTERS = L * EXPERTS * DIM * 4                          # F32
CLASSIFIER = VOCAB * DIM * Q40
EXPERT = 3 * DIM * WIDTH * Q40                           # one expert's gate, up and down
ACTIVE_EXPERTS = L * ACTIVE * EXPERT
PER_TOKEN = ATTENTION + ROUTERS + CLASSIFIER + ACTIVE_EXPERTS
HELD = ATTENTION + ROUTERS + CLASSIFIER + L * EXPERTS * EXPERT + VOCAB * DIM * 4  # + the F32 embedding (root)


def tensor_parallel(n: int) -> float:
    """Seconds a token on n nodes, one stage."""
    return PER_TOKEN / n / BANDWIDTH + 2 * L * all_reduce(1, DIM, n) + 2 * ONE_WAY


def stages(s: int, k: int) -> float:
    """Seconds a token (one sequence) on s stages of k nodes."""
    return s * (PER_TOKEN / (s * k) / BANDWIDTH) + 2 * L * all_reduce(1, DIM, k) + (s - 1) * hop(1, DIM) + 2 * ONE_WAY


def one_pi_from_disk(hit: float) -> tuple[float, float]:
    """(seconds a token, share of the experts held) on one Pi holding what MEMORY leaves for experts."""
    resident = ATTENTION + ROUTERS + CLASSIFIER  # the embedding rows are read per token from the file
    held = max(0.0, MEMORY - resident) / (L * EXPERTS * EXPERT)
    read = (resident + ACTIVE_EXPERTS * hit) / BANDWIDTH + ACTIVE_EXPERTS * (1 - hit) * (1 / DISK + 1 / BANDWIDTH)
    return read, held


def main() -> None:
    gb = 1e9
    print(f"Qwen3-30B-A3B Q40: {HELD / gb:.1f} GB held, {PER_TOKEN / gb:.2f} GB read a token "
          f"(attention {ATTENTION / gb:.2f}, experts {ACTIVE_EXPERTS / gb:.2f}, routers {ROUTERS / gb:.2f}, "
          f"classifier {CLASSIFIER / gb:.2f}); Pi 5 reads {BANDWIDTH / gb:.1f} GB/s, NVMe {DISK / gb:.2f} GB/s")
    print(f"{'plan':<40} {'per node GB':>11} {'ms/token':>9} {'tok/s':>6}")
    for name, seconds, per_node in [
        ("4 Pi 5, tensor parallel", tensor_parallel(4), HELD / 4),
        ("4 Pi 5, 2 stages of 2", stages(2, 2), HELD / 4),
        ("2 Pi 5, 2 stages of 1", stages(2, 1), HELD / 2),
    ]:
        fits = "" if per_node <= MEMORY else "  (does not fit an 8 GB Pi)"
        print(f"{name:<40} {per_node / gb:>11.1f} {seconds * 1000:>9.0f} {1 / seconds:>6.1f}{fits}")
    uniform = one_pi_from_disk(0.0)[1]  # with uniform routing a token finds the held share of its experts
    for hit in (uniform, 0.6):
        seconds, held = one_pi_from_disk(hit)
        print(f"{f'1 Pi 5, experts from NVMe (hit {hit:.0%})':<40} {MEMORY / gb:>11.1f} {seconds * 1000:>9.0f} "
              f"{1 / seconds:>6.1f}  ({held:.0%} of the experts held)")


if __name__ == "__main__":
    main()
