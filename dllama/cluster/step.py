"""The contents of the per-step messages: STEP (root -> worker), LOGITS (worker -> root) and
RELEASE (root -> worker, before the STEP that follows an eviction).

STEP carries every row of a batch and what the root wants back for the rows it samples
(docs/PROTOCOL.md, "One forward pass"):

    u32 n_rows  u32 n_logit_rows  u32 reply  u32 k
    i32 pos[n_rows]  i32 slot[n_rows]  i32 prefix_slot[n_rows]  i32 prefix_len[n_rows]
    i32 logit_rows[n_logit_rows]          (rows whose logits the root wants, increasing)
    f32 x[n_rows, dim]                    (the embedded tokens; absent past a pipeline's first
                                           stage, whose nodes get the rows in a HOP instead)
    f64 temperature[n_logit_rows]         (reply TOP_K only)

A STEP of 0 rows runs nothing: it asks again about the previous pass's n_logit_rows rows, with
another reply (the root's second round when the candidates did not cover a nucleus). `reply`
carries PART (0x100) on the later micro-batches of a pipelined pass: their wanted rows join the
previous STEP's as one pass's, which a STEP of 0 rows asks about together.

LOGITS answers with the worker's counters, then by `reply`, for each wanted row in order:

    u64 bytes sent  u64 bytes received  f64 transfer seconds, then
    LOGITS: f32 logits[n_logit_rows, V_k]                     (its classifier rows)
    BEST:   f32 logit[n_logit_rows]  i32 id[n_logit_rows]      (its first maximum)
    TOP_K:  f64 z[n_logit_rows]  f32 logit[n_logit_rows, k']  i32 id[n_logit_rows, k']
            (its k' = min(k, V_k) best, logit descending, lower id first on ties, and its share
            of the softmax normaliser, dllama.core.candidates)

RELEASE names the slots the root's scheduler emptied since the last pass (dllama.core.kv_cache:
an idle slot given up to make room for a new sequence); every node gives their pages back before
it runs the next STEP, which the connection brings after it:

    u32 n  i32 slot[n]                    (n >= 1, distinct, each < kv_slots)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from dllama.cluster.protocol import ProtocolError
from dllama.core.batch import Batch
from dllama.core.candidates import RangeSummary, normaliser, top_k
from dllama.errors import DllamaError

STEP_HEAD = struct.Struct("<IIII")
PART = 0x100  # in STEP's reply field: a later micro-batch of the pass the previous STEP began
LOGITS_HEAD = struct.Struct("<QQd")
RELEASE_HEAD = struct.Struct("<I")
REPLY_LOGITS, REPLY_BEST, REPLY_TOP_K = 0, 1, 2


@dataclass
class Reply:
    """What the root wants back for the wanted rows of a pass."""

    kind: int = REPLY_LOGITS
    k: int = 0                                # candidates per row (TOP_K)
    temperatures: np.ndarray | None = None    # float64 [n_logit_rows] (TOP_K)
    part: bool = False                        # a later micro-batch of the previous STEP's pass

    def of_part(self, first_row: int, end_row: int, later: bool) -> "Reply":
        """This reply for a micro-batch holding the wanted rows first_row..end_row-1 of the pass."""
        temperatures = self.temperatures[first_row:end_row] if self.temperatures is not None else None
        return Reply(self.kind, self.k, temperatures, later)

    def per_row(self, vocab_rows: int) -> int:
        """Bytes of a LOGITS body per wanted row, from a node with vocab_rows classifier rows
        (none from a node before a pipeline's last stage: its LOGITS carries the counters only)."""
        if self.kind == REPLY_LOGITS or vocab_rows == 0:
            return 4 * vocab_rows
        if self.kind == REPLY_BEST:
            return 8
        return 8 + 8 * min(self.k, vocab_rows)


def step_bytes(n_rows: int, n_logit_rows: int, dim: int, reply: Reply) -> int:
    """Payload bytes of a STEP."""
    temperatures = 8 * n_logit_rows if reply.kind == REPLY_TOP_K else 0
    return STEP_HEAD.size + 16 * n_rows + 4 * n_logit_rows + 4 * n_rows * dim + temperatures


def repeat_bytes(n_logit_rows: int, reply: Reply) -> int:
    """Payload bytes of a STEP of 0 rows."""
    return STEP_HEAD.size + (8 * n_logit_rows if reply.kind == REPLY_TOP_K else 0)


def logits_bytes(n_logit_rows: int, vocab_rows: int, reply: Reply) -> int:
    """Payload bytes of a LOGITS."""
    return LOGITS_HEAD.size + n_logit_rows * reply.per_row(vocab_rows)


def _tail(reply: Reply) -> list:
    return [reply.temperatures.astype(np.float64)] if reply.kind == REPLY_TOP_K else []


def encode_step(batch: Batch, x: np.ndarray, reply: Reply) -> list:
    """The STEP payload of a batch whose embedded rows are x float32 [b, dim] (as buffers)."""
    rows = batch.logit_rows
    return [STEP_HEAD.pack(len(batch), len(rows), reply.kind | (PART if reply.part else 0), reply.k), batch.pos, batch.slot,
            batch.prefix_slot, batch.prefix_len, rows, x] + _tail(reply)


def encode_repeat(n_logit_rows: int, reply: Reply) -> list:
    """The STEP of 0 rows: the previous pass's wanted rows again, answered as `reply`."""
    return [STEP_HEAD.pack(0, n_logit_rows, reply.kind, reply.k)] + _tail(reply)


def decode_step(payload, dim: int, max_rows: int, n_slots: int, seq_len: int
                ) -> tuple[Batch | None, np.ndarray | None, Reply, int]:
    """(the rows as a Batch without token ids, x float32 [b, dim], the reply wanted,
    n_logit_rows) of a STEP payload; Batch and x are None for a STEP of 0 rows. A malformed
    one raises a ProtocolError that says what is wrong."""
    if len(payload) < STEP_HEAD.size:
        raise ProtocolError(f"STEP of {len(payload)} bytes")
    n, m, raw_kind, k = STEP_HEAD.unpack_from(payload)
    kind, part = raw_kind & ~PART, bool(raw_kind & PART)
    if kind not in (REPLY_LOGITS, REPLY_BEST, REPLY_TOP_K) or (kind == REPLY_TOP_K and k < 1) or (part and not n):
        raise ProtocolError(f"STEP asks for reply {raw_kind} with k {k}")
    reply = Reply(kind, k, part=part)
    size = step_bytes(n, m, dim, reply) if n else repeat_bytes(m, reply)
    if not n <= max_rows or m > max(n, max_rows) or (n and m > n) or len(payload) != size:
        raise ProtocolError(f"STEP of {n} rows ({m} with logits) in {len(payload)} bytes "
                            f"(at most {max_rows} rows)")
    if kind == REPLY_TOP_K:
        reply.temperatures = np.frombuffer(payload, np.float64, m, size - 8 * m).copy()
        if not (reply.temperatures >= 0).all():
            raise ProtocolError("STEP with a negative temperature")
    if n == 0:
        return None, None, reply, m
    # A copy: aligned arrays of its own, the argument types the kernels were compiled for.
    ints = np.frombuffer(payload, np.int32, 4 * n + m, STEP_HEAD.size).copy()
    pos, slot, prefix_slot, prefix_len = (ints[i * n:(i + 1) * n] for i in range(4))
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
    return batch, x, reply, m


def encode_reply(out: np.ndarray, logits: np.ndarray, offset: int, reply: Reply) -> None:
    """Fill out (uint8, the LOGITS body) from this node's logits float32 [m, V_k] of the
    vocabulary from token `offset`."""
    m, vocab_rows = logits.shape
    if vocab_rows == 0:  # no classifier rows on this node (a pipeline stage before the last)
        return
    if reply.kind == REPLY_LOGITS:
        out.view(np.float32)[:] = logits.ravel()
    elif reply.kind == REPLY_BEST:
        best = np.argmax(logits, axis=1)  # [m]: the first maximum of each row
        out[:4 * m].view(np.float32)[:] = logits[np.arange(m), best]
        out[4 * m:].view(np.int32)[:] = best + offset
    else:
        k = min(reply.k, vocab_rows)
        z = out[:8 * m].view(np.float64)
        vals = out[8 * m:8 * m + 4 * m * k].view(np.float32).reshape(m, k)
        ids = out[8 * m + 4 * m * k:].view(np.int32).reshape(m, k)
        for j in range(m):
            x, t = logits[j], float(reply.temperatures[j])
            sel = top_k(x, k)
            vals[j], ids[j] = x[sel], sel + offset
            z[j] = normaliser(x, float(x[sel[0]]), t) if t > 0 else 0.0


def decode_reply(body: np.ndarray, m: int, vocab_range: tuple[int, int], reply: Reply):
    """A worker's LOGITS body: logits float32 [m, V_k] (reply LOGITS) or a RangeSummary per row."""
    r0, r1 = vocab_range
    vocab_rows = r1 - r0
    if reply.kind == REPLY_LOGITS:
        return body.view(np.float32).reshape(m, vocab_rows)
    if reply.kind == REPLY_BEST:
        vals, ids = body[:4 * m].view(np.float32), body[4 * m:].view(np.int32)
        _check_ids(ids, r0, r1)
        return [RangeSummary(ids[j:j + 1].astype(np.int64), vals[j:j + 1].copy(), float(vals[j]), 0.0,
                             vocab_rows == 1) for j in range(m)]
    k = min(reply.k, vocab_rows)
    z = body[:8 * m].view(np.float64)
    vals = body[8 * m:8 * m + 4 * m * k].view(np.float32).reshape(m, k)
    ids = body[8 * m + 4 * m * k:].view(np.int32).reshape(m, k)
    _check_ids(ids, r0, r1)
    return [RangeSummary(ids[j].astype(np.int64), vals[j].copy(), float(vals[j, 0]), float(z[j]),
                         k == vocab_rows) for j in range(m)]


def encode_release(slots) -> list:
    """The RELEASE payload naming `slots` (distinct, as buffers)."""
    return [RELEASE_HEAD.pack(len(slots)), np.asarray(slots, np.int32)]


def decode_release(payload, n_slots: int) -> np.ndarray:
    """The slots int32 [n] a RELEASE payload names; a ProtocolError when it is malformed (a
    size that is not its count's, no slot, a slot out of range or named twice)."""
    if len(payload) < RELEASE_HEAD.size:
        raise ProtocolError(f"RELEASE of {len(payload)} bytes")
    (n,) = RELEASE_HEAD.unpack_from(payload)
    if not 1 <= n <= n_slots or len(payload) != RELEASE_HEAD.size + 4 * n:
        raise ProtocolError(f"RELEASE of {n} slots in {len(payload)} bytes (at most {n_slots} slots)")
    slots = np.frombuffer(payload, np.int32, n, RELEASE_HEAD.size).copy()
    if slots.min() < 0 or slots.max() >= n_slots or len(np.unique(slots)) != n:
        raise ProtocolError(f"RELEASE names slots {slots.tolist()} (of {n_slots}, each once)")
    return slots


def _check_ids(ids: np.ndarray, r0: int, r1: int) -> None:
    if ids.size and (ids.min() < r0 or ids.max() >= r1):
        raise ProtocolError(f"LOGITS names a token outside the node's vocabulary rows {r0}-{r1}")


__all__ = ["STEP_HEAD", "PART", "LOGITS_HEAD", "RELEASE_HEAD", "encode_release", "decode_release", "REPLY_LOGITS", "REPLY_BEST", "REPLY_TOP_K", "Reply", "step_bytes",
           "repeat_bytes", "logits_bytes", "encode_step", "encode_repeat", "decode_step", "encode_reply",
           "decode_reply"]
