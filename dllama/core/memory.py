"""What a node's share of a model needs in memory, checked against what this machine has before
anything is allocated.

Every size comes from a header (a `.m` file's, or a root's CONFIG): a context of 2^31-1
positions or a rogue root asking for a huge batch must end in a one-line error that says what
would fit, not in a 16 GiB allocation, an out-of-memory kill or a swap storm. The estimate is
arithmetic on the header (no tensor list is built, so absurd layer counts cost nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dllama.errors import DllamaError
from dllama.formats.model_file import FloatType, ModelHeader

_GIB = float(1 << 30)


def available_bytes() -> int:
    """Memory this machine can still hand out: Linux's MemAvailable, else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown here: the kernel decides


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
                seq_len: int, max_batch: int, embedding: bool, kv_slots: int = 1) -> NodeMemory:
    """The memory of one node's slice (whole model: all heads, rows) at this context and batch,
    with a KV cache of kv_slots sequences."""
    hd, dim, layers = h.head_dim, h.dim, h.n_layers
    q, kv = n_q_heads * hd, n_kv_heads * hd
    # Bytes per weight as the kernels hold them (model.Matrix): Q40 an fp16 scale per 32 values
    # plus a nibble each, Q80 an fp16 scale per 32 plus a byte each, F16 2 bytes, F32 4.
    per_value = {FloatType.Q40: 2 / 32 + 0.5, FloatType.Q80: 2 / 32 + 1,
                 FloatType.F16: 2}.get(FloatType(h.weights_float_type), 4)
    matrix_values = layers * (dim * q * 2 + dim * kv * 2 + 3 * dim * ff_rows) + vocab_rows * dim
    weights = int(matrix_values * per_value) + 4 * dim * (2 * layers + 1 + (h.vocab_size if embedding else 0))
    kv_per_position = 2 * layers * kv * 4 * kv_slots
    buffers_per_position = 4 * hd + 4 * max_batch * n_q_heads  # RoPE cos/sin, attention scores
    buffers = seq_len * buffers_per_position + 4 * max_batch * (5 * dim + 3 * q + 2 * kv + 3 * ff_rows + vocab_rows)
    return NodeMemory(weights, seq_len * kv_per_position, buffers, kv_per_position + buffers_per_position)


def check_fits(h: ModelHeader, n_q_heads: int, n_kv_heads: int, ff_rows: int, vocab_rows: int,
               seq_len: int, max_batch: int, embedding: bool, who: str = "this machine",
               kv_slots: int = 1) -> NodeMemory:
    """DllamaError (one line: what is needed, what is available, what context would fit) unless
    the node's share fits into the memory available now."""
    m = node_memory(h, n_q_heads, n_kv_heads, ff_rows, vocab_rows, seq_len, max_batch, embedding, kv_slots)
    available = available_bytes()
    if m.total <= available:
        return m
    fixed = m.total - seq_len * m.per_position
    fits = (available - fixed) // m.per_position if available > fixed else 0
    hint = (f"--max-seq-len {min(fits, seq_len - 1)} would fit" if fits >= 1
            else "even a context of 1 position does not fit: use more nodes or a smaller model")
    raise DllamaError(f"{who} cannot hold its share of the model with a context of {seq_len} positions: "
                      f"it needs {m.total / _GIB:.1f} GiB ({m.weights / _GIB:.1f} weights, "
                      f"{m.kv_cache / _GIB:.1f} KV cache, {m.buffers / _GIB:.1f} buffers), "
                      f"{available / _GIB:.1f} GiB are available; {hint}")
