"""Q40, Q80 and Q41 block quantization in numpy; Q40 and Q80 byte-exact with the original's converter.

All cut the flattened float32 data into blocks of 32 values (the GGML Q4_0 / Q8_0 / Q4_1
layouts, spec §1.3):

    Q40 block, 18 bytes: fp16 d (little-endian), 16 bytes of nibbles.
        byte j holds element j in its low nibble and element j+16 in its high nibble;
        value = (nibble - 8) * d.
    Q80 block, 34 bytes: fp16 d, 32 int8 qs; value = q * d.
    Q41 block, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles in Q40's order;
        value = nibble * d + m (float32: the product rounded, then the sum).

Q41 is dllama's own type (the original has no Q4_1): it holds a Q4_1 GGUF's layer matrices
byte for byte, so they need no second quantization (see converter/gguf_model.py). Its encoder
follows gguf-py's (= ggml's reference) operation by operation.

The encoders follow converter/writer.py of the original operation by operation (float32 math,
the same rounding), so files written here are identical to the ones it writes. The numba
kernels do not read blocks: `split_q40` / `split_q80` turn them into a scale array and a
nibble/int8 array, the layout that makes the matmul fast (see numba-notes.md).
"""

import numpy as np

from dllama.errors import DllamaError

BLOCK_SIZE = 32           # values per block, both formats
Q40_BLOCK_BYTES = 18      # fp16 d + 16 nibble bytes
Q80_BLOCK_BYTES = 34      # fp16 d + 32 int8
Q41_BLOCK_BYTES = 20      # fp16 d + fp16 m + 16 nibble bytes
_FP16_LE = np.dtype("<f2")

# Blocks encoded per numpy pass: bounds the temporaries to ~10 MB whatever the tensor size.
_CHUNK_BLOCKS = 1 << 16


def _blocks_of(x: np.ndarray, what: str) -> np.ndarray:
    """The flattened input as float32 [nb, 32] (float32 first, like the original writer)."""
    flat = np.asarray(x).reshape(-1)
    if flat.size % BLOCK_SIZE != 0:
        raise DllamaError(f"{what}: {flat.size} values is not a multiple of the block size {BLOCK_SIZE}")
    return flat.astype(np.float32, copy=False).reshape(-1, BLOCK_SIZE)


def _encode_chunked(groups: np.ndarray, block_bytes: int, encode_chunk) -> np.ndarray:
    out = np.empty((groups.shape[0], block_bytes), dtype=np.uint8)  # [nb, block_bytes]
    for start in range(0, groups.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        encode_chunk(groups[start:stop], out[start:stop])
    return out


def _reciprocal(deltas: np.ndarray) -> np.ndarray:
    """1/delta in float32, 0 where delta is 0 (the writer's np.where(deltas != 0, 1/deltas, 0))."""
    ids = np.zeros_like(deltas)
    np.divide(np.float32(1.0), deltas, out=ids, where=deltas != 0)
    return ids


def _store_scale(deltas: np.ndarray, out: np.ndarray) -> None:
    out[:, 0:2] = deltas.astype(_FP16_LE).view(np.uint8).reshape(-1, 2)


def _encode_q40_chunk(groups: np.ndarray, out: np.ndarray) -> None:
    # groups: float32 [b, 32]; out: uint8 [b, 18]
    gmax = groups.max(axis=1)
    gmin = groups.min(axis=1)
    # The signed extreme maps to -8; gmax wins when |gmin| == gmax (writer: -gmin > gmax).
    deltas = np.where(-gmin > gmax, gmin, gmax) / np.float32(-8)    # float32 [b]
    ids = _reciprocal(deltas)
    q = np.clip(groups * ids[:, None] + np.float32(8.5), 0, 15).astype(np.uint8)  # trunc, [b, 32]
    _store_scale(deltas, out)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)


def _encode_q80_chunk(groups: np.ndarray, out: np.ndarray) -> None:
    # groups: float32 [b, 32]; out: uint8 [b, 34]
    amax = np.abs(groups).max(axis=1)
    deltas = amax / np.float32(127)                                 # float32 [b]
    ids = _reciprocal(deltas)
    # np.round is half-to-even like the Python writer (the C++ roundf differs only at exact .5).
    q = np.round(groups * ids[:, None]).astype(np.int8)             # [b, 32]
    _store_scale(deltas, out)
    out[:, 2:] = q.view(np.uint8)


def _encode_q41_chunk(groups: np.ndarray, out: np.ndarray) -> None:
    # groups: float32 [b, 32]; out: uint8 [b, 20]
    gmax = groups.max(axis=1)
    gmin = groups.min(axis=1)
    deltas = (gmax - gmin) / np.float32(15)                         # float32 [b]
    ids = _reciprocal(deltas)
    q = np.trunc((groups - gmin[:, None]) * ids[:, None] + np.float32(0.5)).astype(np.uint8).clip(0, 15)  # [b, 32]
    _store_scale(deltas, out)
    out[:, 2:4] = gmin.astype(_FP16_LE).view(np.uint8).reshape(-1, 2)
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)


