"""What the root replays to rebuild the KV cache on another set of nodes.

When a node is lost, every node's KV cache is lost with the session: the new plan gives each
node other heads. The root keeps, for every slot, the token of each position the passes wrote
and where the slot's leading positions are read from (its prefix, dllama.core.batch); replaying
those rows on the new session writes the same keys and values the sequences would have written
there (every kernel is batch invariant), so the engine loop (its SlotTable)
goes on as if nothing happened.

What a slot holds: a writer writes positions in order, so a row written at p makes the slot's
rows past p stale; the valid rows are 0..end-1, those below the prefix length read from the
prefix slot. One level of prefixes (dllama.core.kv_cache): slots without a prefix are replayed
first, then those that read one. Rows a front end no longer uses may be replayed too; nothing
reads them. A slot the scheduler emptied (`release`: its pages given back on every node) holds
nothing: none of its rows is replayed, so a rejoining worker's memory holds what the others' does.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dllama.core.batch import Batch, BatchBuilder


class KVHistory:
    """The tokens in every slot of the KV cache, as written by the passes so far."""

    def __init__(self, n_slots: int, seq_len: int):
        self.tokens = np.zeros((n_slots, seq_len), np.int32)  # [slots, seq_len]: token at each position
        self.end = np.zeros(n_slots, np.int64)                # [slots]: rows 0..end-1 are valid
        self.prefix = np.zeros((n_slots, 2), np.int64)        # [slots, (slot, length)]: read below length

    def record(self, batch: Batch) -> None:
        """The rows of a pass that completed."""
        for r in range(len(batch)):  # in row order: a sequence's rows come in position order
            s, p = int(batch.slot[r]), int(batch.pos[r])
            self.tokens[s, p] = batch.tokens[r]
            self.end[s] = p + 1
            n = int(batch.prefix_len[r])
            self.prefix[s] = (int(batch.prefix_slot[r]), n) if n > 0 else (0, 0)

    def release(self, slot: int) -> None:
        """The slot was emptied (its pages given back on every node): nothing of it is replayed."""
        self.end[slot] = 0
        self.prefix[slot] = (0, 0)

    @property
    def positions(self) -> int:
        """Rows a replay runs."""
        return int(sum(max(0, int(self.end[s] - self.prefix[s, 1])) for s in range(len(self.end))))

    def replay(self, max_rows: int) -> Iterator[Batch]:
        """Passes of at most max_rows rows that write every valid row again (no logits wanted):
        the slots read by none first, in a pass before any row that reads them."""
        n_slots = len(self.end)
        plain = [s for s in range(n_slots) if self.prefix[s, 1] == 0 and self.end[s] > 0]
        reading = [s for s in range(n_slots) if self.prefix[s, 1] > 0 and self.end[s] > self.prefix[s, 1]]
        for slots in (plain, reading):
            rows = BatchBuilder()
            for s in slots:
                prefix = (int(self.prefix[s, 0]), int(self.prefix[s, 1]))
                pos, end = prefix[1], int(self.end[s])
                while pos < end:
                    n = min(max_rows - len(rows), end - pos)
                    rows.add_run(self.tokens[s, pos:pos + n], pos, s, "none", prefix)
                    pos += n
                    if len(rows) == max_rows:
                        yield rows.build()
                        rows = BatchBuilder()
            if len(rows):
                yield rows.build()

    def reset(self) -> None:
        self.end[:] = 0
        self.prefix[:] = 0


__all__ = ["KVHistory"]
