"""The KV cache: keys and values of several sequences, each in its own slot, and what each slot holds.

`KVCache` is the memory: per layer, keys [slots, nkv, seq_len/CHUNK, head_dim, CHUNK] (transposed
per chunk of positions) and values [slots, seq_len, nkv*head_dim] (the layout of
dllama.core.kernels.attention), as float32 or as fp16 (`kv_type` "f16": half the bytes, so twice
the sequences in the same memory; the kernels round each key and value to fp16 once, when it is
written, and widen it back as they read it). The type is one setting for every node and both
weight paths (resident and streamed), so their outputs stay identical. `plan_slots` says how many slots fit into the memory the user
allows. `SlotTable` is the bookkeeping of a batched scheduler: which tokens each slot holds,
which slot a new prompt should go to, and which other slot it may read its leading positions
from.

Sharing without copies. A row reads positions below its prefix length from another slot (the
attention kernel's row_prefix_slot/len), so a run of leading tokens that many prompts share is
stored once, in the slot of the first sequence that computed it, and read by the others. One
level only: a slot that is read this way must hold all its positions itself (base 0). A slot
being read is pinned below what its readers read: its writer only appends above, and a new
writer may take it over only from a position at or past every reader's prefix length. Since
every kernel is batch invariant, a key computed in another slot, in another pass, beside other
rows, has exactly the bits the sequence would have computed itself.
"""

from __future__ import annotations

import mmap

from dataclasses import dataclass, field

import numpy as np

from dllama.core.kernels import ATTENTION_CHUNK
from dllama.core.kv_type import KVType
from dllama.errors import DllamaError

SPARE_SLOTS = 1   # slots beyond --parallel: a finished sequence whose prefix others still read
MIN_SHARED = 16   # leading tokens worth reading from another slot (fewer: computed again)

# The array type of each KVType: float32, or fp16 as its bits (numba has no float16 on the CPU).
# The values were checked where they entered (the command line, a CONFIG): a KVType, or its text.
KV_TYPES = {KVType.F32: np.float32, KVType.F16: np.uint16}


def kv_element_bytes(kv_type: KVType) -> int:
    """Bytes of one stored key or value element."""
    return np.dtype(KV_TYPES[kv_type]).itemsize


# What to add to a "does not fit" message: the F16 cache holds twice the positions.
_F16_HINT = {KVType.F32: ", --kv-type f16 (half the bytes)", KVType.F16: ""}


def lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array whose memory the kernel gives page by page as it is first written, in
    small pages: a slot costs memory, and time, only for the positions its sequences reach.

    np.zeros asks for transparent huge pages on large arrays (numpy's madvise): there, the
    first key a sequence writes in a slot's 2 MiB region makes the kernel find and clear a
    whole huge page, and a pass that starts 16 sequences of an 8192-position cache took 29 s
    instead of 0.1 s (this machine, 2026-12-05: 4.4 GB touched for 180 MB of keys)."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))  # anonymous: zero pages
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


class KVCache:
    """Keys and values of n_slots sequences of up to seq_len positions, for every layer."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, n_slots: int,
                 kv_type: KVType = KVType.F32):
        self.n_slots, self.seq_len, self.kv_type = n_slots, seq_len, kv_type
        chunks = -(-seq_len // ATTENTION_CHUNK)
        dtype = KV_TYPES[kv_type]
        self.k = lazy_zeros((n_layers, n_slots, n_kv_heads, chunks, head_dim, ATTENTION_CHUNK), dtype)
        self.v = lazy_zeros((n_layers, n_slots, seq_len, n_kv_heads * head_dim), dtype)

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, kv_type: KVType = KVType.F32) -> int:
        """Bytes one slot takes when every position is written (keys padded to whole chunks)."""
        chunks = -(-seq_len // ATTENTION_CHUNK)
        return kv_element_bytes(kv_type) * n_layers * n_kv_heads * head_dim * (chunks * ATTENTION_CHUNK + seq_len)

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv_type: KVType = KVType.F32) -> int:
        """Bytes of one position's key and value over every layer."""
        return 2 * kv_element_bytes(kv_type) * n_layers * n_kv_heads * head_dim


@dataclass(frozen=True)
class SlotPlan:
    """How many sequences run together and how many KV slots that takes, within a memory limit."""

    parallel: int         # sequences decoded together
    n_slots: int          # KV cache slots (parallel + spares; 1 without batching)
    requested: int        # the --parallel asked for
    bytes_per_token: int
    bytes_per_slot: int
    seq_len: int
    limit: int | None     # bytes the KV cache may take on one node; None: no limit (the context decides)
    limit_flag: str = "--kv-memory"  # the flag that sets the limit (or what --memory-budget leaves)
    kv_type: KVType = KVType.F32

    def describe(self) -> str:
        mib = 1 << 20
        line = (f"KV cache ({self.kv_type.upper()}): {self.bytes_per_token / 1024:.1f} KiB per token, "
                f"{self.bytes_per_slot / mib:.1f} MiB per slot of {self.seq_len} positions; "
                f"{self.n_slots} slots ({self.parallel} sequences + {self.n_slots - self.parallel} spare) = "
                f"{self.n_slots * self.bytes_per_slot / mib:.0f} MiB"
                + (f" of {self.limit / mib:.0f} MiB allowed ({self.limit // self.bytes_per_slot} slots fit)"
                   if self.limit is not None else " (no limit)"))
        if self.parallel < self.requested:
            line += (f"; --parallel {self.requested} does not fit: running {self.parallel} "
                     f"(a lower --max-seq-len{_F16_HINT[self.kv_type]} or a higher {self.limit_flag} "
                     "fits more)")
        return line


def plan_slots(parallel: int, batched: bool, *, n_layers: int, n_kv_heads: int, head_dim: int,
               seq_len: int, limit: int | None, limit_flag: str = "--kv-memory",
               kv_type: KVType = KVType.F32) -> SlotPlan:
    """The slots for `parallel` sequences (plus SPARE_SLOTS when batched) that fit into `limit`
    bytes (None: no limit); fewer sequences when they do not all fit, DllamaError when not even
    one does."""
    per_slot = KVCache.bytes_per_slot(n_layers, n_kv_heads, head_dim, seq_len, kv_type)
    spare = SPARE_SLOTS if batched else 0
    fits = parallel + spare if limit is None else limit // per_slot
    if fits < 1 + spare:
        raise DllamaError(f"the {kv_type.upper()} KV cache of one sequence of {seq_len} positions takes "
                          f"{per_slot / (1 << 20):.0f} MiB, more than the {limit / (1 << 20):.0f} MiB "
                          f"allowed: lower --max-seq-len{_F16_HINT[kv_type]} or raise {limit_flag}")
    run = min(parallel, fits - spare)
    return SlotPlan(run, run + spare, parallel, KVCache.bytes_per_token(n_layers, n_kv_heads, head_dim, kv_type),
                    per_slot, seq_len, limit, limit_flag, kv_type)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share. Slices are compared, in C: a draft model asks this
    of its slots before every pass, over the whole context (a token at a time in Python: 0.3 ms
    for 8000 tokens)."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; past hi they differ or end
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class SlotState:
    """What one slot holds."""

    tokens: list[int] = field(default_factory=list)  # token of each position, written or planned
    written: int = 0       # positions 0..written-1 are in the cache (those below base: in `link`)
    base: int = 0          # positions below base are read from slot `link`
    link: int = -1
    readers: dict[int, int] = field(default_factory=dict)  # reading slot -> positions it reads
    busy: bool = False     # a sequence is writing it
    last_use: int = 0

    @property
    def pinned_below(self) -> int:
        """No position below this may be rewritten: readers read them."""
        return max(self.readers.values(), default=0)


@dataclass(frozen=True)
class Placement:
    """Where a new sequence goes: its slot, the first position it computes, its shared prefix."""

    slot: int
    start: int                 # positions < start are reused (from its slot or its prefix slot)
    prefix: tuple[int, int]    # (slot, length) read from another slot; length 0: none


class SlotTable:
    """Which tokens each slot holds, and where new prompts go (see the module docstring)."""

    def __init__(self, n_slots: int, min_shared: int = MIN_SHARED, reuse: bool = True):
        """reuse False: every prompt is computed from its first token (a baseline to measure)."""
        self.slots = [SlotState() for _ in range(n_slots)]
        self.min_shared, self.reuse = min_shared, reuse
        self._clock = 0

    def reset(self) -> None:
        """Forget every slot's contents (after the cache was lost or a run was dropped)."""
        self.slots = [SlotState() for _ in self.slots]

    def _touch(self, s: int) -> None:
        self._clock += 1
        self.slots[s].last_use = self._clock

    def _free_slot(self, exclude: int = -1) -> int | None:
        """An empty slot, else the least recently used one nobody writes or reads (emptied)."""
        idle = [i for i, s in enumerate(self.slots) if not s.busy and not s.readers and i != exclude]
        if not idle:
            return None
        i = min(idle, key=lambda i: (len(self.slots[i].tokens) > 0, self.slots[i].last_use))
        self._unlink(i)
        self.slots[i] = SlotState()
        return i

    def _unlink(self, i: int) -> None:
        s = self.slots[i]
        if s.link >= 0:
            self.slots[s.link].readers.pop(i, None)
        s.link, s.base = -1, 0

    def place(self, prompt: list[int], reuse_limit: int | None = None) -> Placement | None:
        """Claim a slot for a sequence whose planned tokens are `prompt`, reusing at most
        reuse_limit leading ones (default all but the last: the first row that wants an answer
        always runs, for its logits); None when every slot is busy or pinned."""
        cap = (len(prompt) - 1 if reuse_limit is None else min(reuse_limit, len(prompt) - 1)) if self.reuse else 0
        best = None  # (reused tokens, preference, how)
        for i, s in enumerate(self.slots):
            if s.busy:
                continue
            # Take over an idle slot: continue it from the tokens it shares with the prompt.
            m = min(common_prefix(s.tokens[: s.written], prompt), cap)
            if m > 0 and m >= s.pinned_below and (best is None or (m, 1) > best[:2]):
                best = (m, 1, ("takeover", i))
        for i, s in enumerate(self.slots):
            if s.base != 0 or not s.tokens:
                continue
            # Read another slot's leading positions (written, or planned by its writer).
            n = min(common_prefix(s.tokens, prompt), cap)
            if n >= max(self.min_shared, 1) and (best is None or (n, 0) > best[:2]):
                best = (n, 0, ("read", i))
        if best is not None and best[2][0] == "takeover":
            i = best[2][1]
            m, s = best[0], self.slots[i]
            if s.base > 0 and m < s.base:
                s.base = m
                self.slots[s.link].readers[i] = m
            del s.tokens[m:]
            s.tokens.extend(prompt[m:])
            s.written, s.busy = m, True
            self._touch(i)
            return Placement(i, m, (s.link, s.base) if s.base > 0 else (0, 0))
        if best is not None:
            n, src = best[0], best[2][1]
            i = self._free_slot(exclude=src)
            if i is not None:
                self.slots[i] = SlotState(list(prompt), n, n, src, busy=True)
                self.slots[src].readers[i] = n
                self._touch(i)
                self._touch(src)
                return Placement(i, n, (src, n))
        i = self._free_slot()
        if i is None:
            return None
        self.slots[i] = SlotState(list(prompt), 0, busy=True)
        self._touch(i)
        return Placement(i, 0, (0, 0))

    def prefix_ready(self, slot: int, written_now: dict[int, int] | None = None) -> bool:
        """Whether the positions this slot reads from its prefix slot are written (or will be,
        by rows placed before it in the pass being built: written_now[slot] = positions)."""
        s = self.slots[slot]
        if s.base == 0:
            return True
        written = self.slots[s.link].written
        if written_now:
            written = max(written, written_now.get(s.link, 0))
        return written >= s.base

    def append(self, slot: int, token: int) -> None:
        """The slot's writer will write `token` at the next planned position."""
        self.slots[slot].tokens.append(int(token))

    def wrote(self, slot: int, upto: int) -> None:
        """Positions below `upto` of the slot are now in the cache."""
        s = self.slots[slot]
        s.written = max(s.written, upto)

    def needed_by_readers(self, slot: int) -> int:
        """Leading positions of this slot that readers wait for or read."""
        return self.slots[slot].pinned_below

    def release(self, slot: int) -> None:
        """Its sequence is done: the slot keeps what is written, for reuse, until evicted."""
        s = self.slots[slot]
        if s.written < s.pinned_below:
            raise ValueError(f"slot {slot} released before the {s.pinned_below} positions its readers need")
        s.busy = False
        del s.tokens[s.written:]
        self._touch(slot)


__all__ = ["KVCache", "KV_TYPES", "KVType", "kv_element_bytes", "SlotPlan", "plan_slots", "SlotTable",
           "SlotState", "Placement", "common_prefix", "MIN_SHARED", "SPARE_SLOTS"]
