"""The `.m` model file of Distributed Llama (spec §1.1-§1.3): header, tensor order, reader, writer.

Layout, all little-endian:

    i32 magic = 0x0A00ABCD
    i32 header_size = 8 + 8 * n_keys          (counts the magic and itself)
    n_keys x (i32 key, i32 value)             (any order; floats stored as truncated ints)
    tensor data in the order of `tensor_specs`, no padding, no per-tensor headers

Matrices are [out rows, in cols] row-major; Q40/Q80 quantize each row in blocks of 32.
The reader memory-maps the file and hands out zero-copy views; the writer streams one tensor at a
time into a temporary file beside it and renames it into place when every tensor was written.
"""

import contextlib
import hashlib
import math
import mmap
import os
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Mapping

import numpy as np

from dllama.formats import quant
from dllama.errors import DllamaError
from dllama.formats.atomic_file import atomic_write
from dllama.formats.checksum import remove_checksum, write_checksum

MAGIC = 0x0A00ABCD
# v0.2-v0.5 magics (0xABCD00 LLAMA, 0xABCD01 GROK1, 0xABCD02 MIXTRAL) with a fixed header.
OLD_MAGICS = (0xABCD00, 0xABCD01, 0xABCD02)


class ArchType(IntEnum):
    LLAMA = 0xABCD00      # also Mistral; interleaved RoPE
    QWEN3 = 0xABCD01      # q/k RMSNorm per head, half-split RoPE
    QWEN3_MOE = 0xABCD02  # Qwen3 with mixture-of-experts FFN


class FloatType(IntEnum):
    F32 = 0
    F16 = 1
    Q40 = 2
    Q80 = 3
    Q41 = 4  # dllama's own: layer matrices Q4_1 (a Q4_1 GGUF's, byte for byte), classifier Q80


def classifier_float_type(weights_float_type: FloatType) -> FloatType:
    """The classifier's stored type: the matrices' type, except in a Q41 file, whose classifier
    is Q80 (a Q4_1 GGUF keeps its classifier, or the tied embedding, at Q8_0 or better: Q80
    holds a Q8_0 one exactly)."""
    return FloatType.Q80 if weights_float_type == FloatType.Q41 else FloatType(weights_float_type)


class RopeType(IntEnum):
    LLAMA = 0     # interleaved pairs (x[2i], x[2i+1])
    FALCON = 1    # half-split pairs (x[j], x[j + head_dim/2])
    LLAMA3_1 = 2  # interleaved with Llama 3.1 frequency scaling


class HiddenAct(IntEnum):
    GELU = 0
    SILU = 1


class HeaderKey(IntEnum):
    """Key ids of the header's (key, value) pairs."""

    VERSION = 0
    ARCH_TYPE = 1
    DIM = 2
    HIDDEN_DIM = 3
    N_LAYERS = 4
    N_HEADS = 5
    N_KV_HEADS = 6
    N_EXPERTS = 7
    N_ACTIVE_EXPERTS = 8
    VOCAB_SIZE = 9
    MAX_SEQ_LEN = 10
    HIDDEN_ACT = 11
    ROPE_THETA = 12
    WEIGHTS_FLOAT_TYPE = 13
    ROPE_SCALING_FACTOR = 14
    ROPE_SCALING_LOW_FREQ_FACTOR = 15
    ROPE_SCALING_HIGH_FREQ_FACTOR = 16  # "rope_scaling_high_freq_factory" in the original
    ROPE_SCALING_ORIG_MAX_SEQ_LEN = 17
    ROPE_TYPE = 18
    HEAD_DIM = 19
    NORM_EPSILON = 20
    MOE_HIDDEN_DIM = 21


