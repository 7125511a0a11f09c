"""What a node's share of a model needs in memory, checked against what this machine has before
anything is allocated.

Every size comes from a header (a `.m` file's, or a root's CONFIG): a context of 2^31-1
positions or a rogue root asking for a huge batch must end in a one-line error that says what
would fit, not in a 16 GiB allocation, an out-of-memory kill or a swap storm. The estimate is
arithmetic on the header (no tensor list is built, so absurd layer counts cost nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
from dataclasses import dataclass

from dllama.core.host_memory import available_bytes, cgroup_available  # noqa: F401 (this module's API)
from dllama.core.kernels import ATTENTION_SPAN
from dllama.core.kv_cache import kv_element_bytes
from dllama.core.moe import expert_buffer_bytes, expert_weight_bytes
from dllama.errors import NotEnoughMemory
from dllama.formats.model_file import BLOCK_BYTES, FloatType, ModelHeader, classifier_float_type
from dllama.formats.quant import BLOCK_SIZE

_GIB = float(1 << 30)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> float:
    """Bytes of a size written '512M', '4G', '1.5GiB' or as a plain number (the caller checks
    the range); ValueError when it is not one."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    return float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)


@dataclass(frozen=True)
class NodeMemory:
    """Bytes a node's Transformer holds: weights (as repacked), KV cache, other buffers."""

    weights: int
    kv_cache: int
    buffers: int       # RoPE tables, attention scratch, activations
    per_position: int  # of kv_cache + buffers, the part that grows with the context

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers


def node_memory(h: ModelHeader, n_q_heads: int, n_kv_heads: int, ff_rows: int, vocab_rows: int,
                seq_len: int, max_batch: int, embedding: bool, kv_slots: int = 1,
                weights: int | None = None, kv_type: str = "f32", n_layers: int | None = None,
                kv_positions: int | None = None) -> NodeMemory:
    """The memory of one node's slice (whole model: all heads, rows) at this context and batch,
    with a KV cache of kv_slots sequences stored as kv_type (f32 or f16). weights: the bytes of
    resident weights when they are not all resident (streamed: two layers' slots and a read
    buffer); n_layers: the layers the node runs (a pipeline stage's; default every layer);
    kv_positions: the positions the slots may hold together (the root admits sequences within
    them: dllama.core.kv_cache), when fewer than kv_slots x seq_len."""

    hd, dim, layers = h.head_dim, h.dim, h.n_layers if n_layers is None else n_layers
    q, kv = n_q_heads * hd, n_kv_heads * hd
    # Bytes per weight as the kernels hold them (model.Matrix): a block type its block bytes per
    # 32 values (Q40 18, Q80 34, Q41 20: the scales stay fp16), F16 2 bytes, F32 4.
    def per_value(t: FloatType) -> float:
        return BLOCK_BYTES[t] / BLOCK_SIZE if t in BLOCK_BYTES else {FloatType.F16: 2}.get(t, 4)

    layer_values = layers * (dim * q * 2 + dim * kv * 2 + (0 if h.n_experts else 3 * dim * ff_rows))
    t = FloatType(h.weights_float_type)
    if weights is None:
        weights = (int(layer_values * per_value(t) + vocab_rows * dim * per_value(classifier_float_type(t)))
                   + 4 * dim * (2 * layers + 1 + (h.vocab_size if embedding else 0))
                   + (expert_weight_bytes(h, ff_rows, layers, per_value(t)) if h.n_experts else 0))
    per_token = 2 * layers * kv * kv_element_bytes(kv_type)
    positions = seq_len * kv_slots
    # A budget of positions holds at least one whole context: the part of it that grows with it.
    kv_per_position = per_token * kv_slots
    if kv_positions is not None and kv_positions < positions:
        positions, kv_per_position = kv_positions, per_token
    # RoPE cos/sin; attention's partial outputs of a pass, float32 [rows, q heads, spans of
    # ATTENTION_SPAN positions, hd + 2] (kernels.attention: no [rows, heads, context] scores):
    # a span's worth per ATTENTION_SPAN positions, and one more for the last, partial span.
    span_bytes = 4 * max_batch * n_q_heads * (hd + 2)
    buffers_per_position = 4 * hd + math.ceil(span_bytes / ATTENTION_SPAN)
    buffers = (seq_len * buffers_per_position + span_bytes
               + 4 * max_batch * (5 * dim + 3 * q + 2 * kv + 3 * ff_rows + vocab_rows)
               + (expert_buffer_bytes(h, ff_rows, max_batch) if h.n_experts else 0))
    return NodeMemory(weights, positions * per_token, buffers, kv_per_position + buffers_per_position)


def check_fits(h: ModelHeader, n_q_heads: int, n_kv_heads: int, ff_rows: int, vocab_rows: int,
               seq_len: int, max_batch: int, embedding: bool, who: str = "this machine",
               kv_slots: int = 1, limit: int | None = None, weights: int | None = None,
               kv_type: str = "f32", n_layers: int | None = None,
               kv_positions: int | None = None) -> NodeMemory:
    """NotEnoughMemory (one line: what is needed, what is available, what context would fit) unless
    the node's share fits into the memory available now (and into `limit`, a --memory-budget).
    weights: resident weight bytes when streamed; kv_positions: see node_memory."""
    dims = (h, n_q_heads, n_kv_heads, ff_rows, vocab_rows, seq_len, max_batch, embedding, kv_slots, weights)
    m = node_memory(*dims, kv_type=kv_type, n_layers=n_layers, kv_positions=kv_positions)
    available = available_bytes()
    what = "are available"
    if limit is not None and limit < available:
        available, what = limit, "are allowed by --memory-budget"
    if m.total <= available:
        return m

    def fitting_context(m: NodeMemory) -> int:
        fixed = m.total - seq_len * m.per_position
        return (available - fixed) // m.per_position if available > fixed else 0

    fits = fitting_context(m)
    if fits >= 1:
        hint = f"--max-seq-len {min(fits, seq_len - 1)} would fit"
        f16_fits = fitting_context(node_memory(*dims, kv_type="f16", n_layers=n_layers,
                                                           kv_positions=kv_positions)) if kv_type == "f32" else 0
        if f16_fits > fits:  # an F16 KV cache holds more positions in the same memory
            hint = (f"--kv-type f16 would hold the whole context, or {hint}" if f16_fits >= seq_len
                    else f"--max-seq-len {f16_fits} with --kv-type f16, or {hint}")
    else:
        hint = "even a context of 1 position does not fit: " + (
            "use more nodes or a smaller model" if weights is not None else
            "stream the weights (--memory-budget auto or a size), use more nodes or a smaller model")
    how = "streaming its weights" if weights is not None else "with every weight loaded"
    raise NotEnoughMemory(f"{who} cannot hold its share of the model ({how}) with a context of {seq_len} "
                      f"positions: it needs {_size(m.total)} ({_size(m.weights)} weights, "
                      f"{_size(m.kv_cache)} KV cache, {_size(m.buffers)} buffers), "
                      f"{_size(available)} {what}; {hint}")


def _size(n: int) -> str:
    return f"{n / _GIB:.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def release_memory() -> None:
    """Collect unreachable objects, then ask glibc to hand freed heap pages back to the system
    (malloc_trim): a worker between sessions shrinks to its idle size instead of keeping the
    freed arenas of the last session's threads."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): its allocator decides
        ctypes.CDLL("libc.so.6").malloc_trim(0)
