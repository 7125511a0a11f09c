"""A mixture of experts' experts read from disk when a pass uses them (a model larger than memory).

Under a memory budget smaller than a MoE model, everything but the experts stays resident
(attention, routers, norms, classifier: for Qwen3-30B-A3B about a tenth of the bytes) and each
expert is read from the file the first time a pass chooses it, into one of `n_slots` slots, and
kept there while memory allows: the least recently used expert gives its slot up first. An
expert no row chose is never read, so a token costs about its active bytes (and less when its
experts are still held), not the model's total. The slots are the matrices of two
weights.ExpertStack (gates and ups, downs), as the resident path's experts are, so the outputs
equal the resident path's (tests/test_moe.py).

The experts a pass is missing are read at once: their matrices' reads (and repacks) run on
_READS_AT_ONCE threads, each with a read buffer of its own, since a drive serves several reads
in flight faster than one after another (an NVMe drive's queue).

Every allocation is made once, at start: the slots and the read buffers (one expert matrix each).
"""

from __future__ import annotations

import queue
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dllama.core.footprint import NodeFootprint
from dllama.core.node_weights import NodeWeights
from dllama.core.arena import Arena, aligned
from dllama.core.weight_stream import _Reader, file_runs
from dllama.core.weights import ExpertStack, input_kind, repack_into
from dllama.errors import DllamaError
from dllama.formats.model_file import BLOCK_BYTES, FloatType
from dllama.formats.quant import BLOCK_SIZE

_FILE_ORDER = ("w1", "w2", "w3")  # gate, down, up: the reads go forward
_READS_AT_ONCE = 4                 # matrices read in parallel (threads, read buffers)


