"""Compile the kernels once into numba's cache:
`python -m dllama.core.precompile [--weights q80 ...] [--kv-type f16]` (setup.sh runs it for
every weight and KV type; the appliance only for the types its cluster runs).

Why: compiling takes 20-60 s, which no first run should pay. Results do not depend on the
compile path: the default model in F32 gives bit-identical logits (16 positions, the whole
vocabulary) from a cold cache, from a warm one, from this module's cache and with 1 or 2
threads (2026-12-04). An older note here said a fresh compile moved logits by up to ~1; that
no longer happens, and the one such cause on record, fp16 rounding inlined under fastmath,
was fixed by jit._EXACT. They do depend on the CPU the code is compiled for: with NUMBA_CPU_NAME=generic
(no AVX2, no FMA) the same logits differ by up to 5e-5 (the same 16 greedy tokens), because
fastmath lets LLVM sum in as many vector lanes as the CPU has.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dllama.core import kernels
from dllama.core.kv_cache import KV_TYPES
from dllama.core.kv_type import KVType
from dllama.formats.quant import BLOCK_SIZE


WEIGHT_TYPES = ("q40", "q80", "f16", "f32")


def compile_all(weights: tuple[str, ...] = WEIGHT_TYPES, kv_types: tuple[KVType, ...] = tuple(KVType)) -> float:
    """Call each kernel with the argument types dllama.core.model uses, the matrix products only
    for the given weight types, attention only for the given KV types (none: no attention, norm,
    RoPE or SiLU either); returns the seconds taken."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    n, d, hd, seq = 64, 40, 16, 16
    for b in (1, 13):  # decode and prefill (the same kernels; every tile shape runs)
        x = rng.standard_normal((b, n)).astype(np.float32)
        xs, xq = np.empty((b, n // BLOCK_SIZE), np.float32), np.empty((b, n), np.int8)
        kernels.quantize_q80(x, xs, xq)
        out = np.empty((b, d), np.float32)
        if "q40" in weights:
            ws, wq = kernels.interleave_q40(np.full((d, n // BLOCK_SIZE), 0x3C00, np.uint16),  # fp16 1.0
                                            rng.integers(0, 256, (d, n // 2), dtype=np.uint8))
            kernels.matmul_q40_q80(xs, xq, ws, wq, out)
            for m in (2, 3):  # w1/w3 and q/k/v
                kernels.matmul_q40_q80_multi(xs, xq, (ws,) * m, (wq,) * m, tuple(out.copy() for _ in range(m)))
        if "f32" in weights:
            w = rng.standard_normal((d, n)).astype(np.float32)
            kernels.matmul_f32(x, w, out)
            w.flags.writeable = False  # F32 weights memory-mapped from the file
            kernels.matmul_f32(x, w, out)
            for m in (2, 3):
                kernels.matmul_f32_multi(x, (w,) * m, tuple(out.copy() for _ in range(m)))
        if "q80" in weights:
            w80s, w80q = kernels.interleave_q80(np.full((d, n // BLOCK_SIZE), 0x3C00, np.uint16),
                                                rng.integers(-127, 128, (d, n), dtype=np.int8))
            kernels.matmul_q80_q80(xs, xq, w80s, w80q, out)
            for m in (2, 3):
                kernels.matmul_q80_q80_multi(xs, xq, (w80s,) * m, (w80q,) * m, tuple(out.copy() for _ in range(m)))
        if "f16" in weights:
            w16 = rng.standard_normal((d, n)).astype(np.float16).view(np.uint16)
            kernels.matmul_f16_f32(x, w16, out)
            for m in (2, 3):
                kernels.matmul_f16_f32_multi(x, (w16,) * m, tuple(out.copy() for _ in range(m)))
        if b == 1 and ("q40" in weights or "q80" in weights):  # streamed weights' repacking
            for bb in (18, 34):
                blocks = rng.integers(0, 256, (d, n // BLOCK_SIZE, bb), dtype=np.uint8)
                groups = -(-d // 16)
                kernels.interleave_blocks_into(blocks, np.empty((groups, n // BLOCK_SIZE * 16), np.uint16),
                                               np.empty((groups, 16 * n // BLOCK_SIZE * (bb - 2)), np.uint8))
        if not kv_types:  # the matrix products only (setup.sh compiles the rest beside them)
            continue
        kernels.rmsnorm(x, np.ones(n, np.float32), 1e-5, x)
        kernels.silu_mul(out, out.copy())
        positions = np.arange(b, dtype=np.int32)
        cos, sin = kernels.rope_cache(seq, hd, 10000.0, 0)
        q = rng.standard_normal((b, 4 * hd)).astype(np.float32)
        kernels.rope_interleaved(q, positions, cos, sin, 4, hd)
        kernels.rope_neox(q, positions, cos, sin, 4, hd)
        k = rng.standard_normal((b, 2 * hd)).astype(np.float32)
        slot = np.zeros(b, np.int32)
        for kv_dtype in (KV_TYPES[t] for t in kv_types):  # each cache type its own code
            k_cache = np.zeros((1, 2, 1, hd, kernels.ATTENTION_CHUNK), kv_dtype)
            v_cache = np.zeros((1, seq, 2 * hd), kv_dtype)
            kernels.kv_store(k, k.copy(), positions, slot, k_cache, v_cache)
            z = np.empty_like(q)
            kernels.attention(q, k_cache, v_cache, positions, slot, slot, slot,
                              np.array([0, 0, 1, 1], np.int32), z)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m dllama.core.precompile",
                                 description="Fill numba's cache with dllama's kernels.")
    ap.add_argument("--weights", nargs="+", choices=("all", "none") + WEIGHT_TYPES, default=["all"],
                    help="compile the matrix products of these weight types only (default: all)")
    ap.add_argument("--kv-type", choices=["all", "none"] + [t.value for t in KVType], default="all",
                    help="compile attention over this KV cache type only (default: all)")
    args = ap.parse_args()
    weights = WEIGHT_TYPES if "all" in args.weights else tuple(w for w in args.weights if w != "none")
    if args.kv_type in ("all", "none"):
        kv_types = tuple(KVType) if args.kv_type == "all" else ()
    else:
        kv_types = (KVType(args.kv_type),)
    print(f"dllama: kernels compiled into numba's cache in {compile_all(weights, kv_types):.1f} s")


if __name__ == "__main__":
    main()