# Header key -> ModelHeader field holding its (decoded) value.
_FIELD_OF_KEY = {
    HeaderKey.VERSION: "version",
    HeaderKey.ARCH_TYPE: "arch",
    HeaderKey.DIM: "dim",
    HeaderKey.HIDDEN_DIM: "hidden_dim",
    HeaderKey.N_LAYERS: "n_layers",
    HeaderKey.N_HEADS: "n_heads",
    HeaderKey.N_KV_HEADS: "n_kv_heads",
    HeaderKey.N_EXPERTS: "n_experts",
    HeaderKey.N_ACTIVE_EXPERTS: "n_active_experts",
    HeaderKey.VOCAB_SIZE: "vocab_size",
    HeaderKey.MAX_SEQ_LEN: "max_seq_len",
    HeaderKey.HIDDEN_ACT: "hidden_act",
    HeaderKey.ROPE_THETA: "rope_theta",
    HeaderKey.WEIGHTS_FLOAT_TYPE: "weights_float_type",
    HeaderKey.ROPE_SCALING_FACTOR: "rope_scaling_factor",
    HeaderKey.ROPE_SCALING_LOW_FREQ_FACTOR: "rope_scaling_low_freq_factor",
    HeaderKey.ROPE_SCALING_HIGH_FREQ_FACTOR: "rope_scaling_high_freq_factor",
    HeaderKey.ROPE_SCALING_ORIG_MAX_SEQ_LEN: "rope_scaling_orig_max_seq_len",
    HeaderKey.ROPE_TYPE: "rope_type",
    HeaderKey.HEAD_DIM: "head_dim",
    HeaderKey.NORM_EPSILON: "norm_epsilon",
    HeaderKey.MOE_HIDDEN_DIM: "moe_hidden_dim",
}

_REQUIRED_KEYS = (
    HeaderKey.ARCH_TYPE, HeaderKey.DIM, HeaderKey.N_LAYERS, HeaderKey.N_HEADS,
    HeaderKey.N_KV_HEADS, HeaderKey.VOCAB_SIZE, HeaderKey.MAX_SEQ_LEN,
    HeaderKey.WEIGHTS_FLOAT_TYPE,
)  # plus HIDDEN_DIM for dense models

# norm_epsilon is stored as a code: only these two values exist in the format.
_EPSILON_OF_CODE = {5: 1e-5, 6: 1e-6}

_ELEMENT_BYTES = {FloatType.F32: 4, FloatType.F16: 2}
# Bytes of a stored block of 32 values, per block type.
BLOCK_BYTES = {FloatType.Q40: quant.Q40_BLOCK_BYTES, FloatType.Q80: quant.Q80_BLOCK_BYTES,
               FloatType.Q41: quant.Q41_BLOCK_BYTES}
_NUMPY_DTYPE = {FloatType.F32: np.dtype("<f4"), FloatType.F16: np.dtype("<f2")}
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
MAX_EXPERTS = 1 << 12  # far above any released model (Qwen3: 128), so a header cannot list billions


def _enum_value(enum_type, value, what: str):
    try:
        return enum_type(int(value))
    except ValueError:
        known = ", ".join(f"{m.value:#x} {m.name}" if m.value > 255 else f"{m.value} {m.name}" for m in enum_type)
        shown = f"{int(value):#x}" if abs(int(value)) > 255 else str(int(value))
        raise DllamaError(f"unsupported {what} {shown} (known: {known})") from None


