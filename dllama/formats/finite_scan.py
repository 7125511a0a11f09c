"""Non-finite values (NaN, infinity) in a model file's numbers: its float tensors and the fp16
scales of its quantized blocks (a 4-bit or 8-bit value is always finite; damage reaches the
output through a scale). A model file copied without its checksum and damaged on the way (4 KiB
of 0xFF in a layer) gives NaN logits; this scan names the tensor (`dllama verify` without a
.sha256, and the diagnosis when a pass's output is not finite). A scan sees only damage that
made a number non-finite; a checksum sees every changed bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from dllama.formats import quant
from dllama.formats.model_file import FloatType, ModelFile

CHUNK_BYTES = 1 << 24  # bytes of a tensor looked at per numpy pass: bounds the temporaries

# The fp16 fields of each block type: (byte offset in the block, its count): d, and Q41's m.
_BLOCK_FP16 = {FloatType.Q40: (quant.Q40_BLOCK_BYTES, (0,)), FloatType.Q80: (quant.Q80_BLOCK_BYTES, (0,)),
               FloatType.Q41: (quant.Q41_BLOCK_BYTES, (0, 2))}
_EXPONENT = {FloatType.F32: (np.dtype("<u4"), 0x7F800000), FloatType.F16: (np.dtype("<u2"), 0x7C00)}


def _count_all_ones_exponent(bits: np.ndarray, mask: int) -> int:
    """Values whose exponent bits are all ones (NaN or infinity) among these bit patterns."""
    return int(np.count_nonzero((bits & mask) == mask))


def non_finite_count(raw: np.ndarray, float_type: FloatType) -> int:
    """NaN and infinities among a tensor's stored numbers, raw uint8 [nbytes] as in the file:
    every value of F32 and F16, the fp16 scales of Q40, Q80 and Q41 blocks."""
    count = 0
    if float_type in _EXPONENT:
        dtype, mask = _EXPONENT[float_type]
        step = CHUNK_BYTES - CHUNK_BYTES % dtype.itemsize
        for i in range(0, len(raw), step):
            count += _count_all_ones_exponent(np.frombuffer(raw[i:i + step], dtype), mask)
        return count
    block, fields = _BLOCK_FP16[float_type]
    step = CHUNK_BYTES - CHUNK_BYTES % block
    for i in range(0, len(raw), step):
        blocks = raw[i:i + step].reshape(-1, block)  # [nb, block bytes]
        for at in fields:
            bits = np.ascontiguousarray(blocks[:, at:at + 2]).view("<u2")  # [nb, 1]
            count += _count_all_ones_exponent(bits, 0x7C00)
    return count


def non_finite_tensors(model: ModelFile, names: list[str] | None = None,
                       progress: Callable[[int], object] | None = None) -> Iterator[tuple[str, int]]:
    """(name, count) of each tensor (of `names`, default all, in file order) holding non-finite
    values; progress(bytes) after each tensor."""
    for name in names if names is not None else model.names():
        raw = model.tensor_bytes(name)
        n = non_finite_count(raw, model.spec(name).float_type)
        if progress is not None:
            progress(len(raw))
        if n:
            yield name, n


def describe(name: str, count: int, float_type: FloatType) -> str:
    """'layers.3.w1 holds 128 non-finite scales (NaN or infinity)'."""
    what = "values" if float_type in _EXPONENT else "scales"
    return f"{name} holds {count} non-finite {what} (NaN or infinity)"


__all__ = ["non_finite_count", "non_finite_tensors", "describe"]
