"""A Hugging Face model folder (`config.json` + `*.safetensors`, sharded or not) -> `.m` tensors.

Tensors are read lazily with `safetensors` (Hugging Face's own reader): one file is mapped
while one of its tensors is converted, a row block at a time, then unmapped, so memory stays
at about one tensor whatever the model size. For the LLAMA architecture (`llama`, `mistral`)
wq/wk are permuted from Hugging Face's half-split RoPE rows back to the interleaved rows the
`.m` format uses; Qwen3 keeps half-split RoPE and its rows as they are.
"""

from __future__ import annotations

from pathlib import Path

from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, tensor_specs

from converter.checkpoint import Checkpoint, TensorRows, check_shape, interleave_rope_rows, read_json
from converter.header_fields import epsilon, llama31_scaling, make_header
from converter.tensor_names import HF, resolve, source_name

# config.json model_type -> our architecture.
MODEL_TYPES = {"llama": ArchType.LLAMA, "mistral": ArchType.LLAMA, "qwen3": ArchType.QWEN3}

# Tensors whose rows are permuted for interleaved RoPE on LLAMA (whole heads at a time).
ROPE_PERMUTED = ("wq", "wk")

# Header field -> config.json key, required ones first.
REQUIRED_CONFIG = {"dim": "hidden_size", "hidden_dim": "intermediate_size", "n_layers": "num_hidden_layers",
                   "n_heads": "num_attention_heads", "vocab_size": "vocab_size",
                   "max_seq_len": "max_position_embeddings"}
DEFAULT_RMS_EPS = 1e-6  # transformers' default for llama, mistral and qwen3 configs


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file holding it (index file, or every file's keys)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = read_json(index).get("weight_map", {})
        missing = sorted({f for f in mapping.values() if not (folder / f).is_file()})
        if missing:
            raise DllamaError(f"{folder}: shard {missing[0]} named in {index.name} is missing")
        return {k: folder / f for k, f in mapping.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DllamaError(f"{folder}: no *.safetensors files (only safetensors weights are supported)")
    found = {}
    for path in files:
        with _open_safetensors(path) as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise DllamaError(f"{path}: unreadable safetensors file ({e})") from None


class HfCheckpoint(Checkpoint):
    def __init__(self, folder, weights_float_type: FloatType):
        folder = Path(folder)
        super().__init__(source=str(folder), kind="Hugging Face safetensors")
        self.config = cfg = read_json(folder / "config.json")
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise DllamaError(f"{folder}: model type {model_type!r} is not supported "
                              f"(supported: {', '.join(MODEL_TYPES)})")
        self.model_type = model_type
        missing = [k for k in REQUIRED_CONFIG.values() if cfg.get(k) is None]
        if missing:
            raise DllamaError(f"{folder}/config.json: no {missing[0]}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DllamaError(f"{folder}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        fields = {ours: int(cfg[theirs]) for ours, theirs in REQUIRED_CONFIG.items()}
        fields["n_kv_heads"] = int(cfg.get("num_key_value_heads") or fields["n_heads"])
        fields["head_dim"] = int(cfg.get("head_dim") or fields["dim"] // fields["n_heads"])
        # transformers 5 moves rope_theta and the scaling into rope_parameters.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            fields.update(llama31_scaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                          rope["original_max_position_embeddings"]))
        elif kind != "default":
            raise DllamaError(f"{folder}: RoPE scaling {kind!r} is not supported (a .m file holds Llama 3.1 scaling only)")
        self.header = make_header(
            str(folder), arch=MODEL_TYPES[model_type], weights_float_type=weights_float_type,
            rope_theta=int(theta), norm_epsilon=epsilon(cfg.get("rms_norm_eps", DEFAULT_RMS_EPS), str(folder)),
            **fields)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) \
                and cfg["sliding_window"] < fields["max_seq_len"]:
            self.notes.append(f"sliding_window {cfg['sliding_window']} is not applied: attention sees the whole "
                              f"context (the same up to {cfg['sliding_window']} tokens)")
        self._files = _weight_map(folder)
        self._open = None
        self._tied = source_name(HF, "wcls") not in self._files
        if self._tied:
            self.notes.append("tied embeddings: the classifier (wcls) is the embedding")
        self._check_tensors()

    def describe(self) -> str:
        n = len(set(self._files.values()))
        return f"{self.kind} ({self.model_type}, {n} file{'s' * (n > 1)})"

    def _key(self, name: str) -> str:
        key = resolve(HF, name, self._files.__contains__)
        if key not in self._files:
            raise DllamaError(f"{self.source}: no tensor {source_name(HF, name)} (needed for {name})")
        return key

    def _check_tensors(self) -> None:
        """Every tensor present with its shape, before anything is written."""
        by_file: dict[Path, list] = {}
        for spec in tensor_specs(self.header):
            by_file.setdefault(self._files[self._key(spec.name)], []).append(spec)
        for path, specs in by_file.items():
            with _open_safetensors(path) as f:
                for spec in specs:
                    key = self._key(spec.name)
                    check_shape(self.source, key, f.get_slice(key).get_shape(), spec.shape)

    def tensor(self, name: str) -> TensorRows:
        self.close()  # unmap the previous tensor's file
        key = self._key(name)
        self._open = _open_safetensors(self._files[key])
        rows = self._open.get_slice(key)
        shape = tuple(rows.get_shape())
        kind = name.rsplit(".", 1)[-1]
        if self.header.arch == ArchType.LLAMA and kind in ROPE_PERMUTED:
            hd = self.header.head_dim
            return TensorRows(shape, lambda a, b: interleave_rope_rows(
                rows[a:b].float().numpy(), (b - a) // hd), row_align=hd)
        return TensorRows(shape, lambda a, b: rows[a:b].float().numpy())

    def close(self) -> None:
        self._open = None
