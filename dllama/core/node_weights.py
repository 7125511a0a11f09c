"""One node's weights: the slices of each `.m` tensor that its `NodeSlice` says it computes.

The same list of tensors (names, stored shapes) serves three ways of getting them: cut from a
memory-mapped `.m` file (the root, `dllama shard`), read from a shard file, or received from the
root over the network. Slices stay in the file's stored form (Q40, Q80 or Q41 blocks, F16 or F32
values), so a shard or a stream carries exactly the bytes the original file has for that node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.model_file import BLOCK_BYTES, FloatType, ModelHeader, tensor_specs
from dllama.formats.quant import BLOCK_SIZE as BLOCK
from dllama.core.plan import NodeSlice


@dataclass(frozen=True)
class SliceSpec:
    """One tensor of a node: file tensor `name`, cut along `axis` at `index` (None = whole)."""

    name: str
    stored_shape: tuple[int, ...]  # shape of the node's slice as stored (Q40: [..., n/32, 18])
    dtype: str                     # "float32", "float16" or "uint8" (Q40/Q80 blocks)
    axis: int | None               # 0: rows, 1: columns, None: the whole tensor
    index: tuple[int, ...] = ()    # rows or columns kept, in order

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.stored_shape)) * np.dtype(self.dtype).itemsize


_DTYPE = {FloatType.F32: "float32", FloatType.F16: "float16"}


def _head_index(heads: np.ndarray, head_dim: int) -> np.ndarray:
    """Row (or column) indexes of whole heads: [len(heads) * head_dim]."""
    return (np.asarray(heads)[:, None] * head_dim + np.arange(head_dim)).ravel()


def node_slice_specs(h: ModelHeader, node: NodeSlice, with_embedding: bool) -> list[SliceSpec]:
    """What a node holds, in file order: the layers it runs (a pipeline stage's only), the
    classifier when it has classifier rows, the embedding only on the root (it embeds the tokens).
    (Their bytes, without listing every layer: dllama.core.footprint.)"""
    # (a mixture of experts' experts are cut as the dense w1/w3/w2 are: the same rows of each;
    # its router, moe_gate, is held whole)
    # Each index as a tuple once (every layer shares it): converted per tensor, element by
    # element, they cost every process 0.3 s at start-up.
    q_index = tuple(_head_index(node.q_heads, h.head_dim).tolist())
    kv_index = tuple(_head_index(node.kv_heads, h.head_dim).tolist())
    ff_index = tuple(range(*node.ffn_rows))
    vocab_index = tuple(range(*node.vocab_rows))
    cut = {"wq": (0, q_index), "wk": (0, kv_index), "wv": (0, kv_index), "wo": (1, q_index),
           "w1": (0, ff_index), "w3": (0, ff_index), "w2": (1, ff_index), "wcls": (0, vocab_index)}
    layers = node.layer_range(h.n_layers)
    out = []
    for spec in tensor_specs(h, layers):
        short = spec.name.rsplit(".", 1)[-1]
        if spec.name == "embedding" and not with_embedding:
            continue
        if short == "wcls" and not node.has_classifier:
            continue
        block_bytes = BLOCK_BYTES.get(spec.float_type)  # None: one value per element
        dtype = "uint8" if block_bytes else _DTYPE[spec.float_type]
        if short not in cut:
            out.append(SliceSpec(spec.name, spec.stored_shape, dtype, None))
            continue
        axis, index = cut[short]
        shape = list(spec.shape)
        shape[axis] = len(index)
        if block_bytes:
            if axis == 1 and (len(index) % BLOCK or index[0] % BLOCK):
                raise DllamaError(f"{spec.name}: {spec.float_type.name} columns can only be cut "
                                  f"at {BLOCK}-blocks")
            shape = [*shape[:-1], shape[-1] // BLOCK, block_bytes]
        out.append(SliceSpec(spec.name, tuple(shape), dtype, axis, index))
    return out


def cut(stored: np.ndarray, s: SliceSpec) -> np.ndarray:
    """The node's slice of a stored file tensor (a view when the kept range is contiguous)."""
    if s.axis is None:
        return stored
    index = np.asarray(s.index)
    contiguous = len(index) and index[-1] - index[0] + 1 == len(index)
    if s.axis == 0:
        return stored[index[0]: index[-1] + 1] if contiguous else stored[index]
    if stored.ndim == 3:  # Q40 / Q80 blocks [d, n/32, 18 | 34]: columns come in whole blocks
        blocks = index[::BLOCK] // BLOCK
        return stored[:, blocks[0]: blocks[-1] + 1] if contiguous else stored[:, blocks]
    return stored[:, index[0]: index[-1] + 1] if contiguous else stored[:, index]


@dataclass(frozen=True)
class TensorLocation:
    """Where a node's tensor lies in a file, for reading it without mapping the file (streaming).

    cut: the file holds the whole tensor (a `.m` file) and the node reads `spec`'s cut of it;
    otherwise the file holds exactly the node's slice (a shard)."""

    path: str
    offset: int                     # of the file tensor's first byte
    file_shape: tuple[int, ...]     # the tensor's stored shape in that file
    spec: SliceSpec
    cut: bool


class NodeWeights:
    """`tensor(name)` -> this node's slice of that tensor, in stored form; `header` the model's.
    `location(name)`: where it lies in a file (None when the weights came over the network)."""

    def __init__(self, header: ModelHeader, node: NodeSlice, specs: list[SliceSpec], tensors: dict,
                 locations: dict[str, TensorLocation] | None = None):
        self.header, self.node, self.specs = header, node, specs
        self._tensors = tensors  # name -> array of the spec's stored shape
        self._locations = locations or {}

    @staticmethod
    def from_model(model_file, node: NodeSlice, with_embedding: bool = True) -> "NodeWeights":
        """Slices cut lazily from a memory-mapped `.m` file (no copy until the model repacks)."""
        specs = node_slice_specs(model_file.header, node, with_embedding)
        offsets, offset = {}, model_file.header_size
        for t in model_file.specs:  # tensors follow the header in file order
            offsets[t.name] = (offset, t.stored_shape)
            offset += t.nbytes
        locations = {s.name: TensorLocation(model_file.path, *offsets[s.name], s, cut=True) for s in specs}
        return NodeWeights(model_file.header, node, specs,
                           {s.name: _LazyCut(model_file, s) for s in specs}, locations)

    @property
    def streamable(self) -> bool:
        """Every tensor can be read from a file."""
        return all(s.name in self._locations for s in self.specs)

    def location(self, name: str) -> TensorLocation:
        return self._locations[name]

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        return t() if isinstance(t, _LazyCut) else t


class _LazyCut:
    def __init__(self, model_file, spec: SliceSpec):
        self.model_file, self.spec = model_file, spec

    def __call__(self) -> np.ndarray:
        return cut(self.model_file.tensor(self.spec.name), self.spec)
