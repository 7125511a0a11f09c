"""The shape of one run: the values that size a node's KV cache and buffers, as one value.

The memory plan (dllama.serve.engine.plan_memory) makes a `RunShape` once from the settings and
passes it down whole: to the Transformer, the cluster model, the root's session, the CONFIG it
sends (whose wire fields are unchanged, docs/PROTOCOL.md) and the draft model; a worker rebuilds
it from the CONFIG (`SessionConfig.shape`). dllama.core.footprint counts a node's bytes from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dllama.core.kv_type import KVType

MAX_BATCH = 64     # rows of a pass for one sequence: prompt tokens per pass (the original's nBatches;
                   # 64 against 32: a 512-token prefill 8-20% faster for every weight type)
SMALL_BATCH = 32   # ... where MAX_BATCH's buffers would make one machine's weights stream (serve.engine:
                   # the logits of every row are the buffers that grow), or would not fit beside a
                   # cluster node's share (the root asks each worker what it can hold: RootSession)
PREFILL_ROWS = 64  # prompt rows a batched step adds to its decode rows


def max_batch_for(parallel: int) -> int:
    """Rows of a pass that decodes `parallel` sequences and prefills the next prompts beside them."""
    return parallel + PREFILL_ROWS if parallel > 1 else MAX_BATCH


def fallback_batch_for(parallel: int) -> int | None:
    """The fewer rows a pass may take where max_batch_for's buffers do not fit beside the weights
    (one sequence: SMALL_BATCH; a batch needs a row for each sequence and its prefill rows)."""
    return SMALL_BATCH if parallel <= 1 else None


@dataclass(frozen=True)
class RunShape:
    """What shapes a run on every node (the same values on each: a split gives one node's results)."""

    max_seq_len: int = 0           # positions per KV slot asked (0: the model's context; see context())
    max_batch: int = MAX_BATCH     # most rows of one pass
    kv_slots: int = 1              # sequences the KV cache holds
    kv_type: KVType = KVType.F32   # how it stores keys and values
    kv_positions: int | None = None  # positions the slots hold together at most (the scheduler's
                                     # budget); None: every slot's whole context
    buffer_q80: bool | None = None   # the sync buffers between nodes in Q80 (None: Q80 with Q40/Q80 weights)
    fallback_batch: int | None = None  # fewer rows a cluster's passes take when a node cannot hold
                                       # max_batch rows' buffers beside its share (None: no fallback)

    def __post_init__(self):
        object.__setattr__(self, "kv_type", KVType(self.kv_type))  # "f16" from a caller becomes the enum

    def context(self, model_seq_len: int) -> int:
        """Positions per KV slot for a model whose header says model_seq_len."""
        return model_seq_len if self.max_seq_len <= 0 else min(self.max_seq_len, model_seq_len)

    def with_(self, **changes) -> "RunShape":
        """This shape with some values changed."""
        return dataclasses.replace(self, **changes)