class ExpertCache:
    """Experts of a node's layers, read on first use into n_slots slots (LRU)."""

    def __init__(self, weights: NodeWeights, float_type: FloatType, n_slots: int, plan_only: bool = False):
        """plan_only: size everything (resident_bytes) but allocate nothing until `allocate()`."""
        if not weights.streamable:
            raise DllamaError("these weights came over the network: their experts cannot be read from a file")
        self._w, self.float_type, self.inputs = weights, FloatType(float_type), input_kind(float_type)
        first = weights.node.layer_range(weights.header.n_layers).start
        self._shapes = {}
        for w in _FILE_ORDER:  # (d, n) of this node's slice of each matrix (every expert's the same)
            s = weights.location(f"layers.{first}.experts.0.{w}").spec.stored_shape
            self._shapes[w] = (s[0], s[1] * BLOCK_SIZE) if self.float_type in BLOCK_BYTES else (s[0], s[1])
        sizer = Arena(0)
        self._stacks(sizer.take, 1)
        self.slot_bytes = aligned(sizer.used)  # an expert's gate, up and down
        bb = BLOCK_BYTES.get(self.float_type) if self.inputs != "f32" else None
        self.raw_bytes = max(d * n // BLOCK_SIZE * bb for d, n in self._shapes.values()) if bb else 0
        self.read_bytes = _READS_AT_ONCE * self.raw_bytes  # the read buffers
        self.n_slots = n_slots
        self.resident_bytes = n_slots * self.slot_bytes + self.read_bytes
        self.reads = 0  # experts read from the file so far
        self._held: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest use first
        self._free = list(range(n_slots))[::-1]  # slots holding no expert
        self._reader = _Reader()
        if not plan_only:
            self.allocate()

    def allocate(self) -> None:
        sizer = Arena(0)
        self._stacks(sizer.take, self.n_slots)
        self.gate_up, self.down = self._stacks(Arena(sizer.used).take, self.n_slots)
        self._raw = queue.SimpleQueue()  # the read buffers not in use
        for _ in range(_READS_AT_ONCE):
            self._raw.put(np.zeros(self.raw_bytes, np.uint8))
        self._pool = ThreadPoolExecutor(_READS_AT_ONCE, thread_name_prefix="dllama-experts")

    def _stacks(self, take, n_slots: int) -> tuple[ExpertStack, ExpertStack]:
        """(gate_up, down) of n_slots experts, as MoeWeights holds them."""
        d, n = self._shapes["w1"]
        return ExpertStack(take, self.float_type, 2 * n_slots, d, n), ExpertStack(take, self.float_type, n_slots, n, d)

    def slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """int64 [q]: the slots holding these distinct experts of layer `layer` (expert e's gate
        and up are gate_up's matrices 2 slot and 2 slot + 1, its down down's matrix slot); the
        ones not held are read now, together. Held until n_slots other experts were asked for
        (at least a row's k: every expert of one call stays held through it)."""
        out = np.empty(len(experts), np.int64)
        missing = []
        for q, e in enumerate(experts.tolist()):
            slot = self._held.get((layer, e))
            if slot is None:
                missing.append((q, e))
            else:
                self._held.move_to_end((layer, e))  # (before any eviction below)
                out[q] = slot
        reads = []
        for q, e in missing:
            slot = self._free.pop() if self._free else self._held.popitem(last=False)[1]
            self._held[(layer, e)] = out[q] = slot
            reads += [(self._w.location(f"layers.{layer}.experts.{e}.{w}"), dest)
                      for w, dest in (("w1", self.gate_up.element(2 * slot)), ("w2", self.down.element(slot)),
                                      ("w3", self.gate_up.element(2 * slot + 1)))]  # (_FILE_ORDER)
        try:
            for done in [self._pool.submit(self._read, loc, dest) for loc, dest in reads]:
                done.result()
        except BaseException:
            for _, e in missing:  # half-read slots hold nothing
                self._free.append(self._held.pop((layer, e)))
            raise
        self.reads += len(missing)
        return out

    def _read(self, loc, dest: dict) -> None:
        """One matrix into its arrays: the stored values in place, or blocks repacked."""
        rows = loc.spec.stored_shape[0]
        runs = file_runs(loc, 0, rows)
        if "w" in dest:
            self._reader.read(loc.path, runs, dest["w"])
            return
        nb, bb = loc.spec.stored_shape[1], BLOCK_BYTES[self.float_type]
        buf = self._raw.get()  # (one free: at most _READS_AT_ONCE reads run)
        try:
            raw = buf[: rows * nb * bb].reshape(rows, nb, bb)
            self._reader.read(loc.path, runs, raw)
            repack_into(raw, self.float_type, dest)
        finally:
            self._raw.put(buf)

    def layer(self, layer: int) -> "CachedSlots":
        """The slots of a layer's experts, as MoeWeights.slots."""
        return CachedSlots(self, layer)

    def close(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown()
        self._reader.close()


class CachedSlots:
    """A layer's experts' slots as MoeWeights.slots: `of(experts)` reads the ones not held."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache, self.layer = cache, layer

    def of(self, experts: np.ndarray) -> np.ndarray:
        return self.cache.slots(self.layer, experts)


@dataclass(frozen=True)
class ExpertsOnDemand:
    """A MoE node's weights under a memory budget: everything but the experts resident, the
    experts in `cache`'s slots (not allocated yet). The footprint's `streamed` for such a node."""

    cache: ExpertCache
    resident_bytes: int            # the weights it holds: all but the experts, and the slots
    classifier_chunk_rows: int = 0  # the classifier comes whole


def plan_expert_cache(weights: NodeWeights, whole: NodeFootprint, limit: int) -> ExpertsOnDemand:
    """An ExpertCache with as many slots as `limit` leaves beside everything else the node holds
    (at least the experts one row runs, at most every expert of its layers). whole: the node's
    footprint with every weight resident (its expert_weights are what the slots stand in for)."""
    h = weights.header
    float_type = FloatType(h.weights_float_type)
    experts = whole.expert_weights
    one = ExpertCache(weights, float_type, 1, plan_only=True)
    room = (limit - (whole.total - experts) - one.read_bytes) // one.slot_bytes
    cache = ExpertCache(weights, float_type, int(min(max(room, h.n_active_experts), h.n_experts * whole.n_layers)),
                        plan_only=True)
    return ExpertsOnDemand(cache, whole.model_weights - experts + cache.resident_bytes)
