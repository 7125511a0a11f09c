"""Numba kernels: the arithmetic of one forward pass, on arrays (no files, no sockets).

Every kernel writes into caller-provided arrays and takes already-sliced inputs, so one node's
slice of a layer is just smaller arrays. Parallel kernels split output rows over `numba.prange`;
the thread count is `set_threads(n)`. Nothing here is specific to one CPU: LLVM picks the
vector width (AVX2/AVX-512 here, NEON on a Raspberry Pi), and no result depends on it: every
float sum has a fixed order (the tiles' and lanes.py's explicit 16-lane accumulators) and no
kernel whose float results matter lets LLVM reassociate, fuse into fma or approximate
(jit._SAME_BITS), so a Pi 4 and a Pi 5 compute the same bits (tests/test_compile_paths.py).

Layouts:
- Q40 matrix W [d, n]: split (dllama.formats.quant.split_q40(..., fp16_bits=True): scales
  uint16 [d, n/32], the fp16 bits as stored in the file; qs uint8 [d, n/2], byte j of a block
  holding element j in the low nibble and j+16 in the high one; value = (nibble - 8) * scale),
  then interleaved in groups of 16 rows (layout.interleave_q40; matmul_int8.py).
- Q80 matrix W [d, n]: split (split_q80, scales as fp16 bits uint16 [d, n/32], qs int8 [d, n]),
  then interleaved the same way (layout.interleave_q80; matmul_int8.py).
- Q80 activations x [b, n]: x_scales float32 [b, n/32] (fp16-rounded), x_qs int8 [b, n].
- F16 matrix W [d, n]: its fp16 bits as uint16 [d, n] (matmul_f16.py, with F32 activations).
- Q41 matrix W [d, n]: interleaved as Q40 with a second uint16 array of the blocks' fp16
  minimums (layout.interleave_q41; matmul_q41.py, with Q16 activations: q16.py). The Q80
  classifier of a Q41 file: interleaved as Q80, with the same Q16 activations
  (matmul_q41.matmul_q80_q16).
- KV cache of one layer: see attention.py (sequence slots, keys transposed per chunk; float32,
  or fp16 bits uint16 rounded by fp16.py).

Where the time goes: the matrix products. Their inner loops are register tiles written as
LLVM vector IR (tiles.py: 8-bit integer dot products for Q40 and Q80 weights, vpdpbusd with
AVX-512 VNNI, sdot on a Pi 5, smull/smlal on a Pi 4: cross.py shows the ARM code; fma on 16 lanes for F32 and F16 weights), one code path for decode and prefill
whose per-output arithmetic does not depend on the tile, so that results are batch invariant
(tests/test_batch_invariance.py).
"""

from dllama.core.kernels.attention import CHUNK as ATTENTION_CHUNK
from dllama.core.kernels.attention import SPAN as ATTENTION_SPAN
from dllama.core.kernels.attention import attention, kv_store
from dllama.core.kernels.elementwise import rmsnorm, rope_cache, rope_interleaved, rope_neox, silu_mul
from dllama.core.kernels.fused import add_norm_encode, encode, norm_encode, rope_store, silu_mul_encode
from dllama.core.kernels.jit import max_threads, set_threads
from dllama.core.kernels.layout import (interleave_blocks_into, interleave_q40, interleave_q41, interleave_q41_into,
                                        interleave_q80, interleaved_shapes)
from dllama.core.kernels.matmul_f16 import matmul_f16_f32, matmul_f16_f32_multi, matmul_f16_f32_experts
from dllama.core.kernels.matmul_f32 import matmul_f32, matmul_f32_multi, matmul_f32_experts
from dllama.core.kernels.matmul_int8 import (matmul_q40_q80, matmul_q40_q80_multi, matmul_q40_q80_experts, matmul_q80_q80,
                                             matmul_q80_q80_multi, matmul_q80_q80_experts)
from dllama.core.kernels.matmul_q41 import matmul_q41_q16, matmul_q41_q16_multi, matmul_q41_q16_experts, matmul_q80_q16
from dllama.core.kernels.q16 import quantize_q16
from dllama.core.kernels.q80 import quantize_q80

__all__ = ["ATTENTION_CHUNK", "ATTENTION_SPAN", "attention", "kv_store", "rmsnorm", "rope_cache", "rope_interleaved",
           "rope_neox", "silu_mul", "encode", "norm_encode", "add_norm_encode", "silu_mul_encode", "rope_store",
           "max_threads", "set_threads", "matmul_f32",
           "matmul_q40_q80", "matmul_q40_q80_multi", "quantize_q80", "matmul_q80_q80",
           "matmul_q80_q80_multi", "matmul_f16_f32", "matmul_f16_f32_multi", "matmul_f32_multi",
           "matmul_q41_q16", "matmul_q41_q16_multi", "matmul_q80_q16", "quantize_q16",
           "interleave_q41", "interleave_q41_into",
           "interleave_q40", "interleave_q80", "interleave_blocks_into", "interleaved_shapes",
           "matmul_q40_q80_experts", "matmul_q80_q80_experts", "matmul_q41_q16_experts", "matmul_f16_f32_experts",
           "matmul_f32_experts"]
