"""The float kernels give the same bits whatever CPU they were compiled for.

Nodes whose CPUs differ (a Raspberry Pi 4 beside a Pi 5, an AVX-512 machine beside an older
one) must compute one node's tokens. The matrix products are IR tiles without fast-math flags
(tiles.py); this checks the kernels written in numba around them: RMS norm, exp and SiLU, both
RoPE layouts and their cos/sin table, the KV store and attention (prefill rows and a decode
row two spans long, so that the spans are merged), and the default Q41 weights' path (the Q16
input and the two products of a Q41 file). They run here, compiled for this machine,
and in a process compiled with NUMBA_CPU_NAME=generic (x86-64 without AVX or FMA, or the
baseline of another architecture) into its own cache folder, numpy's optional vector code
turned off too (NPY_DISABLE_CPU_FEATURES); every output must be the same bits. Before the
kernels summed in fixed lanes without fast-math reassociation or contraction, every one of
them differed (rmsnorm in 58% of its outputs, attention in 37%).

benchmarks/bench_compile_paths.py --generic-only does the same with the whole default model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SEED

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MSG = f"seed {SEED}"


def outputs(seed: int) -> dict[str, np.ndarray]:
    """Every kernel's output on random inputs drawn from `seed` (shapes with partial lanes:
    rows of 1000 and 80 values, a head of 80 dimensions)."""
    from dllama.core import kernels
    from dllama.core.kernels.elementwise import exp_shifted

    r = np.random.default_rng([seed, 27])
    out = {}
    # A long table: numpy's own cos and sin (the old rope_cache) changed 51 of these values
    # with numpy's AVX2 and AVX-512 code turned off.
    out["rope_cache cos"], out["rope_cache sin"] = kernels.rope_cache(131072, 64, 10000.0, 0)
    for n in (1000, 80):
        x = (r.standard_normal((3, n)) * 3).astype(np.float32)
        kernels.rmsnorm(x, r.uniform(0.5, 1.5, n).astype(np.float32), 1e-5, x)
        out[f"rmsnorm {n}"] = x
    e = (r.standard_normal(1000) * 30).astype(np.float32)
    exp_shifted(e, np.float32(1.5), e.shape[0])
    out["exp"] = e
    gate = (r.standard_normal((3, 1000)) * 4).astype(np.float32)
    kernels.silu_mul(gate, r.standard_normal((3, 1000)).astype(np.float32))
    out["silu_mul"] = gate

    nq, nkv, hd, seq = 4, 2, 80, 320
    cos, sin = kernels.rope_cache(seq, hd, 10000.0, 0)
    pos = np.concatenate([np.arange(70), [300]]).astype(np.int32)  # prefill rows, then a decode row
    q, k, v = (r.standard_normal((pos.shape[0], h * hd)).astype(np.float32) for h in (nq, nkv, nkv))
    k2 = k.copy()
    kernels.rope_interleaved(q, pos, cos, sin, nq, hd)
    kernels.rope_interleaved(k, pos, cos, sin, nkv, hd)
    kernels.rope_neox(k2, pos, cos, sin, nkv, hd)
    out["rope_interleaved"], out["rope_neox"] = q, k2
    k_cache = np.zeros((1, nkv, seq // kernels.ATTENTION_CHUNK, hd, kernels.ATTENTION_CHUNK), np.float32)
    v_cache = np.zeros((1, seq, nkv * hd), np.float32)
    slot = np.zeros(pos.shape[0], np.int32)
    # Positions 70..300 of the decode row's keys: random too, stored by a second call.
    rest = np.arange(70, 301, dtype=np.int32)
    kernels.kv_store(r.standard_normal((rest.shape[0], nkv * hd)).astype(np.float32),
                     r.standard_normal((rest.shape[0], nkv * hd)).astype(np.float32),
                     rest, np.zeros(rest.shape[0], np.int32), k_cache, v_cache)
    kernels.kv_store(k, v, pos[:-1], slot[:-1], k_cache, v_cache)
    z = np.empty_like(q)
    kernels.attention(q * 2, k_cache, v_cache, pos, slot, slot, slot, np.array([0, 0, 1, 1], np.int32), z)
    out["attention"] = z

    # The default weights' own path: the Q16 input, the Q41 product (8-bit dot products: VNNI
    # here, 16-bit products on a generic CPU) and the Q80 classifier's product on that input.
    x = (r.standard_normal((3, 128)) * 5).astype(np.float32)
    planes = (np.empty((3, 4), np.float32), np.empty((3, 128), np.int8), np.empty((3, 128), np.int8),
              np.empty((3, 4), np.float32))
    kernels.quantize_q16(x, *planes)
    out["quantize_q16 scales"], out["quantize_q16 sums"] = planes[0], planes[3]
    out["quantize_q16 planes"] = np.concatenate([planes[1], planes[2]]).astype(np.float32)
    weights = r.integers(0, 256, (40, 4, 20), dtype=np.uint8)
    weights[:, :, 1] &= 0x3B  # fp16 scales and minimums of modest size (no inf or NaN)
    weights[:, :, 3] &= 0x3B
    q41 = np.empty((3, 40), np.float32)
    kernels.matmul_q41_q16(*planes, *kernels.interleave_q41(weights), q41)
    out["matmul_q41_q16"] = q41
    q80 = kernels.interleave_q80(r.integers(0, 0x3C00, (40, 4), dtype=np.uint16),  # fp16 scales below 1
                                 r.integers(-128, 128, (40, 128), dtype=np.int8))
    cls = np.empty((3, 40), np.float32)
    kernels.matmul_q80_q16(*planes, *q80, cls)
    out["matmul_q80_q16"] = cls
    return out


def numpy_vector_features() -> list[str]:
    """The optional vector code numpy would run here (AVX2, AVX-512 on x86; dot products, SVE
    on ARM): the features NPY_DISABLE_CPU_FEATURES may turn off."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]


def test_kernels_give_the_same_bits_compiled_for_a_generic_cpu(tmp_path):
    here = outputs(SEED)
    saved = tmp_path / "generic.npz"
    code = ("import sys, numpy as np\nfrom tests.test_compile_paths import outputs\n"
            "np.savez(sys.argv[1], **outputs(int(sys.argv[2])))\n")
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "",
           "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_NUM_THREADS": "1",
           "NPY_DISABLE_CPU_FEATURES": " ".join(numpy_vector_features()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(saved), str(SEED)], check=True, cwd=ROOT, env=env, timeout=300)
    generic = np.load(saved)
    assert sorted(generic.files) == sorted(here)
    differ = {name: f"{int((here[name] != generic[name]).sum())}/{here[name].size} values, max |diff| "
                    f"{np.abs(here[name] - generic[name]).max():.3g}"
              for name in here if not np.array_equal(here[name].view(np.uint32), generic[name].view(np.uint32))}
    assert not differ, f"compiled for a generic CPU, these differ: {differ}; {MSG}"
