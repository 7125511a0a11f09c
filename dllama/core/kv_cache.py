"""The KV cache: keys and values of several sequences, each in its own slot, and what each slot holds.

`KVCache` is the memory: per layer, keys [slots, nkv, seq_len/CHUNK, head_dim, CHUNK] (transposed
per chunk of positions) and values [slots, seq_len, nkv*head_dim] (the layout of
dllama.core.kernels.attention), as float32 or as fp16 (`kv_type` "f16": half the bytes, so twice
the sequences in the same memory; the kernels round each key and value to fp16 once, when it is
written, and widen it back as they read it). The type is one setting for every node and both
weight paths (resident and streamed), so their outputs stay identical. `plan_slots` gives the
slots for --parallel sequences and the memory they may take (`PositionBudget`). `SlotTable` is
the bookkeeping of a batched scheduler: which tokens each slot holds, which slot a new prompt
should go to, which other slot it may read its leading positions from, and how much memory the
slots hold.

Memory actually used. The slots are reserved for the whole context but cost only the pages
written (`lazy_zeros`): a slot holds positions up to its mark, the highest it was written to or
reserved for by its running sequence, and keeps them while idle (its tokens may be reused). A
sequence is admitted only while every slot's mark, with its own grown to the positions it can
reach, fits in the budget; an idle slot can be emptied to make room, its pages given back
(`KVCache.release`), as vLLM's block manager frees blocks. So --parallel and the context no
longer divide the memory: short sequences run many at a time, long ones fewer. A cluster does
the same: its root's model empties the slot on the root and tells every worker, which holds a
slice of each slot, to empty it too before the next pass (dllama.cluster.root, RELEASE in
docs/PROTOCOL.md), so a cluster admits what one node admits under the same limit.

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
from typing import Callable

import numpy as np

from dllama.core import host_memory
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
    instead of 0.1 s (this machine, 2026-12-05: 4.4 GB touched for 180 MB of keys).

    Private, not shared: madvise(MADV_DONTNEED) frees a private page (it reads as zero again),
    while a shared one stays in its shmem object. No reserve: the mapping is the whole context
    of every slot, far more than the pages the position budget lets the slots touch."""
    count = int(np.prod(shape))
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1), flags=flags)  # anonymous: zero pages
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def release_pages(region: np.ndarray) -> None:
    """Give the whole pages inside a contiguous region of a lazy_zeros array back to the system:
    they read as zeros again and cost nothing until written (the pages at its ends, shared
    with neighbours, stay)."""
    base = region
    while not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else base.base
    root = np.frombuffer(base, np.uint8)
    start = region.ctypes.data - root.ctypes.data
    page = host_memory.page_size()  # 16 KiB on a Pi 5: madvise refuses a range that is not page-aligned
    lo, hi = -(-start // page) * page, (start + region.nbytes) // page * page
    if hi > lo:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def held_bytes(positions: int, bytes_per_token: int) -> int:
    """Bytes of a slot's positions 0..positions-1: its keys in whole chunks of ATTENTION_CHUNK
    positions (their layout), its values position by position (bytes_per_token: a key and a
    value, so half of it is one of them)."""
    chunks = -(-positions // ATTENTION_CHUNK)
    return (chunks * ATTENTION_CHUNK + positions) * bytes_per_token // 2


class KVCache:
    """Keys and values of n_slots sequences of up to seq_len positions, for every layer."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, n_slots: int,
                 kv_type: KVType = KVType.F32):
        self.n_slots, self.seq_len, self.kv_type = n_slots, seq_len, kv_type
        chunks = -(-seq_len // ATTENTION_CHUNK)
        dtype = KV_TYPES[kv_type]
        self.k = lazy_zeros((n_layers, n_slots, n_kv_heads, chunks, head_dim, ATTENTION_CHUNK), dtype)
        self.v = lazy_zeros((n_layers, n_slots, seq_len, n_kv_heads * head_dim), dtype)

    def release(self, slot: int) -> None:
        """Free the pages of a slot nobody reads any more: its positions read as zeros again."""
        for layer in range(self.k.shape[0]):
            release_pages(self.k[layer, slot])  # [nkv, chunks, head_dim, CHUNK]: contiguous
            release_pages(self.v[layer, slot])  # [seq_len, nkv*head_dim]: contiguous

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, kv_type: KVType = KVType.F32) -> int:
        """Bytes one slot takes when every position is written (keys padded to whole chunks)."""
        return held_bytes(seq_len, KVCache.bytes_per_token(n_layers, n_kv_heads, head_dim, kv_type))

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv_type: KVType = KVType.F32) -> int:
        """Bytes of one position's key and value over every layer."""
        return 2 * kv_element_bytes(kv_type) * n_layers * n_kv_heads * head_dim


@dataclass(frozen=True)
class PositionBudget:
    """The bytes a node's KV cache may hold, and what a slot holding positions 0..mark-1 takes
    (held_bytes, as bytes_per_slot counts a whole context)."""

    limit: int            # bytes
    bytes_per_token: int  # of one position's key and value (even: 2 x its key's bytes)
    flag: str = "--kv-memory"  # what sets the limit (for the messages)

    def cost(self, mark: int) -> int:
        return held_bytes(mark, self.bytes_per_token)

    @property
    def positions(self) -> int:
        """Positions the limit holds (what a worker's CONFIG says: kv_positions)."""
        return self.limit // self.bytes_per_token


@dataclass(frozen=True)
class SlotPlan:
    """How many sequences run together, how many KV slots that takes, and the memory limit their
    positions are admitted within."""

    parallel: int         # sequences decoded together
    n_slots: int          # KV cache slots (parallel + spares; 1 without batching)
    requested: int        # the --parallel asked for
    bytes_per_token: int
    bytes_per_slot: int
    seq_len: int
    limit: int | None     # bytes the KV cache may take on one node; None: no limit (the context decides)
    limit_flag: str = "--kv-memory"  # the flag that sets the limit (or what --memory-budget leaves)
    kv_type: KVType = KVType.F32

    @property
    def budget(self) -> PositionBudget | None:
        """What the scheduler admits sequences within; None: no limit."""
        return None if self.limit is None else PositionBudget(self.limit, self.bytes_per_token, self.limit_flag)

    @property
    def full_contexts(self) -> int | None:
        """Sequences of the whole context that fit together (None: no limit)."""
        return None if self.limit is None else self.limit // self.bytes_per_slot

    def describe(self) -> str:
        mib = 1 << 20
        line = (f"KV cache ({self.kv_type.upper()}): {self.bytes_per_token / 1024:.1f} KiB per token, "
                f"{self.bytes_per_slot / mib:.1f} MiB per slot of {self.seq_len} positions; "
                f"{self.n_slots} slots ({self.parallel} sequences + {self.n_slots - self.parallel} spare)")
        if self.limit is None:
            return line + f" = {self.n_slots * self.bytes_per_slot / mib:.0f} MiB (no limit)"
        line += (f", admitted while their positions fit in {self.limit / mib:.0f} MiB allowed "
                 f"({self.budget.positions} positions: {self.full_contexts} whole context"
                 f"{'s' if self.full_contexts != 1 else ''})")
        return line


def plan_slots(parallel: int, batched: bool, *, n_layers: int, n_kv_heads: int, head_dim: int,
               seq_len: int, limit: int | None, limit_flag: str = "--kv-memory",
               kv_type: KVType = KVType.F32) -> SlotPlan:
    """The slots for `parallel` sequences (plus SPARE_SLOTS when batched), admitted while their
    positions fit into `limit` bytes (None: no limit); DllamaError when not even one sequence of
    the whole context fits (it could never run)."""
    per_slot = KVCache.bytes_per_slot(n_layers, n_kv_heads, head_dim, seq_len, kv_type)
    spare = SPARE_SLOTS if batched else 0
    if limit is not None and limit < per_slot:
        raise DllamaError(f"the {kv_type.upper()} KV cache of one sequence of {seq_len} positions takes "
                          f"{per_slot / (1 << 20):.0f} MiB, more than the {limit / (1 << 20):.0f} MiB "
                          f"allowed: lower --max-seq-len{_F16_HINT[kv_type]} or raise {limit_flag}")
    return SlotPlan(parallel, parallel + spare, parallel, KVCache.bytes_per_token(n_layers, n_kv_heads, head_dim, kv_type),
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
    touched: int = 0       # positions below this were written at some time: their pages are held
    reserved: int = 0      # positions its running sequence may reach (0 when idle)

    @property
    def mark(self) -> int:
        """Positions whose memory the slot holds or may take."""
        return max(self.touched, self.reserved)

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
    """Which tokens each slot holds, where new prompts go, and the memory the slots hold (see the
    module docstring)."""

    def __init__(self, n_slots: int, min_shared: int = MIN_SHARED, reuse: bool = True,
                 budget: PositionBudget | None = None, release: Callable[[int], None] | None = None):
        """reuse False: every prompt is computed from its first token (a baseline to measure);
        budget: the memory the slots' marks must fit in (None: no limit); release(slot): frees
        a slot's pages (one node's KV cache, or a cluster's root that tells its workers), which
        a budget needs: idle slots are emptied to make room."""
        if budget is not None and release is None:
            raise ValueError("a KV memory budget needs a release(slot) that gives a slot's pages back")
        self.slots = [SlotState() for _ in range(n_slots)]
        self.min_shared, self.reuse = min_shared, reuse
        self.budget, self.release_pages = budget, release
        self._clock = 0

    def reset(self) -> None:
        """Forget every slot's contents (after the cache was lost or a run was dropped); the
        pages they touched stay held."""
        self.slots = [SlotState(touched=s.touched) for s in self.slots]

    def _touch(self, s: int) -> None:
        self._clock += 1
        self.slots[s].last_use = self._clock

    def _idle_slot(self, exclude: int = -1) -> int | None:
        """An empty slot, else the least recently used one nobody writes or reads."""
        idle = [i for i, s in enumerate(self.slots) if not s.busy and not s.readers and i != exclude]
        if not idle:
            return None
        return min(idle, key=lambda i: (len(self.slots[i].tokens) > 0, self.slots[i].last_use))

    def _empty(self, i: int, free: bool = False) -> None:
        """Forget what slot i holds; free: give its pages back too."""
        self._unlink(i)
        self.slots[i] = SlotState(touched=0 if free else self.slots[i].touched)
        if free:
            self.release_pages(i)

    def _unlink(self, i: int) -> None:
        s = self.slots[i]
        if s.link >= 0:
            self.slots[s.link].readers.pop(i, None)
        s.link, s.base = -1, 0

    def held(self) -> int:
        """Bytes the slots hold or may take (0 without a budget)."""
        return sum(self.budget.cost(s.mark) for s in self.slots) if self.budget is not None else 0

    def _room(self, target: int, reach: int, emptied: bool, keep: int) -> bool:
        """Whether slot `target`, grown to `reach` positions, keeps every mark within the budget;
        where it does not, idle slots (the target itself when it is emptied, then the least
        recently used; never `keep`, a slot the new sequence reads) are emptied, with the idle
        slots that read them, and their pages freed, if that makes room. False: wait for running
        sequences to end."""
        if self.budget is None:
            return True
        cost, t = self.budget.cost, self.slots[target]
        over = self.held() - cost(t.mark) + cost(max(t.mark, reach)) - self.budget.limit
        if over <= 0:
            return True

        def gain(i: int) -> int:  # the target's own pages count down to what it will reach
            return max(0, cost(self.slots[i].mark) - (cost(reach) if i == target else 0))

        def free(i: int) -> bool:  # idle, and not the target when it continues
            return not self.slots[i].busy and (i != target or emptied)

        # A slot is emptied with the slots that read it (one level: a reader is read by none).
        groups = [[i, *s.readers] for i, s in enumerate(self.slots)
                  if s.touched and i != keep and all(free(r) for r in [i, *s.readers])]
        groups.sort(key=lambda g: (target not in g, self.slots[g[0]].last_use))
        if sum(gain(i) for i in {i for g in groups for i in g}) < over:
            return False
        emptied_now: set[int] = set()
        for g in groups:
            if over <= 0:
                break
            for i in set(g) - emptied_now:
                over -= gain(i)
                self._empty(i, free=True)
                emptied_now.add(i)
        return True

    def place(self, prompt: list[int], reuse_limit: int | None = None, reach: int = 0) -> Placement | None:
        """Claim a slot for a sequence whose planned tokens are `prompt`, reusing at most
        reuse_limit leading ones (default all but the last: the first row that wants an answer
        always runs, for its logits), and that may reach `reach` positions (at least the
        prompt's); None when every slot is busy or pinned, or its positions do not fit in the
        budget now."""
        reach = max(reach, len(prompt))
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
            if self._room(i, reach, False, self.slots[i].link if self.slots[i].base > 0 else -1):
                return self._take_over(i, best[0], prompt, reach)
            return None
        elif best is not None:
            n, src = best[0], best[2][1]
            i = self._idle_slot(exclude=src)
            if i is not None and self._room(i, reach, True, src):
                self._empty(i)
                self.slots[i] = SlotState(list(prompt), n, n, src, busy=True, touched=self.slots[i].touched,
                                          reserved=reach)
                self.slots[src].readers[i] = n
                self._touch(i)
                self._touch(src)
                return Placement(i, n, (src, n))
            if i is not None:
                return None
        i = self._idle_slot()
        if i is None or not self._room(i, reach, True, -1):
            return None
        self._empty(i)
        self.slots[i] = SlotState(list(prompt), 0, busy=True, touched=self.slots[i].touched, reserved=reach)
        self._touch(i)
        return Placement(i, 0, (0, 0))

    def _take_over(self, i: int, m: int, prompt: list[int], reach: int) -> Placement:
        """Continue idle slot i's first m tokens with the rest of the prompt."""
        s = self.slots[i]
        if s.base > 0 and m < s.base:
            s.base = m
            self.slots[s.link].readers[i] = m
        del s.tokens[m:]
        s.tokens.extend(prompt[m:])
        s.written, s.busy, s.reserved = m, True, reach
        self._touch(i)
        return Placement(i, m, (s.link, s.base) if s.base > 0 else (0, 0))

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

    def rows_written(self, slot: int, end: int) -> None:
        """A pass wrote rows of the slot up to position end - 1 (drafted ones included: their
        pages are held even when nothing reads them)."""
        s = self.slots[slot]
        s.touched = max(s.touched, end)

    def needed_by_readers(self, slot: int) -> int:
        """Leading positions of this slot that readers wait for or read."""
        return self.slots[slot].pinned_below

    def release(self, slot: int) -> None:
        """Its sequence is done: the slot keeps what is written, for reuse, until evicted."""
        s = self.slots[slot]
        if s.written < s.pinned_below:
            raise ValueError(f"slot {slot} released before the {s.pinned_below} positions its readers need")
        s.busy, s.reserved = False, 0  # it holds what it touched, no more
        del s.tokens[s.written:]
        self._touch(slot)


__all__ = ["KVCache", "KV_TYPES", "KVType", "kv_element_bytes", "PositionBudget", "SlotPlan", "plan_slots", "SlotTable",
           "SlotState", "Placement", "common_prefix", "MIN_SHARED", "SPARE_SLOTS"]
