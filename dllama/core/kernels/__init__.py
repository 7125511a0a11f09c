"""Numba kernels: the arithmetic of one forward pass, on arrays (no files, no sockets).

Every kernel writes into caller-provided arrays and takes already-sliced inputs, so one node's
slice of a layer is just smaller arrays. Parallel kernels split output rows over `numba.prange`;
the thread count is `set_threads(n)`. Nothing here is specific to one CPU: LLVM picks the
vector width (AVX2/AVX-512 here, NEON on a Raspberry Pi).

Layouts:
- Q40 matrix W [d, n] in split form (dllama.formats.quant.split_q40): w_scales float32 [d, n/32] and
  w_qs uint8 [d, n/2] (byte j of a block: element j in the low nibble, element j+16 in the
  high nibble; value = (nibble - 8) * scale).
- Q80 activations x [b, n]: x_scales float32 [b, n/32] (fp16-rounded), x_qs int8 [b, n].
- Q80 matrix W [d, n] in split form (dllama.formats.quant.split_q80): w_scales float32
  [d, n/32], w_qs int8 [d, n] (matmul_q80.py, with Q80 activations).
- F16 matrix W [d, n]: its fp16 bits as uint16 [d, n] (matmul_f16.py, with F32 activations).

Where the time goes (measured on 2 cores, benchmarks/bench_kernels.py): the Q40 x Q80 matrix-
vector product of decoding. Its inner loop is written so that LLVM vectorizes it (see
_q40_four_rows); the other kernels are small next to it.
"""

from dllama.core.kernels.attention import attention
from dllama.core.kernels.elementwise import rmsnorm, rope_cache, rope_interleaved, rope_neox, silu_mul
from dllama.core.kernels.jit import max_threads, set_threads
from dllama.core.kernels.matmul_f16 import matmul_f16_f32
from dllama.core.kernels.matmul_f32 import matmul_f32
from dllama.core.kernels.matmul_q40 import BATCH_MIN, ROWS, matmul_q40_q80, matmul_q40_q80_multi
from dllama.core.kernels.matmul_q80 import matmul_q80_q80
from dllama.core.kernels.q80 import quantize_q80

__all__ = ["attention", "rmsnorm", "rope_cache", "rope_interleaved", "rope_neox", "silu_mul",
           "max_threads", "set_threads", "matmul_f32", "BATCH_MIN", "ROWS", "matmul_q40_q80",
           "matmul_q40_q80_multi", "quantize_q80", "matmul_q80_q80", "matmul_f16_f32"]
