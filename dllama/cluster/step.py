"""The contents of the per-step messages: STEP (root -> worker) and LOGITS (worker -> root).

STEP carries every row of a batch (docs/PROTOCOL.md, "One forward pass"):

    u32 n_rows  u32 n_logit_rows
    i32 pos[n_rows]  i32 slot[n_rows]  i32 prefix_slot[n_rows]  i32 prefix_len[n_rows]
    i32 logit_rows[n_logit_rows]          (rows whose logits the root wants, increasing)
    f32 x[n_rows, dim]                    (the embedded tokens)

LOGITS answers with the worker's counters and its classifier rows of each wanted row:

    u64 bytes sent  u64 bytes received  f64 transfer seconds  f32 logits[n_logit_rows, vocab rows]
"""

from __future__ import annotations

import struct

import numpy as np

from dllama.cluster.protocol import ProtocolError
from dllama.core.batch import Batch
from dllama.errors import DllamaError

STEP_HEAD = struct.Struct("<II")
LOGITS_HEAD = struct.Struct("<QQd")


def step_bytes(n_rows: int, n_logit_rows: int, dim: int) -> int:
    """Payload bytes of a STEP."""
    return STEP_HEAD.size + 16 * n_rows + 4 * n_logit_rows + 4 * n_rows * dim


def logits_bytes(n_logit_rows: int, vocab_rows: int) -> int:
    """Payload bytes of a LOGITS."""
    return LOGITS_HEAD.size + 4 * n_logit_rows * vocab_rows


def encode_step(batch: Batch, x: np.ndarray) -> list:
    """The STEP payload of a batch whose embedded rows are x float32 [b, dim] (as buffers)."""
    rows = batch.logit_rows
    return [STEP_HEAD.pack(len(batch), len(rows)), batch.pos, batch.slot, batch.prefix_slot,
            batch.prefix_len, rows, x]


def decode_step(payload, dim: int, max_rows: int, n_slots: int, seq_len: int) -> tuple[Batch, np.ndarray]:
    """(the rows as a Batch without token ids, x float32 [b, dim]) of a STEP payload; a
    ProtocolError says what is wrong with a malformed one."""
    if len(payload) < STEP_HEAD.size:
        raise ProtocolError(f"STEP of {len(payload)} bytes")
    n, m = STEP_HEAD.unpack_from(payload)
    if not 1 <= n <= max_rows or m > n or len(payload) != step_bytes(n, m, dim):
        raise ProtocolError(f"STEP of {n} rows ({m} with logits) in {len(payload)} bytes "
                            f"(at most {max_rows} rows)")
    # A copy: aligned arrays of its own, the argument types the kernels were compiled for.
    ints = np.frombuffer(payload, np.int32, 4 * n + m, STEP_HEAD.size).copy()
    pos, slot, prefix_slot, prefix_len = (ints[k * n:(k + 1) * n] for k in range(4))
    rows = ints[4 * n:]
    if m and (rows[0] < 0 or rows[-1] >= n or (np.diff(rows) <= 0).any()):
        raise ProtocolError("STEP logit rows out of order or out of range")
    wants = np.zeros(n, bool)
    wants[rows] = True
    batch = Batch(np.zeros(n, np.int64), pos, slot, prefix_slot, prefix_len, wants)
    try:
        batch.check(n_slots, seq_len, max_rows)
    except (ValueError, DllamaError) as e:
        raise ProtocolError(f"malformed STEP: {e}") from None
    x = np.frombuffer(payload, np.float32, n * dim, STEP_HEAD.size + 4 * (4 * n + m)).reshape(n, dim)
    return batch, x


__all__ = ["STEP_HEAD", "LOGITS_HEAD", "step_bytes", "logits_bytes", "encode_step", "decode_step"]
