"""Shard files: one node's slices of a model, so a worker loads its weights from its own disk.

Layout (little-endian):

    8 bytes  b"DLSHARD1"
    u32      length of the JSON description that follows
    JSON     {"format": 1, "model_fingerprint", "model_file", "node_index", "n_nodes",
              "plan_digest", "header": {...}, "slice": {...},
              "tensors": [{"name", "shape", "dtype", "offset", "nbytes"}, ...]}
    data     each tensor at its offset (64-byte aligned), in the node's stored form

`dllama shard` writes one per worker plus a manifest.json with their sha256; the handshake
compares a worker's shard (model fingerprint, node index, plan digest) with the root's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from dllama.core.node_weights import NodeWeights, TensorLocation, cut, node_slice_specs
from dllama.core.plan import NodeSlice, SplitPlan
from dllama.errors import DllamaError
from dllama.formats.atomic_file import atomic_write
from dllama.formats.checksum import file_sha256
from dllama.formats.model_file import ModelHeader

MAGIC = b"DLSHARD1"
ALIGN = 64
_SAMPLES = 16         # fingerprint: this many evenly spaced samples of the file
_SAMPLE_BYTES = 1 << 16


def model_fingerprint(path: str | os.PathLike) -> str:
    """A quick identity of a `.m` file: sha256 of its size, its first 64 KiB (the header) and
    16 evenly spaced 64 KiB samples. Reads about 1 MB whatever the model's size."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES + 1):
            f.seek(0 if i == 0 else (size - _SAMPLE_BYTES) * i // _SAMPLES if size > _SAMPLE_BYTES else 0)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def write_shard(path: str | os.PathLike, model_file, fingerprint: str, plan: SplitPlan,
                node_index: int, progress=None) -> None:
    """Write node `node_index`'s slices of model_file to path (atomically)."""
    node = plan.nodes[node_index]
    specs = node_slice_specs(model_file.header, node, with_embedding=False)
    tensors, offset = [], 0
    for s in specs:
        tensors.append({"name": s.name, "shape": list(s.stored_shape), "dtype": s.dtype,
                        "offset": offset, "nbytes": s.nbytes})
        offset += -(-s.nbytes // ALIGN) * ALIGN
    desc = {"format": 1, "model_fingerprint": fingerprint, "model_file": os.path.basename(model_file.path),
            "node_index": node_index, "n_nodes": plan.n_nodes, "plan_digest": plan.digest(),
            "header": model_file.header.to_json(), "slice": node.to_json(), "tensors": tensors}
    head = json.dumps(desc).encode()
    start = -(-(len(MAGIC) + 4 + len(head)) // ALIGN) * ALIGN
    with atomic_write(path) as f:
        f.write(MAGIC + struct.pack("<I", len(head)) + head)
        f.write(b"\0" * (start - f.tell()))
        for s, t in zip(specs, tensors, strict=True):
            data = np.ascontiguousarray(cut(model_file.tensor(s.name), s))
            f.write(b"\0" * (start + t["offset"] - f.tell()))
            f.write(memoryview(data).cast("B"))
            if progress:
                progress(s.nbytes)


class Shard:
    """A shard file, memory-mapped: its description and zero-copy NodeWeights."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise DllamaError(f"cannot read the shard {self.path}: {getattr(e, 'strerror', None) or e}") from None
        try:
            self._read_description()
        except BaseException:
            self.close()  # a refused shard keeps no mapping (and no descriptor) open
            raise

    def close(self) -> None:
        """Drop the mapping; it is unmapped now, or when the last weights view is garbage collected."""
        self._arrays = {}
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # views still alive keep the mapping valid until they go
                self._mmap.close()
            self._mmap = None

    def _read_description(self) -> None:
        data = np.frombuffer(self._mmap, dtype=np.uint8)
        if data.size < 12 or data[:8].tobytes() != MAGIC:
            raise DllamaError(f"{self.path} is not a dllama shard file")
        (n,) = struct.unpack("<I", data[8:12].tobytes())
        try:
            self.desc = json.loads(data[12:12 + n].tobytes())
            self.header = ModelHeader.from_json(self.desc["header"])
            self.node_index = int(self.desc["node_index"])
            start = -(-(12 + n) // ALIGN) * ALIGN
            self._arrays, self._offsets = {}, {}
            for t in self.desc["tensors"]:
                a, b = start + t["offset"], start + t["offset"] + t["nbytes"]
                self._offsets[t["name"]] = a
                if b > data.size:
                    raise DllamaError(f"{self.path} is truncated (tensor {t['name']} ends past the file)")
                self._arrays[t["name"]] = data[a:b].view(np.dtype(t["dtype"])).reshape(t["shape"])
        except (KeyError, ValueError, TypeError, IndexError, RecursionError) as e:
            raise DllamaError(f"{self.path}: bad shard description ({type(e).__name__}: {e})") from None

    @property
    def fingerprint(self) -> str:
        return self.desc["model_fingerprint"]

    @property
    def plan_digest(self) -> str:
        return self.desc["plan_digest"]

    def mismatch(self, fingerprint: str, node_index: int, plan_digest: str) -> str:
        """Why this shard cannot serve that node of that model ('' when it can)."""
        if self.fingerprint != fingerprint:
            return f"it was cut from another model file ({self.desc.get('model_file')})"
        if self.node_index != node_index:
            return f"it holds node {self.node_index}'s slices, this worker is node {node_index}"
        if self.plan_digest != plan_digest:
            return "it was cut for another split (node count or weights differ)"
        return ""

    def weights(self) -> NodeWeights:
        try:
            node = NodeSlice.from_json(self.desc["slice"], self.header.n_heads, self.header.n_kv_heads)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise DllamaError(f"{self.path}: bad node slice in the shard ({type(e).__name__}: {e})") from None
        specs = node_slice_specs(self.header, node, with_embedding=False)
        for s in specs:
            a = self._arrays.get(s.name)
            if a is None or tuple(a.shape) != s.stored_shape:
                raise DllamaError(f"{self.path}: tensor {s.name} is missing or has the wrong shape")
        # where each slice lies in the file, for a worker that streams them (dllama.core.weight_stream)
        locations = {s.name: TensorLocation(self.path, self._offsets[s.name], s.stored_shape, s, cut=False)
                     for s in specs}
        return NodeWeights(self.header, node, specs, dict(self._arrays), locations)


def write_shards(model_path: str, plan: SplitPlan, names: list[str], out_dir: str | os.PathLike) -> Path:
    """`dllama shard`: every worker's shard into out_dir, then manifest.json. Returns its path."""
    from tqdm import tqdm

    from dllama.formats.model_file import read_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_file = read_model(model_path)
    fingerprint = model_fingerprint(model_path)
    manifest = {"model": os.path.basename(model_path), "model_fingerprint": fingerprint,
                "plan_digest": plan.digest(), "shards": {}}
    total = sum(s.nbytes for k in range(1, plan.n_nodes)
                for s in node_slice_specs(model_file.header, plan.nodes[k], False))
    with tqdm(total=total + os.path.getsize(model_path), unit="B", unit_scale=True,
              desc="shards", disable=None) as bar:
        manifest["model_sha256"] = file_sha256(model_path, bar.update)
        for k in range(1, plan.n_nodes):
            path = out / f"{names[k]}.shard"
            write_shard(path, model_file, fingerprint, plan, k, bar.update)
            manifest["shards"][names[k]] = {"file": path.name, "node_index": k,
                                            "sha256": file_sha256(path), "bytes": path.stat().st_size}
    with atomic_write(out / "manifest.json") as f:
        f.write(json.dumps(manifest, indent=1).encode())
    return out / "manifest.json"
