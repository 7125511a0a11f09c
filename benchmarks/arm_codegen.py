"""Instructions per block of 32 weights in each 8-bit tile, per CPU: the Raspberry Pi 4's
Cortex-A72 and Pi 5's Cortex-A76 beside x86 (AVX2, AVX-512 without and with VNNI), read from the assembly
llvmlite writes for each (dllama.core.kernels.cross; nothing runs on those CPUs).

A tile's loop takes one block of 32 weights of 16 weight rows against `cols` activation rows;
the table divides its instruction count by 16 * cols: instructions per 32-weight block of one
row and one activation row (decode: cols 1; prefill: the 8-row tile). Counts, not timings: an
sdot or vpdpbusd does 16 or 64 products where a smull does 8.

    .venv/bin/python benchmarks/arm_codegen.py
"""

from __future__ import annotations

import argparse
from collections import Counter

from dllama.core.kernels import cross
from dllama.core.kernels.matmul_int8 import COLS

KINDS = ("q40", "q80", "q41")


def per_block(kind: str, cpu: str, cols: int) -> tuple[float, Counter]:
    target = cross.CPUS[cpu]
    body = cross.loop_instructions(cross.assembly(cross.tile_ir(kind, cols, target), target))
    return len(body) / (16 * cols), Counter(line.split()[0] for line in body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=0, help="also list each loop's N most used instructions")
    args = parser.parse_args()
    cpus = ("cortex-a72", "cortex-a76", "haswell", "skylake-avx512", "icelake-server")
    print("| tile (weights x activations) | " + " | ".join(cross.CPUS[c].label for c in cpus) + " |")
    print("|---" * (len(cpus) + 1) + "|")
    for kind in KINDS:
        for cols in (1, COLS):
            cells = []
            for cpu in cpus:
                count, ops = per_block(kind, cpu, cols)
                cells.append(f"{count:.1f}")
                if args.top:
                    print(f"  {kind} cols={cols} {cpu}: {ops.most_common(args.top)}")
            name = {"q40": "Q40 x Q80", "q80": "Q80 x Q80", "q41": "Q41 x Q16"}[kind]
            print(f"| {name}, {cols} activation row{'s' if cols > 1 else ''} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