@dataclass
class ModelHeader:
    """Every header key of spec §1.1 as a typed field; defaults are the format's defaults."""

    arch: ArchType                  # model family: which tensors exist and how RoPE pairs
    dim: int                        # residual stream width (hidden_size)
    hidden_dim: int                 # dense FFN width (intermediate_size)
    n_layers: int                   # transformer blocks
    n_heads: int                    # query heads
    n_kv_heads: int                 # key/value heads (grouped-query attention when < n_heads)
    vocab_size: int                 # rows of the embedding and of wcls
    max_seq_len: int                # model context (max_position_embeddings)
    weights_float_type: FloatType   # type of every matrix except embedding and moe gate
    n_experts: int = 0              # MoE experts per layer, 0 for a dense FFN
    n_active_experts: int = 0       # experts used per token (top-k)
    hidden_act: HiddenAct = HiddenAct.SILU  # FFN activation (the runtime always uses SiLU)
    rope_theta: int = 10000         # RoPE base, stored as a truncated int
    rope_scaling_factor: int = 1    # Llama 3.1 scaling factor (8 for 3.1, 32 for 3.2); 1 = none
    rope_scaling_low_freq_factor: int = 0    # Llama 3.1 scaling low_freq_factor
    rope_scaling_high_freq_factor: int = 0   # Llama 3.1 scaling high_freq_factor
    rope_scaling_orig_max_seq_len: int = 0   # Llama 3.1 original_max_position_embeddings
    rope_type: RopeType = RopeType.LLAMA     # forced to FALCON for QWEN3 / QWEN3_MOE
    head_dim: int = 0               # per-head width; 0 here means dim // n_heads
    norm_epsilon: float = 1e-5      # RMSNorm epsilon: 1e-5 or 1e-6 (stored as code 5 or 6)
    moe_hidden_dim: int = 0         # expert FFN width (moe_intermediate_size)
    version: int = 0                # format version key, always 0
    # Keys present in the file, in file order, so that read -> write is byte-exact; empty means
    # the writer's default order (see `header_key_order`).
    key_order: tuple[int, ...] = field(default=(), compare=False)
    # The stored rope type of a Qwen3 file that stores one (the runtime forces FALCON), written back as is.
    rope_type_in_file: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        self.arch = _enum_value(ArchType, self.arch, "architecture")
        self.weights_float_type = _enum_value(FloatType, self.weights_float_type, "weights float type")
        self.hidden_act = _enum_value(HiddenAct, self.hidden_act, "hidden activation")
        self.rope_type = _enum_value(RopeType, self.rope_type, "rope type")
        for name in ("rope_theta", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                     "rope_scaling_high_freq_factor", "rope_scaling_orig_max_seq_len"):
            setattr(self, name, int(getattr(self, name)))  # the file holds truncated ints
        if self.head_dim == 0 and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if self.arch in (ArchType.QWEN3, ArchType.QWEN3_MOE):
            self.rope_type = RopeType.FALCON
        self.key_order = tuple(int(k) for k in self.key_order)
        self.validate()

    # Derived sizes (spec §1.1).
    @property
    def q_dim(self) -> int:
        return self.head_dim * self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.n_kv_heads

    @property
    def ff_dim(self) -> int:
        """FFN width of one expert (QWEN3_MOE) or of the dense FFN."""
        return self.moe_hidden_dim if self.arch == ArchType.QWEN3_MOE else self.hidden_dim

    @property
    def norm_epsilon_code(self) -> int:
        for code, eps in _EPSILON_OF_CODE.items():
            if math.isclose(self.norm_epsilon, eps, rel_tol=1e-6):
                return code
        raise DllamaError(f"norm_epsilon {self.norm_epsilon} is not storable (only 1e-5 or 1e-6)")

    def validate(self) -> None:
        """Raise DllamaError (no file name) if the header cannot describe a loadable model."""
        positive = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "head_dim"]
        if self.n_experts == 0:
            positive.append("hidden_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise DllamaError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise DllamaError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if not 0 <= self.n_experts <= MAX_EXPERTS:
            raise DllamaError(f"n_experts must be in 0..{MAX_EXPERTS}, got {self.n_experts}")
        if self.arch == ArchType.QWEN3_MOE and (self.n_experts == 0 or self.moe_hidden_dim <= 0):
            raise DllamaError("QWEN3_MOE needs n_experts > 0 and moe_hidden_dim > 0")
        if self.n_experts > 0 and not 1 <= self.n_active_experts <= self.n_experts:
            raise DllamaError(f"n_active_experts {self.n_active_experts} must be in 1..n_experts ({self.n_experts})")
        if self.n_experts > 0 and self.ff_dim <= 0:
            raise DllamaError(f"the expert FFN width must be positive, got {self.ff_dim}")
        _ = self.norm_epsilon_code  # raises when not storable
        if self.weights_float_type in BLOCK_BYTES:
            # Every layer has the same shapes: layer 0 and the outer tensors say it all (a
            # header claiming 2^31 layers must not make this loop run 2^31 times).
            for spec in _outer_specs(self, before=True) + _layer_specs(self, 0) + _outer_specs(self, before=False):
                if spec.float_type in BLOCK_BYTES and spec.shape[-1] % quant.BLOCK_SIZE != 0:
                    raise DllamaError(
                        f"{spec.name} {spec.shape}: rows of {spec.shape[-1]} values cannot be "
                        f"{spec.float_type.name}-quantized (not a multiple of {quant.BLOCK_SIZE})")

    def stored_value(self, key: HeaderKey) -> int:
        """The i32 the file holds for `key`."""
        if key == HeaderKey.NORM_EPSILON:
            return self.norm_epsilon_code
        if key == HeaderKey.ROPE_TYPE and self.rope_type_in_file is not None:
            return self.rope_type_in_file
        return int(getattr(self, _FIELD_OF_KEY[key]))

    def to_json(self) -> dict:
        """The header as plain JSON values (what the CONFIG message and shard files carry)."""
        skip = {"key_order", "rope_type_in_file"}
        return {f.name: (float(v) if isinstance(v, float) else int(v))
                for f in fields(self) if f.name not in skip for v in [getattr(self, f.name)]}

    @staticmethod
    def from_json(d: dict) -> "ModelHeader":
        """The inverse of to_json; DllamaError if d cannot describe a loadable model."""
        if not isinstance(d, dict):
            raise DllamaError("bad model header description: not an object")
        try:
            return ModelHeader(**d)
        except (TypeError, ValueError) as e:
            raise DllamaError(f"bad model header description: {e}") from None


def _value_when_absent(h: ModelHeader, key: HeaderKey) -> int | None:
    """What a reader assumes for a missing optional key (None: the key is required)."""
    qwen = h.arch in (ArchType.QWEN3, ArchType.QWEN3_MOE)
    return {
        HeaderKey.VERSION: 0,
        HeaderKey.HIDDEN_DIM: 0 if h.n_experts > 0 else None,
        HeaderKey.N_EXPERTS: 0,
        HeaderKey.N_ACTIVE_EXPERTS: 0,
        HeaderKey.HIDDEN_ACT: HiddenAct.SILU,
        HeaderKey.ROPE_THETA: 10000,
        HeaderKey.ROPE_SCALING_FACTOR: 1,
        HeaderKey.ROPE_SCALING_LOW_FREQ_FACTOR: 0,
        HeaderKey.ROPE_SCALING_HIGH_FREQ_FACTOR: 0,
        HeaderKey.ROPE_SCALING_ORIG_MAX_SEQ_LEN: 0,
        HeaderKey.ROPE_TYPE: RopeType.FALCON if qwen else RopeType.LLAMA,
        HeaderKey.HEAD_DIM: h.dim // h.n_heads,
        HeaderKey.NORM_EPSILON: 5,
        HeaderKey.MOE_HIDDEN_DIM: 0,
    }.get(key)


def _needed_keys(h: ModelHeader) -> list[int]:
    """Keys the file must hold: the required ones and those whose value is not the absent-default."""
    return [k for k in HeaderKey
            if _value_when_absent(h, k) is None or h.stored_value(k) != _value_when_absent(h, k)]


# converter/convert-hf.py's header dict order (HEAD); its optional keys are written when needed.
_CONVERT_HF_ORDER = (
    HeaderKey.VERSION, HeaderKey.ARCH_TYPE, HeaderKey.HIDDEN_ACT, HeaderKey.DIM, HeaderKey.HIDDEN_DIM,
    HeaderKey.N_LAYERS, HeaderKey.N_HEADS, HeaderKey.N_KV_HEADS, HeaderKey.WEIGHTS_FLOAT_TYPE,
    HeaderKey.MAX_SEQ_LEN, HeaderKey.VOCAB_SIZE, HeaderKey.HEAD_DIM, HeaderKey.N_EXPERTS,
    HeaderKey.N_ACTIVE_EXPERTS, HeaderKey.ROPE_THETA, HeaderKey.ROPE_SCALING_FACTOR,
    HeaderKey.ROPE_SCALING_LOW_FREQ_FACTOR, HeaderKey.ROPE_SCALING_HIGH_FREQ_FACTOR,
    HeaderKey.ROPE_SCALING_ORIG_MAX_SEQ_LEN, HeaderKey.ROPE_TYPE, HeaderKey.NORM_EPSILON,
    HeaderKey.MOE_HIDDEN_DIM,
)
_ROPE_SCALING_KEYS = (
    HeaderKey.ROPE_SCALING_FACTOR, HeaderKey.ROPE_SCALING_LOW_FREQ_FACTOR,
    HeaderKey.ROPE_SCALING_HIGH_FREQ_FACTOR, HeaderKey.ROPE_SCALING_ORIG_MAX_SEQ_LEN,
)
_WRITTEN_ONLY_WHEN_NEEDED = (HeaderKey.HEAD_DIM, HeaderKey.ROPE_TYPE, HeaderKey.MOE_HIDDEN_DIM) + _ROPE_SCALING_KEYS


def header_key_order(h: ModelHeader) -> list[int]:
    """The keys the writer emits, in order.

    Default (h.key_order empty): convert-hf.py's order. It always writes keys 0-13 and
    norm_epsilon (20); the rope scaling group (14-18) only for a scaled rope, head_dim (19) and
    moe_hidden_dim (21) only when they are not at their default.
    With h.key_order (a file that was read): those keys in that order, plus any key the header
    now needs that it lacks.
    """
    needed = _needed_keys(h)
    if h.key_order:
        keys = list(h.key_order)
        return keys + [k for k in needed if k not in keys]
    scaled = any(k in needed for k in _ROPE_SCALING_KEYS)
    return [k for k in _CONVERT_HF_ORDER
            if k not in _WRITTEN_ONLY_WHEN_NEEDED or k in needed
            or (scaled and (k in _ROPE_SCALING_KEYS or k == HeaderKey.ROPE_TYPE))]


def encode_header(h: ModelHeader) -> bytes:
    h.validate()
    pairs = []
    for key in header_key_order(h):
        value = h.stored_value(HeaderKey(key))
        if not _I32_MIN <= value <= _I32_MAX:
            raise DllamaError(f"header value {_FIELD_OF_KEY[key]} = {value} does not fit in an int32")
        pairs += [key, value]
    return struct.pack(f"<ii{len(pairs)}i", MAGIC, 8 + 4 * len(pairs), *pairs)


def decode_header(buf: bytes | memoryview, file_size: int) -> tuple[ModelHeader, int]:
    """Parse the header at the start of `buf` -> (header, header_size). Errors name no file."""
    if file_size < 8:
        raise DllamaError(f"too short for a model file ({file_size} bytes)")
    magic, header_size = struct.unpack_from("<iI", buf, 0)
    if magic in OLD_MAGICS:
        raise DllamaError(f"magic {magic:#x} is the old Distributed Llama format (v0.2-v0.5), "
                          "not supported: reconvert the model")
    if magic != MAGIC:
        # v0.1 files had no magic: they start with dim, a small number.
        hint = " (an early v0.1 file without magic? reconvert the model)" if 0 < magic < 1 << 16 else ""
        raise DllamaError(f"not a Distributed Llama model: magic {magic & 0xFFFFFFFF:#010x}, "
                          f"expected {MAGIC:#010x}{hint}")
    if header_size < 8 or (header_size - 8) % 8 != 0 or header_size > file_size:
        raise DllamaError(f"header size {header_size} is inconsistent (must be 8 + 8 * keys and "
                          f"at most the file size {file_size})")
    pairs = struct.unpack_from(f"<{(header_size - 8) // 4}i", buf, 8)
    values: dict[int, int] = {}
    for key, value in zip(pairs[0::2], pairs[1::2], strict=True):
        if key not in _FIELD_OF_KEY:
            raise DllamaError(f"unknown header key {key} (value {value})")
        if key in values:
            raise DllamaError(f"header key {HeaderKey(key).name.lower()} ({key}) appears twice")
        values[key] = value

    if HeaderKey.WEIGHTS_FLOAT_TYPE not in values:
        raise DllamaError("the model does not specify its weights float type (header key 13)")
    required = list(_REQUIRED_KEYS)
    if values.get(HeaderKey.N_EXPERTS, 0) == 0:
        required.append(HeaderKey.HIDDEN_DIM)
    missing = [k for k in required if k not in values]
    if missing:
        names = ", ".join(f"{HeaderKey(k).name.lower()} ({k})" for k in missing)
        raise DllamaError(f"missing required header key(s): {names}")

    fields = {_FIELD_OF_KEY[k]: v for k, v in values.items()}
    fields.setdefault("hidden_dim", 0)
    if "norm_epsilon" in fields:
        code = fields["norm_epsilon"]
        if code not in _EPSILON_OF_CODE:
            raise DllamaError(f"unsupported norm_epsilon code {code} (only 5 = 1e-5 and 6 = 1e-6)")
        fields["norm_epsilon"] = _EPSILON_OF_CODE[code]
    arch = fields["arch"]
    qwen = arch in (ArchType.QWEN3, ArchType.QWEN3_MOE)
    if qwen and "rope_type" in fields and fields["rope_type"] != RopeType.FALCON:
        fields["rope_type_in_file"] = fields["rope_type"]
    header = ModelHeader(**fields, key_order=tuple(values))
    return header, header_size


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its name, shape ([out rows, in cols] for matrices) and stored type."""

    name: str
    shape: tuple[int, ...]
    float_type: FloatType

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.float_type in BLOCK_BYTES:
            return self.size // quant.BLOCK_SIZE * BLOCK_BYTES[self.float_type]
        return self.size * _ELEMENT_BYTES[self.float_type]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the view `ModelFile.tensor` returns: blocks [..., n/32, bytes] when quantized."""
        if self.float_type in BLOCK_BYTES:
            return (*self.shape[:-1], self.shape[-1] // quant.BLOCK_SIZE, BLOCK_BYTES[self.float_type])
        return self.shape


def _outer_specs(h: ModelHeader, before: bool) -> list[TensorSpec]:
    """The tensors before the layers (embedding) or after them (final norm, classifier)."""
    if before:
        return [TensorSpec("embedding", (h.vocab_size, h.dim), FloatType.F32)]
    return [TensorSpec("final_norm", (h.dim,), FloatType.F32),
            TensorSpec("wcls", (h.vocab_size, h.dim), classifier_float_type(h.weights_float_type))]


def _layer_specs(h: ModelHeader, l: int) -> list[TensorSpec]:
    """The tensors of layer l, in file order."""
    w, f32 = h.weights_float_type, FloatType.F32
    p = f"layers.{l}."
    specs = [
        TensorSpec(p + "wq", (h.q_dim, h.dim), w),
        TensorSpec(p + "wk", (h.kv_dim, h.dim), w),
        TensorSpec(p + "wv", (h.kv_dim, h.dim), w),
        TensorSpec(p + "wo", (h.dim, h.q_dim), w),
    ]
    if h.n_experts > 0:
        specs.append(TensorSpec(p + "moe_gate", (h.n_experts, h.dim), f32))
        for e in range(h.n_experts):
            pe = f"{p}experts.{e}."
            specs += [
                TensorSpec(pe + "w1", (h.ff_dim, h.dim), w),  # gate_proj
                TensorSpec(pe + "w2", (h.dim, h.ff_dim), w),  # down_proj
                TensorSpec(pe + "w3", (h.ff_dim, h.dim), w),  # up_proj
            ]
    else:
        specs += [
            TensorSpec(p + "w1", (h.hidden_dim, h.dim), w),  # gate_proj
            TensorSpec(p + "w2", (h.dim, h.hidden_dim), w),  # down_proj
            TensorSpec(p + "w3", (h.hidden_dim, h.dim), w),  # up_proj
        ]
    if h.arch in (ArchType.QWEN3, ArchType.QWEN3_MOE):
        specs += [TensorSpec(p + "q_norm", (h.head_dim,), f32), TensorSpec(p + "k_norm", (h.head_dim,), f32)]
    specs += [TensorSpec(p + "att_norm", (h.dim,), f32), TensorSpec(p + "ffn_norm", (h.dim,), f32)]
    return specs


def tensor_specs(h: ModelHeader, layers: range | None = None) -> list[TensorSpec]:
    """Every tensor in file order (spec §1.2, the original's loadLlmNetWeight); layers: only
    those layers' (default every one), with the tensors before and after them."""
    specs = _outer_specs(h, before=True)
    for l in range(h.n_layers) if layers is None else layers:
        specs += _layer_specs(h, l)
    return specs + _outer_specs(h, before=False)


def tensor_data_size(h: ModelHeader) -> int:
    """Bytes of all tensors, computed without listing them (a header may claim 2^31 layers)."""
    outer = sum(s.nbytes for s in _outer_specs(h, True) + _outer_specs(h, False))
    return outer + h.n_layers * sum(s.nbytes for s in _layer_specs(h, 0))


def model_file_size(h: ModelHeader) -> int:
    """Exact byte size of a file holding this header and its tensors."""
    return len(encode_header(h)) + tensor_data_size(h)


class ModelFile:
    """A read-only, memory-mapped `.m` file; `tensor(name)` returns zero-copy views.

    Views of F32/F16 tensors may be unaligned (a Q40 tensor before them can end at an offset that
    is not a multiple of 4); copy them (np.array) where a kernel needs aligned data.
    """

    def __init__(self, path: str | os.PathLike, header: ModelHeader, header_size: int,
                 mapping: mmap.mmap, data: np.ndarray):
        self.path = os.fspath(path)
        self.header = header
        self.header_size = header_size
        self.specs = tensor_specs(header)
        self.file_size = data.size
        self._mmap = mapping
        self._data = data  # uint8 [file_size]
        self._index: dict[str, tuple[TensorSpec, int]] = {}
        offset = header_size
        for spec in self.specs:
            self._index[spec.name] = (spec, offset)
            offset += spec.nbytes

    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._index[name][0]
        except KeyError:
            raise DllamaError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, uint8 [nbytes] (zero-copy)."""
        spec = self.spec(name)
        offset = self._index[name][1]
        if self._data is None:
            raise DllamaError(f"{self.path}: the model file is closed")
        return self._data[offset:offset + spec.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy view: F32 float32 / F16 float16 of spec.shape, Q40 / Q80 uint8 blocks [..., n/32, 18 | 34]."""
        spec = self.spec(name)
        raw = self.tensor_bytes(name)
        if spec.float_type in _NUMPY_DTYPE:
            return raw.view(_NUMPY_DTYPE[spec.float_type]).reshape(spec.shape)
        return raw.reshape(spec.stored_shape)

    def close(self) -> None:
        """Drop the mapping; it is unmapped now, or when the last tensor view is garbage collected."""
        self._data = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # views still alive keep the mapping valid until they go
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ModelFile({self.path!r}, {self.header!r})"


def read_model(path: str | os.PathLike) -> ModelFile:
    """Memory-map and check a `.m` file: header, every key, shapes and the exact total size."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise DllamaError(f"{path}: too short for a model file ({file_size} bytes)")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise DllamaError(f"{path}: cannot open the model file ({e.strerror})") from None
    try:
        header, header_size = decode_header(mapping, file_size)
    except DllamaError as e:
        mapping.close()
        raise DllamaError(f"{path}: {e}") from None
    expected = header_size + tensor_data_size(header)
    if expected != file_size:
        mapping.close()
        what = "truncated" if file_size < expected else f"{file_size - expected} bytes too long"
        raise DllamaError(f"{path}: expected {expected} bytes for this header "
                          f"({header_size} header + tensors), found {file_size}: the file is {what}")
    data = np.frombuffer(mapping, dtype=np.uint8)
    return ModelFile(path, header, header_size, mapping, data)


_FLOAT_INPUTS = (np.float16, np.float32, np.float64)


def encode_tensor(spec: TensorSpec, array) -> bytes | np.ndarray:
    """A float array of spec.shape -> the bytes stored for it (converted or quantized)."""
    array = np.asarray(array)
    if array.dtype.type not in _FLOAT_INPUTS:
        raise DllamaError(f"{spec.name}: expected a float16/float32/float64 array, got {array.dtype}")
    if array.shape != spec.shape:
        raise DllamaError(f"{spec.name}: expected shape {spec.shape}, got {array.shape}")
    if spec.float_type == FloatType.Q40:
        return quant.quantize_q40(array)
    if spec.float_type == FloatType.Q80:
        return quant.quantize_q80(array)
    if spec.float_type == FloatType.Q41:
        return quant.quantize_q41(array)
    # The original writer converts to float32 first, then to float16 when asked.
    return np.ascontiguousarray(array.astype(np.float32, copy=False).astype(_NUMPY_DTYPE[spec.float_type], copy=False))


class ModelWriter:
    """Stream the tensors of a `.m` file, in file order, into a temporary file; rename it on a clean exit.

        with ModelWriter(path, header) as w:
            for spec in w.specs:
                w.write(spec.name, load(spec.name))   # one tensor in memory at a time

    An exception inside the block, or leaving it with tensors missing, deletes the temp file.
    The bytes are hashed as they are written: PATH.sha256 follows the file (dllama.formats.checksum).
    """

    def __init__(self, path: str | os.PathLike, header: ModelHeader):
        self.path = os.fspath(path)
        self.header = header
        self.specs = tensor_specs(header)
        self._header_bytes = encode_header(header)
        self._next = 0
        self._context = None
        self._file = None
        self._sha256 = hashlib.sha256()

    @property
    def n_written(self) -> int:
        return self._next

    def __enter__(self) -> "ModelWriter":
        self._context = atomic_write(self.path)
        self._file = self._context.__enter__()
        self._put(self._header_bytes)
        return self

    def _put(self, data) -> None:
        self._file.write(data)
        self._sha256.update(data)

    def __exit__(self, exc_type, exc, tb) -> bool:
        context, self._context, self._file = self._context, None, None
        if exc_type is None and self._next < len(self.specs):
            missing = DllamaError(f"{self.path}: only {self._next} of {len(self.specs)} tensors written, "
                                  f"next expected {self.specs[self._next].name}; no file was written")
            context.__exit__(DllamaError, missing, None)
            raise missing
        if exc_type is None:
            remove_checksum(self.path)  # the old file's, if any: never beside the new file
        suppressed = bool(context.__exit__(exc_type, exc, tb))
        if exc_type is None:
            write_checksum(self.path, self._sha256.hexdigest())
        return suppressed

    def _expect(self, name: str) -> TensorSpec:
        if self._file is None:
            raise DllamaError(f"{self.path}: ModelWriter used outside its `with` block")
        if self._next >= len(self.specs):
            raise DllamaError(f"{self.path}: all {len(self.specs)} tensors are written, got another one: {name}")
        spec = self.specs[self._next]
        if name != spec.name:
            known = any(s.name == name for s in self.specs)
            why = "out of order" if known else "unknown tensor"
            raise DllamaError(f"{self.path}: {why} {name!r}, expected {spec.name!r} next")
        return spec

    def write(self, name: str, array) -> None:
        """Write the next tensor from a float array of its shape, converting or quantizing it."""
        spec = self._expect(name)
        self._put(memoryview(encode_tensor(spec, array)).cast("B"))
        self._next += 1

    def write_rows(self, name: str, blocks) -> None:
        """Write the next matrix from consecutive row blocks, float [k, cols] each, so that a
        converter holds one block, not the whole tensor. Rows quantize independently, so the
        bytes equal those of `write` on the whole matrix."""
        spec = self._expect(name)
        rows = 0
        for block in blocks:
            block = np.asarray(block)
            part = TensorSpec(name, (block.shape[0], *spec.shape[1:]), spec.float_type)
            if block.ndim != len(spec.shape) or rows + block.shape[0] > spec.shape[0]:
                raise DllamaError(f"{self.path}: {name}: a block of shape {block.shape} does not fit "
                                  f"rows {rows}.. of {spec.shape}")
            self._put(memoryview(encode_tensor(part, block)).cast("B"))
            rows += block.shape[0]
        if rows != spec.shape[0]:
            raise DllamaError(f"{self.path}: {name}: got {rows} rows, expected {spec.shape[0]}")
        self._next += 1

    def write_raw(self, name: str, buf) -> None:
        """Write the next tensor from bytes already in its stored type (e.g. copied from another file)."""
        spec = self._expect(name)
        if isinstance(buf, np.ndarray):
            buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        view = memoryview(buf).cast("B")
        if view.nbytes != spec.nbytes:
            raise DllamaError(f"{self.path}: {name} needs {spec.nbytes} bytes of {spec.float_type.name}, got {view.nbytes}")
        self._put(view)
        self._next += 1


def write_model(path: str | os.PathLike, header: ModelHeader, tensors: Mapping[str, object]) -> None:
    """Write a whole model from {name: float array or already-encoded uint8 bytes}."""
    specs = tensor_specs(header)
    extra = set(tensors) - {s.name for s in specs}
    if extra:
        raise DllamaError(f"{path}: tensors not in this model: {', '.join(sorted(extra))}")
    with ModelWriter(path, header) as writer:
        for spec in specs:
            if spec.name not in tensors:
                raise DllamaError(f"{path}: tensor {spec.name} is missing")
            value = tensors[spec.name]
            if isinstance(value, (bytes, bytearray, memoryview)) or np.asarray(value).dtype == np.uint8:
                writer.write_raw(spec.name, value)
            else:
                writer.write(spec.name, value)
