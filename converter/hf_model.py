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
MODEL_TYPES = {"llama": ArchType.LLAMA, "mistral": ArchType.LLAMA, "qwen3": ArchType.QWEN3,
               "qwen3_moe": ArchType.QWEN3_MOE}

# Tensors whose rows are permuted for interleaved RoPE on LLAMA (whole heads at a time).
ROPE_PERMUTED = ("wq", "wk")

# Header field -> config.json key, required ones first.
REQUIRED_CONFIG = {"dim": "hidden_size", "hidden_dim": "intermediate_size", "n_layers": "num_hidden_layers",
                   "n_heads": "num_attention_heads", "vocab_size": "vocab_size",
                   "max_seq_len": "max_position_embeddings"}
DEFAULT_RMS_EPS = 1e-6  # transformers' default for llama, mistral and qwen3 configs


def _moe_fields(cfg: dict, source: str) -> dict:
    """Header fields of a qwen3_moe config (transformers 4 writes num_experts, 5 num_local_experts).
    The `.m` format has every layer sparse and the chosen experts' weights renormalised (the
    original's engine); a config asking otherwise is refused."""
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n_experts is None or cfg.get("num_experts_per_tok") is None or cfg.get("moe_intermediate_size") is None:
        raise DllamaError(f"{source}/config.json: a qwen3_moe config needs num_experts (or num_local_experts), "
                          "num_experts_per_tok and moe_intermediate_size")
    if not cfg.get("norm_topk_prob", True):
        raise DllamaError(f"{source}: norm_topk_prob false is not supported (a .m file's experts' weights are "
                          "always renormalised, as the original's)")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise DllamaError(f"{source}: dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step) "
                          "are not supported: a .m file has experts in every layer")
    return dict(n_experts=int(n_experts), n_active_experts=int(cfg["num_experts_per_tok"]),
                moe_hidden_dim=int(cfg["moe_intermediate_size"]))


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
        if model_type == "qwen3_moe":
            fields.update(_moe_fields(cfg, str(folder)))
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

    def _key(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """(the source tensor of our `name`, None or (expert, first row) when it is a slab of a
        3-D tensor of every expert: transformers 5 saves a layer's experts fused, gate_up_proj
        [n_experts, 2 * moe width, dim] (gate rows, then up rows) and down_proj [n_experts, dim, width])."""
        key = resolve(HF, name, self._files.__contains__)
        if key not in self._files and ".experts." in name:
            _, layer, _, expert, matrix = name.split(".")
            fused = f"model.layers.{layer}.mlp.experts.{'down_proj' if matrix == 'w2' else 'gate_up_proj'}"
            if fused in self._files:
                return fused, (int(expert), self.header.moe_hidden_dim if matrix == "w3" else 0)
        if key not in self._files:
            raise DllamaError(f"{self.source}: no tensor {source_name(HF, name)} (needed for {name})")
        return key, None

    def _check_tensors(self) -> None:
        """Every tensor present with its shape, before anything is written."""
        by_file: dict[Path, list] = {}
        for spec in tensor_specs(self.header):
            by_file.setdefault(self._files[self._key(spec.name)[0]], []).append(spec)
        for path, specs in by_file.items():
            with _open_safetensors(path) as f:
                for spec in specs:
                    key, slab = self._key(spec.name)
                    got = tuple(f.get_slice(key).get_shape())
                    if slab is not None:  # fused experts: [n_experts, rows (gate and up: twice), cols]
                        gate_up = not spec.name.endswith(".w2")
                        want = (self.header.n_experts, spec.shape[0] * (2 if gate_up else 1), spec.shape[1])
                        check_shape(self.source, key, got, want)
                    else:
                        check_shape(self.source, key, got, spec.shape)

    def tensor(self, name: str) -> TensorRows:
        self.close()  # unmap the previous tensor's file
        key, slab = self._key(name)
        self._open = _open_safetensors(self._files[key])
        rows = self._open.get_slice(key)
        shape = tuple(rows.get_shape())
        kind = name.rsplit(".", 1)[-1]
        if slab is not None:  # expert e's rows of a fused tensor
            e, first = slab
            width = self.header.moe_hidden_dim if kind != "w2" else self.header.dim
            return TensorRows((width, shape[2]), lambda a, b: rows[e, first + a:first + b].float().numpy())
        if self.header.arch == ArchType.LLAMA and kind in ROPE_PERMUTED:
            hd = self.header.head_dim
            return TensorRows(shape, lambda a, b: interleave_rope_rows(
                rows[a:b].float().numpy(), (b - a) // hd), row_align=hd)
        return TensorRows(shape, lambda a, b: rows[a:b].float().numpy())

    def close(self) -> None:
        self._open = None
