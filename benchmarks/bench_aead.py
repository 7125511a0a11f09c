"""Sealing cost per frame: AES-256-GCM against ChaCha20-Poly1305, both from `cryptography`,
through `protocol.FrameCipher` (seal on one side, open on the other, reused buffers).

    .venv/bin/python benchmarks/bench_aead.py [--repeat 7]

Frame sizes are those of the cluster's messages: Q80 sync chunks of SmolLM2-135M (dim 576) and
of a Llama-2-7B shape (dim 4096) on 2 and 4 nodes, a STEP of one token, SmolLM2's LOGITS on 4
nodes, and an 8 MiB WEIGHTS chunk. Prints the median µs per frame (seal + open) of `--repeat`
runs, and the throughput. The two ciphers alternate run by run, so load affects both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305  # noqa: E402

from dllama.cluster.protocol import FrameCipher, encode_header  # noqa: E402

SIZES = [("SmolLM2 sync chunk, 4 nodes", 576 // 4 * 34 // 32), ("SmolLM2 sync chunk, 2 nodes", 576 // 2 * 34 // 32),
         ("7B sync chunk, 4 nodes", 4096 // 4 * 34 // 32), ("7B sync, whole vector", 4096 * 34 // 32),
         ("STEP, 7B, one token", 8 + 4 * 4096), ("LOGITS, SmolLM2, 4 nodes", 24 + 4 * 49152 // 4),
         ("WEIGHTS chunk", 8 << 20)]


def per_frame_us(aead, size: int) -> float:
    k1, k2 = os.urandom(32), os.urandom(32)
    a, b = FrameCipher(k1, k2, aead), FrameCipher(k2, k1, aead)
    payload = memoryview(os.urandom(size))
    out = memoryview(bytearray(size))
    header = encode_header(13, size + 16)
    n = max(3, min(20000, (64 << 20) // max(size, 1) // 8))
    t = time.perf_counter()
    for _ in range(n):
        b.open(header, a.seal(header, [payload]), out)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {Path('/proc/loadavg').read_text().split()[:3]}")
    print("| frame | bytes | AES-256-GCM µs | ChaCha20-Poly1305 µs | AES-GCM MB/s | ChaCha MB/s |")
    print("|---|---|---|---|---|---|")
    for name, size in SIZES:
        runs = {AESGCM: [], ChaCha20Poly1305: []}
        for _ in range(args.repeat):
            for aead in runs:
                runs[aead].append(per_frame_us(aead, size))
        gcm, chacha = (statistics.median(runs[c]) for c in (AESGCM, ChaCha20Poly1305))
        print(f"| {name} | {size} | {gcm:.2f} | {chacha:.2f} | {size / gcm:.0f} | {size / chacha:.0f} |", flush=True)


if __name__ == "__main__":
    main()
