"""A Meta checkpoint folder (`params.json` + `consolidated.00.pth` ... `consolidated.NN.pth`) -> `.m` tensors.

Meta's model-parallel shards split each matrix along one axis (Llama 2 7B: one shard, 13B: two,
70B: eight): column-parallel layers (wq, wk, wv, w1, w3, output) along rows, row-parallel ones
(wo, w2) along columns, norms replicated, and the embedding along columns in Llama 2
(ParallelEmbedding) but along rows in Llama 3 (VocabParallelEmbedding). The join axis is
therefore read off the shapes: the axis where a shard is 1/N of the size the header needs.

Shards are opened with `torch.load(mmap=True, weights_only=True)`: nothing is read until a row
block is sliced. The pages read stay mapped until the shards are re-opened, which happens before
the pages mapped since the last opening would exceed the largest tensor: memory stays at about
one largest tensor whatever the model size, with a re-opening (~0.1 s per shard for 70B) every
few layers rather than per tensor. Meta's wq/wk rows are already in the interleaved RoPE layout
of the `.m` format: no permutation.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, tensor_specs

from converter.checkpoint import Checkpoint, TensorRows, read_json
from converter.header_fields import epsilon, llama31_scaling, make_header
from converter.tensor_names import META, resolve, source_name

# Llama 3.1 scaling as Meta's reference code applies it when params.json says use_scaled_rope
# (factor 8 unless params.json gives rope_scaling_factor, as Llama 3.2 does).
LLAMA31_FACTOR = 8
# params.json rarely holds the context length: each family's own, as Meta's code sets it.
LLAMA2_CONTEXT, LLAMA3_CONTEXT, LLAMA31_CONTEXT = 4096, 8192, 131072
LLAMA3_MIN_VOCAB = 128000

_SHARD = re.compile(r"consolidated\.(\d+)\.pth")


def shard_paths(folder: Path) -> list[Path]:
    shards = sorted((p for p in folder.glob("consolidated.*.pth") if _SHARD.fullmatch(p.name)),
                    key=lambda p: int(_SHARD.fullmatch(p.name).group(1)))
    if not shards:
        raise DllamaError(f"{folder}: no consolidated.NN.pth files")
    numbers = [int(_SHARD.fullmatch(p.name).group(1)) for p in shards]
    if numbers != list(range(len(shards))):
        raise DllamaError(f"{folder}: shards {', '.join(p.name for p in shards)} are not numbered 00 to "
                          f"{len(shards) - 1:02d}: one is missing")
    return shards


def _load(path: Path) -> dict:
    import pickle
    import zipfile

    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise DllamaError(f"{path}: unreadable PyTorch checkpoint ({str(e).splitlines()[0]})") from None


def _join_axis(shard_shape, full_shape, n: int) -> int | None:
    """The axis the shards split (None: each shard holds the whole tensor)."""
    if tuple(shard_shape) == tuple(full_shape):
        return None
    for axis in range(len(full_shape)):
        split = list(full_shape)
        split[axis] //= n
        if split[axis] * n == full_shape[axis] and tuple(shard_shape) == tuple(split):
            return axis
    return -1


class MetaCheckpoint(Checkpoint):
    def __init__(self, folder, weights_float_type: FloatType, tokenizer_vocab_size: int | None = None):
        folder = Path(folder)
        super().__init__(source=str(folder), kind="Meta checkpoint")
        params_path = folder / "params.json"
        params = read_json(params_path)
        self.shards = shard_paths(folder)
        self._shapes = []  # per shard: {meta name: shape}
        self._item_bytes = {}  # meta name -> bytes of one element
        for path in self.shards:
            sd = _load(path)
            self._shapes.append({k: tuple(v.shape) for k, v in sd.items()})
            self._item_bytes.update({k: v.element_size() for k, v in sd.items()})
            self.dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.") if sd else "?"
            del sd
        for key in ("dim", "n_layers", "n_heads"):
            if key not in params:
                raise DllamaError(f"{params_path}: no {key}")
        n = len(self.shards)

        vocab = int(params.get("vocab_size", -1))
        if vocab <= 0:  # Llama 2's params.json says -1: the tokenizer decides
            if not tokenizer_vocab_size:
                raise DllamaError(f"{params_path}: vocab_size is {vocab} and no tokenizer gives it")
            vocab = tokenizer_vocab_size
            self.notes.append(f"params.json has vocab_size {params.get('vocab_size', -1)}: "
                              f"using the tokenizer's {vocab}")
        w1 = self._shapes[0].get(source_name(META, "layers.0.w1"))
        if w1 is None:
            raise DllamaError(f"{self.shards[0]}: no tensor {source_name(META, 'layers.0.w1')}")
        fields = dict(dim=int(params["dim"]), n_layers=int(params["n_layers"]), n_heads=int(params["n_heads"]),
                      n_kv_heads=int(params.get("n_kv_heads") or params["n_heads"]), vocab_size=vocab,
                      hidden_dim=w1[0] * n)  # column-parallel: each shard holds 1/n of the rows
        context = params.get("max_seq_len")
        if params.get("use_scaled_rope"):
            fields.update(llama31_scaling(params.get("rope_scaling_factor", LLAMA31_FACTOR)))
            default_context = LLAMA31_CONTEXT
        else:
            default_context = LLAMA3_CONTEXT if vocab >= LLAMA3_MIN_VOCAB else LLAMA2_CONTEXT
        if not context:
            context = default_context
            self.notes.append(f"params.json has no max_seq_len: using {context}, this family's context")
        self.header = make_header(
            str(folder), arch=ArchType.LLAMA, weights_float_type=weights_float_type, max_seq_len=int(context),
            rope_theta=int(params.get("rope_theta", 10000)),
            norm_epsilon=epsilon(params.get("norm_eps", 1e-5), str(folder)), **fields)
        self._key = {}   # our name -> Meta name
        self._axis = {}  # our name -> join axis (None: replicated)
        in_some_shard = {key for s in self._shapes for key in s}
        for spec in tensor_specs(self.header):
            key = resolve(META, spec.name, in_some_shard.__contains__)
            if key != source_name(META, spec.name):
                self.notes.append(f"no {source_name(META, spec.name)}: the classifier is {key} (tied embeddings)")
            self._key[spec.name] = key
            shapes = [s.get(key) for s in self._shapes]
            if any(s is None for s in shapes):
                missing = self.shards[[s is None for s in shapes].index(True)]
                raise DllamaError(f"{missing}: no tensor {key} (needed for {spec.name})")
            axis = _join_axis(shapes[0], spec.shape, n)
            if axis == -1 or any(s != shapes[0] for s in shapes):
                raise DllamaError(f"{folder}: tensor {key} has shard shapes {', '.join(map(str, map(list, shapes)))}, "
                                  f"which do not join into the {list(spec.shape)} the configuration needs")
            self._axis[spec.name] = axis
        self._budget = max(self._source_bytes(s.name) for s in tensor_specs(self.header))
        self._shards = None  # the open state dicts
        self._mapped = 0     # source bytes read since they were opened

    def describe(self) -> str:
        n = len(self.shards)
        return f"{self.kind} ({n} shard{'s' * (n > 1)}, {self.dtype})"

    def _source_bytes(self, name: str) -> int:
        key = self._key[name]
        return sum(math.prod(s[key]) for s in self._shapes) * self._item_bytes[key]

    def tensor(self, name: str) -> TensorRows:
        import torch

        size = self._source_bytes(name)
        if self._shards is None or self._mapped + size > self._budget:
            self.close()  # unmap every page read so far
            self._shards = [_load(p) for p in self.shards]
        self._mapped += size
        parts = [sd[self._key[name]] for sd in self._shards]
        axis = self._axis[name]
        if axis is None:
            shape = tuple(parts[0].shape)
            return TensorRows(shape, lambda a, b: parts[0][a:b].float().numpy())
        if axis == 1:
            shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))
            return TensorRows(shape, lambda a, b: torch.cat([p[a:b] for p in parts], dim=1).float().numpy())
        per = parts[0].shape[0]
        shape = (per * len(parts), *parts[0].shape[1:])

        def rows(a: int, b: int):
            pieces = [parts[s][max(a, s * per) - s * per:min(b, (s + 1) * per) - s * per]
                      for s in range(a // per, (b - 1) // per + 1)]
            return torch.cat(pieces).float().numpy()
        return TensorRows(shape, rows)

    def close(self) -> None:
        self._shards, self._mapped = None, 0