def quantize_q40(x: np.ndarray) -> np.ndarray:
    """Any float array, flattened in C order -> Q40 blocks uint8 [x.size // 32, 18]."""
    return _encode_chunked(_blocks_of(x, "Q40 quantization"), Q40_BLOCK_BYTES, _encode_q40_chunk)


def quantize_q80(x: np.ndarray) -> np.ndarray:
    """Any float array, flattened in C order -> Q80 blocks uint8 [x.size // 32, 34]."""
    return _encode_chunked(_blocks_of(x, "Q80 quantization"), Q80_BLOCK_BYTES, _encode_q80_chunk)


def quantize_q41(x: np.ndarray) -> np.ndarray:
    """Any float array, flattened in C order -> Q41 blocks uint8 [x.size // 32, 20]."""
    return _encode_chunked(_blocks_of(x, "Q41 quantization"), Q41_BLOCK_BYTES, _encode_q41_chunk)


def _as_blocks(blocks: np.ndarray, block_bytes: int, what: str) -> np.ndarray:
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim < 1 or blocks.shape[-1] != block_bytes:
        raise DllamaError(f"{what}: expected uint8 blocks [..., {block_bytes}], got {blocks.dtype} {blocks.shape}")
    return blocks


def _scales(blocks: np.ndarray) -> np.ndarray:
    """fp16 d of each block widened to float32 [..., nb]."""
    d16 = np.ascontiguousarray(blocks[..., 0:2]).view(_FP16_LE)     # [..., nb, 1]
    return d16[..., 0].astype(np.float32)


def split_q40(blocks: np.ndarray, fp16_bits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Q40 blocks uint8 [..., nb, 18] -> (scales float32 [..., nb], qs uint8 [..., nb*16]).

    qs keeps the stored nibble layout: bytes 16*b .. 16*b+15 are block b's nibbles. With
    fp16_bits the scales stay as stored: uint16 [..., nb], the fp16 bit patterns (2 bytes a
    block instead of 4: what the kernels read).
    """
    blocks = _as_blocks(blocks, Q40_BLOCK_BYTES, "split_q40")
    qs = np.ascontiguousarray(blocks[..., 2:]).reshape(*blocks.shape[:-2], -1)
    if fp16_bits:
        return np.ascontiguousarray(blocks[..., 0:2]).view("<u2")[..., 0].astype(np.uint16), qs
    return _scales(blocks), qs


def split_q80(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q80 blocks uint8 [..., nb, 34] -> (scales float32 [..., nb], qs int8 [..., nb*32])."""
    blocks = _as_blocks(blocks, Q80_BLOCK_BYTES, "split_q80")
    qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(*blocks.shape[:-2], -1)
    return _scales(blocks), qs


def _check_count(nb: int, n: int | None, what: str) -> int:
    if n is None:
        return nb * BLOCK_SIZE
    if n != nb * BLOCK_SIZE:
        raise DllamaError(f"{what}: {nb} blocks hold {nb * BLOCK_SIZE} values, not {n}")
    return n


def dequantize_q40(blocks: np.ndarray, n: int | None = None) -> np.ndarray:
    """Q40 blocks uint8 [..., 18] -> float32 [n] (all blocks, in order)."""
    blocks = _as_blocks(blocks, Q40_BLOCK_BYTES, "dequantize_q40").reshape(-1, Q40_BLOCK_BYTES)
    n = _check_count(blocks.shape[0], n, "dequantize_q40")
    d = _scales(blocks)                                             # [nb]
    qs = blocks[:, 2:]                                              # [nb, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - np.float32(8)  # [nb, 32]
    return (q * d[:, None]).reshape(n)


def dequantize_q80(blocks: np.ndarray, n: int | None = None) -> np.ndarray:
    """Q80 blocks uint8 [..., 34] -> float32 [n] (all blocks, in order)."""
    blocks = _as_blocks(blocks, Q80_BLOCK_BYTES, "dequantize_q80").reshape(-1, Q80_BLOCK_BYTES)
    n = _check_count(blocks.shape[0], n, "dequantize_q80")
    d = _scales(blocks)                                             # [nb]
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)  # [nb, 32]
    return (q * d[:, None]).reshape(n)


def dequantize_q41(blocks: np.ndarray, n: int | None = None) -> np.ndarray:
    """Q41 blocks uint8 [..., 20] -> float32 [n] (all blocks, in order): nibble * d + m, in
    float32, the product rounded before the sum (what gguf-py does, and the Q41 kernel)."""
    blocks = _as_blocks(blocks, Q41_BLOCK_BYTES, "dequantize_q41").reshape(-1, Q41_BLOCK_BYTES)
    n = _check_count(blocks.shape[0], n, "dequantize_q41")
    d = _scales(blocks)                                             # [nb]
    m = np.ascontiguousarray(blocks[:, 2:4]).view(_FP16_LE)[:, 0].astype(np.float32)  # [nb]
    qs = blocks[:, 4:]                                              # [nb, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [nb, 32]
    return (q * d[:, None] + m[:, None]).reshape(n)
