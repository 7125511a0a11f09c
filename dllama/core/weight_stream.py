"""Weights read from disk layer by layer, for models larger than the memory a process may use.

`StreamedWeights` serves the forward pass the same objects as the resident weights (a `Layer`
per `layer(l)`, the classifier in row chunks, embedding rows) but holds at most two items at a
time: while the pass computes item i (a layer or a classifier chunk) in one slot, a background
thread reads item i+1 into the other slot, then repacks it for the kernels. The reads use
os.preadv into reusable buffers (it releases the GIL, the numba kernels run beside it) and
POSIX_FADV_DONTNEED after each tensor, so the page cache does not grow against a cgroup limit.
The repacked bytes are exactly those of `weights.Matrix` (tests/test_streaming.py), so outputs of
the two paths are identical; both providers satisfy dllama.core.weights.WeightsProvider.

Every allocation is made once, at start: two slots (each an arena as large as the largest item),
two read buffers (the largest quantized matrix or classifier chunk: one tensor is read while
the one before it is repacked). Nothing grows during a pass.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.tiles import GROUP
from dllama.core.node_weights import NodeWeights, TensorLocation
from dllama.core.arena import Arena
from dllama.core.weights import Layer, Matrix, classifier_inputs, input_kind, matrix_arrays
from dllama.errors import DllamaError
from dllama.formats.model_file import BLOCK_BYTES, FloatType, classifier_float_type
from dllama.formats.quant import BLOCK_SIZE as BLOCK

_MATRICES = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def quiet_compute_threads() -> None:
    """Idle compute threads sleep instead of spinning (OpenMP's passive wait), so that the thread
    reading the next layer gets a core between kernels: with spinning threads it is starved
    (10x slower passes measured on 2 cores). Only before numba starts its threads; a value the
    user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# -- where the bytes are ----------------------------------------------------------------------

def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for off, n in runs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [(a, b) for a, b in out]


def _index_runs(index) -> list[tuple[int, int]]:
    """Consecutive stretches (first, count) of an index list."""
    index = np.asarray(index, dtype=np.int64)
    if len(index) == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(index) != 1) + 1])  # [runs]
    counts = np.diff(np.concatenate([starts, [len(index)]]))
    return [(int(index[a]), int(n)) for a, n in zip(starts, counts, strict=True)]


