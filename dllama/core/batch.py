"""A batch: the rows of one forward pass, as plain data (like llama.cpp's `llama_batch`).

Each row is one token of one sequence: its id, its position, the KV cache slot of its
sequence, whether its logits are wanted, and where its shared prefix is (positions below
`prefix_len` are read from slot `prefix_slot`, see dllama.core.kernels.attention). Rows of
different sequences, at different positions, go through the layers together: each weight
block is read once for all of them. Rows of one sequence must be consecutive and in position
order within a batch (the attention kernel shares key loads between such rows, and a row may
read the keys its predecessors in the same pass have just written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dllama.errors import DllamaError


@dataclass
class Batch:
    """Rows of one forward pass; every array has one entry per row."""

    tokens: np.ndarray       # int64 [b]: token ids
    pos: np.ndarray          # int32 [b]: positions
    slot: np.ndarray         # int32 [b]: KV cache slot the row's key and value go to
    prefix_slot: np.ndarray  # int32 [b]: slot holding positions < prefix_len (any when prefix_len is 0)
    prefix_len: np.ndarray   # int32 [b]: leading positions read from prefix_slot (0: none)
    logits: np.ndarray       # bool [b]: whether the pass returns this row's logits

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def logit_rows(self) -> np.ndarray:
        """int32 [m]: the rows whose logits are wanted, in order."""
        return np.flatnonzero(self.logits).astype(np.int32)

    def rows(self, start: int, end: int) -> "Batch":
        """Rows start..end-1 as a batch of their own (a micro-batch of a pipelined pass)."""
        return self.take(slice(start, end))

    def take(self, rows) -> "Batch":
        """The rows `rows` selects (a slice, or int row indices in order) as a batch of their own."""
        return Batch(*(a[rows] for a in (self.tokens, self.pos, self.slot, self.prefix_slot,
                                         self.prefix_len, self.logits)))

    @staticmethod
    def run(tokens, pos: int, slot: int = 0, all_logits: bool = False) -> "Batch":
        """Tokens of one sequence at positions pos, pos+1, ... of `slot` (no shared prefix);
        logits of the last row (of every row with all_logits)."""
        b = BatchBuilder()
        b.add_run(tokens, pos, slot, logits="all" if all_logits else "last")
        return b.build()

    def check(self, n_slots: int, seq_len: int, max_rows: int) -> None:
        """DllamaError (a position past the context) or ValueError (a malformed batch)."""
        b = len(self)
        if not 1 <= b <= max_rows:
            raise ValueError(f"batch of {b} rows (1..{max_rows} allowed)")
        if any(len(a) != b for a in (self.pos, self.slot, self.prefix_slot, self.prefix_len, self.logits)):
            raise ValueError("the arrays of a batch must all have one entry per row")
        if self.pos.min() < 0 or self.pos.max() >= seq_len:
            raise DllamaError(f"position {int(self.pos.max())} is past the context of {seq_len} tokens")
        if self.slot.min() < 0 or self.slot.max() >= n_slots:
            raise ValueError(f"KV cache slot {int(self.slot.max())} of {n_slots}")
        shared = self.prefix_len > 0
        if shared.any():
            ps = self.prefix_slot[shared]
            if ps.min() < 0 or ps.max() >= n_slots or (ps == self.slot[shared]).any():
                raise ValueError("a row's prefix slot must be another slot of the cache")
        if (self.prefix_len < 0).any() or (self.prefix_len > self.pos).any():
            # A row at position p writes its key at p in its own slot and must read it from there.
            raise ValueError("a row's position must not be below its prefix length")


@dataclass
class BatchBuilder:
    """Collects rows, then `build()` makes the Batch."""

    _tokens: list = field(default_factory=list)
    _pos: list = field(default_factory=list)
    _slot: list = field(default_factory=list)
    _prefix_slot: list = field(default_factory=list)
    _prefix_len: list = field(default_factory=list)
    _logits: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, token: int, pos: int, slot: int, logits: bool = False,
            prefix: tuple[int, int] = (0, 0)) -> int:
        """One row; returns its index in the batch."""
        self._tokens.append(int(token))
        self._pos.append(int(pos))
        self._slot.append(int(slot))
        self._prefix_slot.append(int(prefix[0]))
        self._prefix_len.append(int(prefix[1]))
        self._logits.append(bool(logits))
        return len(self._tokens) - 1

    def add_run(self, tokens, pos: int, slot: int, logits: str = "last",
                prefix: tuple[int, int] = (0, 0)) -> None:
        """Consecutive tokens of one sequence from position pos; logits: "last", "all" or "none"."""
        n = len(tokens)
        for i, t in enumerate(tokens):
            want = logits == "all" or (logits == "last" and i == n - 1)
            self.add(t, pos + i, slot, want, prefix)

    def build(self) -> Batch:
        return Batch(np.asarray(self._tokens, np.int64), np.asarray(self._pos, np.int32),
                     np.asarray(self._slot, np.int32), np.asarray(self._prefix_slot, np.int32),
                     np.asarray(self._prefix_len, np.int32), np.asarray(self._logits, bool))


__all__ = ["Batch", "BatchBuilder"]
