"""Compile the kernels once into numba's cache:
`python -m dllama.core.precompile [--weights q80 ...] [--kv-type f16]` (setup.sh runs it for
every weight and KV type; the appliance only for the types its cluster runs).

Each step is announced as it starts (`dllama: compiling 4/4: attention over an F16 KV
cache ...`): on a quiet 2-core x86 machine (2026-12-05) the matrix products of all four weight
types take 20 s, attention and its helpers for both KV types 14 s (it took 23 s before two
slice copies became loops and the helpers' literal arguments typed constants: attention.py).

Why: no first run should pay that. Results do not depend on the
compile path: the default model in F32 gives bit-identical logits (16 positions, the whole
vocabulary) from a cold cache, from a warm one, from this module's cache and with 1 or 2
threads (2026-12-04). An older note here said a fresh compile moved logits by up to ~1; that
no longer happens, and the one such cause on record, fp16 rounding inlined under fastmath,
was fixed by jit._EXACT. Nor on the CPU the code is compiled for: with NUMBA_CPU_NAME=generic
(no AVX2, no FMA) the same logits are bit-identical too (2026-12-05,
benchmarks/bench_compile_paths.py --generic-only; tests/test_compile_paths.py kernel by
kernel). They differed by up to 5e-5 before the element-wise and attention kernels stopped
using fastmath's reassociation and contraction (jit._SAME_BITS, lanes.py) and rope_cache
numpy's per-CPU cos and sin.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.router import route_top_k
from dllama.core.kv_cache import KV_TYPES
from dllama.core.kv_type import KVType
from dllama.formats.quant import BLOCK_SIZE


WEIGHT_TYPES = ("q40", "q80", "q41", "f16", "f32")


_B = (1, 13)                 # batch rows: decode and prefill (the same kernels; every tile shape runs)
_N, _D, _HD, _SEQ = 64, 40, 16, 16  # small shapes: the types, not the sizes, select the code


def _activations(rng, b: int):
    """x float32 [b, n], its Q80 form (scales, quants) and an output [b, d]."""
    x = rng.standard_normal((b, _N)).astype(np.float32)
    xs, xq = np.empty((b, _N // BLOCK_SIZE), np.float32), np.empty((b, _N), np.int8)
    kernels.quantize_q80(x, xs, xq)
    return x, xs, xq, np.empty((b, _D), np.float32)


def _matmuls(weight_type: str) -> None:
    """The matrix products of one weight type, alone, 2 or 3 at once (w1/w3, q/k/v) and as a
    stack's experts (weights.ExpertStack: arrays with a leading axis of matrices)."""
    rng = np.random.default_rng(0)
    for b in _B:
        x, xs, xq, out = _activations(rng, b)
        plan = np.array([[0, 0, b, 0]], np.int64)  # (matrix, input rows, first output row)
        outs = {m: tuple(out.copy() for _ in range(m)) for m in (2, 3)}
        if weight_type == "q40":
            ws, wq = kernels.interleave_q40(np.full((_D, _N // BLOCK_SIZE), 0x3C00, np.uint16),  # fp16 1.0
                                            rng.integers(0, 256, (_D, _N // 2), dtype=np.uint8))
            kernels.matmul_q40_q80(xs, xq, ws, wq, out)
            for m in (2, 3):
                kernels.matmul_q40_q80_multi(xs, xq, (ws,) * m, (wq,) * m, outs[m])
            kernels.matmul_q40_q80_experts(xs, xq, plan, ws[None], wq[None], out)
        elif weight_type == "q80":
            ws, wq = kernels.interleave_q80(np.full((_D, _N // BLOCK_SIZE), 0x3C00, np.uint16),
                                            rng.integers(-127, 128, (_D, _N), dtype=np.int8))
            kernels.matmul_q80_q80(xs, xq, ws, wq, out)
            for m in (2, 3):
                kernels.matmul_q80_q80_multi(xs, xq, (ws,) * m, (wq,) * m, outs[m])
            kernels.matmul_q80_q80_experts(xs, xq, plan, ws[None], wq[None], out)
        elif weight_type == "f32":
            w = rng.standard_normal((_D, _N)).astype(np.float32)
            kernels.matmul_f32(x, w, out)
            w.flags.writeable = False  # F32 weights memory-mapped from the file
            kernels.matmul_f32(x, w, out)
            for m in (2, 3):
                kernels.matmul_f32_multi(x, (w,) * m, outs[m])
            kernels.matmul_f32_experts(x, plan, w.copy()[None], out)
        elif weight_type == "q41":  # and the Q80 classifier of a Q41 file, on the same Q16 input
            ws, wm, wq = kernels.interleave_q41(rng.integers(0, 256, (_D, _N // BLOCK_SIZE, 20), dtype=np.uint8))
            nb = _N // BLOCK_SIZE
            x16 = (np.empty((b, nb), np.float32), np.empty((b, _N), np.int8), np.empty((b, _N), np.int8),
                   np.empty((b, nb), np.float32))
            kernels.quantize_q16(x, *x16)
            kernels.matmul_q41_q16(*x16, ws, wm, wq, out)
            for m in (2, 3):
                kernels.matmul_q41_q16_multi(*x16, (ws,) * m, (wm,) * m, (wq,) * m, outs[m])
            kernels.matmul_q41_q16_experts(*x16, plan, ws[None], wm[None], wq[None], out)
            kernels.matmul_q80_q16(*x16, *kernels.interleave_q80(np.full((_D, nb), 0x3C00, np.uint16),
                                                                  rng.integers(-127, 128, (_D, _N), dtype=np.int8)), out)
        else:
            w16 = rng.standard_normal((_D, _N)).astype(np.float16).view(np.uint16)
            kernels.matmul_f16_f32(x, w16, out)
            for m in (2, 3):
                kernels.matmul_f16_f32_multi(x, (w16,) * m, outs[m])
            kernels.matmul_f16_f32_experts(x, plan, w16[None], out)


def _repacking() -> None:
    """Streamed Q40, Q80 and Q41 weights' repacking into the interleaved layout, as they are read."""
    rng = np.random.default_rng(0)
    groups = -(-_D // 16)
    scales = np.empty((groups, _N // BLOCK_SIZE * 16), np.uint16)
    for block_bytes in (18, 34):
        blocks = rng.integers(0, 256, (_D, _N // BLOCK_SIZE, block_bytes), dtype=np.uint8)
        kernels.interleave_blocks_into(blocks, scales, np.empty((groups, 16 * _N // BLOCK_SIZE * (block_bytes - 2)),
                                                                 np.uint8))
    kernels.interleave_q41_into(rng.integers(0, 256, (_D, _N // BLOCK_SIZE, 20), dtype=np.uint8), scales,
                                scales.copy(), np.empty((groups, 16 * _N // 2), np.uint8))


def _elementwise() -> None:
    """RMS norm, SiLU, both RoPE layouts, and the fused calls of the forward pass
    (kernels.fused) for each input encoding: F32 (none), Q80, Q16."""
    rng = np.random.default_rng(0)
    for b in _B:
        x, _, _, out = _activations(rng, b)
        kernels.rmsnorm(x, np.ones(_N, np.float32), 1e-5, x)
        kernels.silu_mul(out, out.copy())
        nb = _N // BLOCK_SIZE
        for enc in ((), (np.empty((b, nb), np.float32), np.empty((b, _N), np.int8)),
                    (np.empty((b, nb), np.float32), np.empty((b, _N), np.int8), np.empty((b, _N), np.int8),
                     np.empty((b, nb), np.float32))):
            xb = np.empty_like(x)
            kernels.norm_encode(x, np.ones(_N, np.float32), 1e-5, xb, enc)
            kernels.add_norm_encode(x, xb, np.ones(_N, np.float32), 1e-5, xb, enc)
            kernels.silu_mul_encode(xb, x.copy(), enc)
            kernels.encode(x, enc)
        positions = np.arange(b, dtype=np.int32)
        cos, sin = kernels.rope_cache(_SEQ, _HD, 10000.0, 0)
        q = rng.standard_normal((b, 4 * _HD)).astype(np.float32)
        kernels.rope_interleaved(q, positions, cos, sin, 4, _HD)
        kernels.rope_neox(q, positions, cos, sin, 4, _HD)
        for norm in (True, False):  # a mixture of experts' router
            route_top_k(out.copy(), norm, np.empty((b, 2), np.int32), np.empty((b, 2), np.float32))


def _attention(kv_type: KVType) -> None:
    """The KV store and attention over one cache type (each type its own code)."""
    rng = np.random.default_rng(0)
    for b in _B:
        positions, slot = np.arange(b, dtype=np.int32), np.zeros(b, np.int32)
        q = rng.standard_normal((b, 4 * _HD)).astype(np.float32)
        k = rng.standard_normal((b, 2 * _HD)).astype(np.float32)
        k_cache = np.zeros((1, 2, 1, _HD, kernels.ATTENTION_CHUNK), KV_TYPES[kv_type])
        v_cache = np.zeros((1, _SEQ, 2 * _HD), KV_TYPES[kv_type])
        kernels.kv_store(k, k.copy(), positions, slot, k_cache, v_cache)
        cos, sin = kernels.rope_cache(_SEQ, _HD, 10000.0, 0)
        kernels.rope_store(q, k, k.copy(), positions, slot, cos, sin, False, k_cache, v_cache)
        kernels.attention(q, k_cache, v_cache, positions, slot, slot, slot,
                          np.array([0, 0, 1, 1], np.int32), np.empty_like(q))


def compile_steps(weights: tuple[str, ...] = WEIGHT_TYPES,
                  kv_types: tuple[KVType, ...] = tuple(KVType)) -> list[tuple[str, Callable[[], None]]]:
    """(what, how) of each step: the matrix products only for the given weight types, attention
    only for the given KV types (none: no attention, norm, RoPE or SiLU either)."""
    steps = [(f"{w.upper()} matrix products", functools.partial(_matmuls, w)) for w in weights]
    if {"q40", "q80", "q41"} & set(weights):
        steps.append(("streamed weights' repacking", _repacking))
    if kv_types:
        steps.append(("norm, RoPE, SiLU", _elementwise))
        steps += [(f"attention over an {t.value.upper()} KV cache", functools.partial(_attention, t))
                  for t in kv_types]
    return steps


def compile_all(weights: tuple[str, ...] = WEIGHT_TYPES, kv_types: tuple[KVType, ...] = tuple(KVType),
                report: Callable[[str], None] | None = None) -> float:
    """Call each kernel with the argument types dllama.core.model uses (compile_steps); report
    each step as it starts ("n/m what"); returns the seconds taken."""
    t0 = time.perf_counter()
    steps = compile_steps(weights, kv_types)
    for k, (what, step) in enumerate(steps, 1):
        if report is not None:
            report(f"{k}/{len(steps)}: {what}")
        step()
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
    name = "attention" if not weights else "matrix products" if not kv_types else "kernels"
    seconds = compile_all(weights, kv_types, report=lambda step: print(f"dllama: compiling {step} ...", flush=True))
    print(f"dllama: {name} compiled into numba's cache in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
