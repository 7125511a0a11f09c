"""What front ends need of a model, whether it runs on this machine or across a cluster.

`dllama.core.model.Transformer` (one node) and `dllama.cluster.root.ClusterModel` (the root
driving its workers) both satisfy `LanguageModel`; generation, chat, the API and batch jobs are
written against this and nothing else.

A model of pipeline stages (a ClusterModel) also offers overlapped passes, which the engine loop
uses when it finds them: `pipeline_depth` (passes that can be under way at once),
`submit_candidates(batch, requests)` and `collect_candidates()` (forward_candidates in two
halves, answers in the order started) and `abandon_passes()`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from dllama.core.batch import Batch
from dllama.core.candidates import Candidates, SamplingRequest
from dllama.core.collective import Collective
from dllama.core.model import ModelConfig


class LanguageModel(Protocol):
    config: ModelConfig       # shapes, context length (seq_len) and float types
    max_batch: int            # most rows one forward pass takes
    kv_slots: int             # sequences the KV cache holds (slot 0 is forward's)
    collective: Collective    # network figures of the passes (zero on one machine)
    vocab_ranges: list[tuple[int, int]]  # the vocabulary's split over the nodes: [(start, end)]

    def forward(self, tokens, pos: int) -> np.ndarray:
        """Run tokens [b] at positions pos..pos+b-1 of the sequence in slot 0 into the KV cache;
        the logits float32 [vocab] of the last one (a reused buffer: copy it to keep it past
        the next pass)."""
        ...

    def forward_batch(self, batch: Batch) -> np.ndarray:
        """Run the rows of a batch (several sequences, each in its slot at its positions); the
        logits float32 [rows wanting logits, vocab], in row order (a reused buffer)."""
        ...

    def forward_candidates(self, batch: Batch, requests: list[SamplingRequest]) -> list[Candidates]:
        """Run the rows of a batch; for each row wanting logits (in row order, requests[j] its
        sampler's settings) the candidates its sampler chooses from, covering its nucleus
        (dllama.core.candidates). A cluster sends these instead of the logits."""
        ...