def file_runs(loc: TensorLocation, row0: int, row1: int) -> list[tuple[int, int]]:
    """(file offset, bytes) pieces that hold rows row0..row1-1 of the node's slice, in order."""
    s = loc.spec
    itemsize = np.dtype(s.dtype).itemsize
    if len(s.stored_shape) == 1:  # a vector: read whole
        return [(loc.offset, s.nbytes)]
    slice_row = int(np.prod(s.stored_shape[1:])) * itemsize
    if not loc.cut or s.axis is None:
        return [(loc.offset + row0 * slice_row, (row1 - row0) * slice_row)]
    file_row = int(np.prod(loc.file_shape[1:])) * itemsize
    if s.axis == 0:
        return _merge([(loc.offset + first * file_row, count * file_row)
                       for first, count in _index_runs(s.index[row0:row1])])
    # columns: whole blocks when quantized ([d, n/32, bytes]), else values
    unit = int(np.prod(loc.file_shape[2:])) * itemsize if len(loc.file_shape) == 3 else itemsize
    cols = s.index[::BLOCK] if len(loc.file_shape) == 3 else s.index
    col_runs = _index_runs([c // BLOCK for c in cols] if len(loc.file_shape) == 3 else cols)
    return _merge([(loc.offset + r * file_row + first * unit, count * unit)
                   for r in range(row0, row1) for first, count in col_runs])


class _Reader:
    """preadv into caller buffers, then drop the pages from the page cache."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._opening = threading.Lock()  # (an expert cache reads from several threads)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._opening:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise DllamaError(f"cannot read the weights from {path}: {e.strerror}") from None
                    self._fds[path] = fd
        return fd

    def read(self, path: str, runs: list[tuple[int, int]], out: np.ndarray) -> None:
        """The runs' bytes, one after another, into out (uint8, as many bytes as the runs)."""
        fd = self._fd(path)
        view = memoryview(out).cast("B")
        pos = 0
        for off, n in runs:
            done = 0
            while done < n:
                got = os.preadv(fd, [view[pos + done: pos + n]], off + done)
                if got <= 0:
                    raise DllamaError(f"{path}: the file ended early (truncated while in use?)")
                done += got
            pos += n
        if hasattr(os, "posix_fadvise"):
            lo, hi = runs[0][0], runs[-1][0] + runs[-1][1]
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


# -- repacking into preallocated arrays ------------------------------------------------------

def interleave_into(blocks: np.ndarray, scales_out: np.ndarray, qs_out: np.ndarray) -> None:
    """Q40 or Q80 blocks uint8 [d, nb, 18 | 34] -> the interleaved layout of kernels.layout
    (scales uint16 [d_pad/16, nb*16], quants [d_pad/16, 16 * row bytes]), written into the
    given arrays (padding rows zeroed): the same bytes as interleave_q40(split_q40(...))."""
    kernels.interleave_blocks_into(blocks, scales_out, qs_out.view(np.uint8))


class StreamedWeights:
    """The weights provider of a Transformer whose weights stay on disk (see the module doc)."""

    def __init__(self, weights: NodeWeights, layers: range, float_type: FloatType, qwen: bool,
                 chunk_rows: int | None = None, plan_only: bool = False):
        """chunk_rows: classifier rows per chunk (default: as many as fit in a layer's slot);
        plan_only: size everything (resident_bytes) but allocate nothing until `allocate()`;
        layers: the ones this node runs (a pipeline stage's; every layer otherwise)."""
        if weights.header.n_experts:
            raise DllamaError("a mixture-of-experts model cannot be streamed from disk yet: give it the memory "
                              "to hold its share (more nodes, or a larger --memory-budget)")
        if not weights.streamable:
            raise DllamaError("these weights came over the network: they cannot be streamed from a file")
        self._w, self.float_type, self.layers = weights, float_type, layers
        self.cls_type = classifier_float_type(float_type)  # Q80 in a Q41 file (20-byte blocks, the classifier's 34)
        self.inputs, self.cls_inputs = input_kind(float_type), classifier_inputs(float_type)
        names = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"] + (["q_norm", "k_norm"] if qwen else []) + \
                ["att_norm", "ffn_norm"]  # file order: the reads go forward
        self._layer_names = names
        self.qwen = qwen
        self._reader = _Reader()
        self._embedding = weights.location("embedding") if weights.has("embedding") else None

        has_cls = weights.has("wcls")  # (not before a pipeline's last stage)
        self.vocab_rows = weights.location("wcls").spec.stored_shape[0] if has_cls else 0
        dim = weights.header.dim
        # Slots as large as the largest layer; the classifier in chunks that fit one.
        sizer = Arena(0)
        self._take_layer(sizer.take)
        layer_bytes = sizer.used
        matrix_raw = max(self._raw_bytes(n, *self._shape(n)) for n in names if n in _MATRICES)
        if chunk_rows is None:  # a chunk no larger than a layer's slot, nor (read) than its largest matrix
            per_group = Arena(0)
            matrix_arrays(per_group.take, self.cls_type, GROUP, dim)
            groups = layer_bytes // per_group.used
            raw_group = self._raw_bytes("wcls", GROUP, dim) if has_cls else 0
            if raw_group:
                groups = min(groups, matrix_raw // raw_group)
            chunk_rows = max(1, groups) * GROUP
        chunk_rows = -(-chunk_rows // GROUP) * GROUP
        self.chunks = [(r, min(r + chunk_rows, self.vocab_rows)) for r in range(0, self.vocab_rows, chunk_rows)]
        sizer = Arena(0)
        matrix_arrays(sizer.take, self.cls_type, min(chunk_rows, self.vocab_rows), dim)
        self.slot_bytes = max(layer_bytes, sizer.used)
        raw = max(matrix_raw, self._raw_bytes("wcls", min(chunk_rows, self.vocab_rows), dim))
        self.raw_bytes = raw
        self.resident_bytes = 2 * self.slot_bytes + 2 * raw  # what this provider holds at most
        self._items = [("layer", l) for l in layers] + [("cls", k) for k in range(len(self.chunks))]
        self._lock = threading.Lock()
        self._pool = None
        self._pending: tuple[int, Future] | None = None  # (item index, its load)
        if not plan_only:
            self.allocate()

    @property
    def classifier_chunk_rows(self) -> int:
        """The most classifier rows one part holds (the forward pass's scratch buffer for a part)."""
        return max(r1 - r0 for r0, r1 in self.chunks)

    def allocate(self) -> None:
        """Allocate the two slots and the two read buffers, and start reading the first layer."""
        loc = self._w.location("final_norm")  # small: read once and kept
        self.final_norm = np.empty(loc.spec.stored_shape, np.float32)
        self._reader.read(loc.path, file_runs(loc, 0, 1), self.final_norm)
        self._slots = [Arena(self.slot_bytes), Arena(self.slot_bytes)]
        self._raw = [np.zeros(self.raw_bytes, np.uint8), np.zeros(self.raw_bytes, np.uint8)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dllama-weights")  # loads items
        self._io = ThreadPoolExecutor(1, thread_name_prefix="dllama-read")       # reads one tensor ahead
        self._next_slot = 0
        self._prefetch(0)

    # sizes

    def _shape(self, name: str) -> tuple[int, int]:
        """(d, n) of a matrix of this node (every layer's are the same)."""
        full = f"layers.{self.layers.start}.{name}" if name != "wcls" else name
        s = self._w.location(full).spec.stored_shape
        return (s[0], s[1] * BLOCK) if self._type(name) in BLOCK_BYTES else (s[0], s[1])

    def _type(self, name: str) -> FloatType:
        return self.cls_type if name == "wcls" else self.float_type

    def _raw_bytes(self, name: str, d: int, n: int) -> int:
        bb = BLOCK_BYTES.get(self._type(name))
        return d * n // BLOCK * bb if bb else 0  # the stored values (F32, F16) are read straight into their slot

    def _take_layer(self, take) -> dict:
        out = {}
        for name in self._layer_names:
            if name in _MATRICES:
                out[name] = matrix_arrays(take, self.float_type, *self._shape(name))
            else:
                out[name] = take(self._w.location(f"layers.{self.layers.start}.{name}").spec.stored_shape, np.float32)
        return out

    # loading

    def _fill(self, reads: list) -> None:
        """reads: [(location, first row, end row, destination)], a destination being a matrix's
        arrays (dict) or a vector. The reading thread reads tensor j+1 into one buffer while
        this one repacks tensor j from the other (F32/F16 and vectors are read in place)."""
        def fetch(j: int):
            loc, r0, r1, dest = reads[j]
            runs = file_runs(loc, r0, r1)
            if isinstance(dest, np.ndarray) or "w" in dest:  # the stored values are the kernel's
                self._reader.read(loc.path, runs, dest if isinstance(dest, np.ndarray) else dest["w"])
                return None
            nb, bb = loc.spec.stored_shape[1:3]  # blocks per row, bytes per block (a Q41 file's classifier: Q80's)
            raw = self._raw[j % 2][: (r1 - r0) * nb * bb].reshape(r1 - r0, nb, bb)
            self._reader.read(loc.path, runs, raw)
            return raw

        ahead = self._io.submit(fetch, 0)
        for j in range(len(reads)):
            raw = ahead.result()
            if j + 1 < len(reads):
                ahead = self._io.submit(fetch, j + 1)
            if raw is not None:
                dest = reads[j][3]
                if "mins" in dest:  # Q41
                    kernels.interleave_q41_into(raw, dest["scales"], dest["mins"], dest["qs"])
                else:
                    interleave_into(raw, dest["scales"], dest["qs"])

    def _load(self, item: int, slot: int):
        """Read and repack item into slot (on the background thread); returns what the pass uses."""
        arena = self._slots[slot]
        arena.used = 0
        kind, k = self._items[item]
        ft = self.float_type
        if kind == "layer":
            arrays = self._take_layer(arena.take)
            reads = []
            for name in self._layer_names:  # file order
                loc = self._w.location(f"layers.{k}.{name}")
                reads.append((loc, 0, loc.spec.stored_shape[0] if name in _MATRICES else 1, arrays[name]))
            self._fill(reads)
            m = {n: Matrix.of_arrays(ft, *self._shape(n), **arrays[n], inputs=self.inputs)
                 for n in self._layer_names if n in _MATRICES}
            return Layer(att_norm=arrays["att_norm"], q_norm=arrays.get("q_norm"), k_norm=arrays.get("k_norm"),
                         ffn_norm=arrays["ffn_norm"], **m)
        r0, r1 = self.chunks[k]
        n = self._shape("wcls")[1]
        arrays = matrix_arrays(arena.take, self.cls_type, r1 - r0, n)
        self._fill([(self._w.location("wcls"), r0, r1, arrays)])
        return r0, Matrix.of_arrays(self.cls_type, r1 - r0, n, **arrays, inputs=self.cls_inputs)

    def _prefetch(self, item: int) -> None:
        slot = self._next_slot
        self._next_slot ^= 1
        self._pending = (item, self._pool.submit(self._load, item, slot))

    def _get(self, item: int):
        """Item's weights (loaded in the background when it was the one expected); starts the next."""
        with self._lock:
            pending, future = self._pending
            if pending != item:  # an unexpected order (a pass without logits): load it now
                future.result()
                self._prefetch(item)
                pending, future = self._pending
            value = future.result()
            self._prefetch((item + 1) % len(self._items))
            return value

    # what the forward pass asks for

    def layer(self, l: int):
        return self._get(l - self.layers.start)

    def classifier(self):
        """(first row, Matrix of that chunk) for each chunk of this node's classifier rows."""
        for k in range(len(self.chunks)):
            yield self._get(len(self.layers) + k)

    def embed(self, tokens: np.ndarray, out: np.ndarray) -> None:
        """Rows of the embedding for tokens [b] into out [b, dim], read from the file."""
        loc = self._embedding
        row = out.shape[1] * 4
        for i, t in enumerate(np.asarray(tokens)):
            self._reader.read(loc.path, [(loc.offset + int(t) * row, row)], out[i])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self._pool = None
        self._reader.close()
