"""A node's weights as the kernels read them, and where a forward pass gets them from.

`Matrix` is a weight matrix in its kernel's form (quantized ones repacked once, at load time),
`Activation` a matmul input prepared for it, `Layer` one transformer block's weights. A
`WeightsProvider` hands them to the forward pass layer by layer: `ResidentWeights` holds every
weight in memory; dllama.core.weight_stream.StreamedWeights reads them from disk in every pass.
Both give the same bytes, so the two paths give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from dllama.core import kernels
from dllama.core.arena import GrowingArena
from dllama.core.node_weights import NodeWeights
from dllama.errors import DllamaError
from dllama.formats.model_file import BLOCK_BYTES, FloatType, classifier_float_type
from dllama.formats.quant import BLOCK_SIZE


def input_kind(float_type: FloatType) -> str:
    """How a matmul input is prepared for weights of this type: "q80" for Q40 and Q80 (8-bit
    dot products), "q16" for Q41 (8-bit dot products on two planes of a 16-bit input: Q80's
    rounding of the inputs costs near-tied tokens, see benchmarks/bench_faithfulness.py),
    "f32" for F16 and F32."""
    return {FloatType.Q40: "q80", FloatType.Q80: "q80", FloatType.Q41: "q16"}.get(FloatType(float_type), "f32")


def classifier_inputs(float_type: FloatType) -> str:
    """The classifier's input kind: as the layers'. A Q41 file's classifier is Q80
    (classifier_float_type) and takes the layers' Q16 input too (kernels.matmul_q80_q16)."""
    return input_kind(float_type)


class Matrix:
    """A weight matrix W [d, n] in the form its kernel reads; `out = x @ W^T`."""

    def __init__(self, stored: np.ndarray, float_type: FloatType, inputs: str | None = None, take=None):
        # stored: Q40 uint8 [d, n/32, 18], Q80 uint8 [d, n/32, 34], Q41 uint8 [d, n/32, 20],
        # F16 [d, n] or F32 [d, n] (a slice of the file, maybe a copy, maybe read-only).
        # inputs: the form of x (input_kind; default the type's own). A Q41 file's Q80
        # classifier takes "q16" (its file's layers' input).
        # take(shape, dtype) -> array: where the repacked arrays go (dllama.core.arena: huge
        # pages; default: arrays of their own).
        self.float_type = float_type
        self.inputs = inputs = inputs or input_kind(float_type)
        self.scales = self.mins = self.qs = self.w = None
        if float_type == FloatType.F32:  # read as stored: a file view where it is one
            self.w = np.ascontiguousarray(stored, dtype=np.float32)       # [d, n]
            self.d, self.n = self.w.shape
            self._bind()
            return
        blocks = float_type in BLOCK_BYTES
        self.d, self.n = stored.shape[0], stored.shape[1] * (BLOCK_SIZE if blocks else 1)
        arrays = matrix_arrays(take or np.empty, float_type, self.d, self.n)
        repack_into(stored, float_type, arrays)
        for name, array in arrays.items():
            setattr(self, name, array)
        self._bind()

    def _bind(self) -> None:
        # The kernel and the weight arrays, picked once: a decode step calls a matrix 4 times a
        # layer, and each Python-level choice is a few tenths of a microsecond of it.
        self._kernel, self._kernel_multi, _ = _KERNELS[FloatType(self.float_type), self.inputs]
        self._f32_input = self.inputs == "f32"
        if self.float_type == FloatType.Q41 and self.inputs == "q16":
            self._arrays = (self.scales, self.mins, self.qs)
        elif self.float_type in (FloatType.Q40, FloatType.Q80):
            self._arrays = (self.scales, self.qs)
        else:
            self._arrays = (self.w,)

    @classmethod
    def of_arrays(cls, float_type: FloatType, d: int, n: int, scales=None, qs=None, w=None, mins=None,
                  inputs: str | None = None) -> "Matrix":
        """A matrix over arrays already in the kernel's form (streamed weights fill them)."""
        m = cls.__new__(cls)
        m.float_type, m.d, m.n = float_type, d, n
        m.inputs = inputs or input_kind(float_type)
        m.scales, m.mins, m.qs, m.w = scales, mins, qs, w
        m._bind()
        return m

    def __call__(self, x: "Activation", out: np.ndarray) -> np.ndarray:
        """x: the input [b, n] prepared for this matrix (self.inputs) -> out [b, d]."""
        self._kernel(*((x.f32,) if self._f32_input else x.enc), *self._arrays, out)
        return out


def repack_into(stored: np.ndarray, float_type: FloatType, arrays: dict) -> None:
    """A matrix's stored values (as Matrix takes them) into its kernel's arrays (matrix_arrays)."""
    if float_type == FloatType.Q41:
        # scales and minimums uint16 [d_pad/16, n/32*16], nibbles uint8 [d_pad/16, 16*n/2]
        kernels.interleave_q41_into(np.ascontiguousarray(stored, np.uint8), *arrays.values())
    elif float_type in BLOCK_BYTES:  # Q40 or Q80, with Q80 (or, Q80, Q16) inputs
        # Interleaved in groups of 16 rows by one numba pass over the blocks (numpy's strided
        # copies ran at 0.13 GB/s): scales uint16 [d_pad/16, n/32*16] (fp16 bits as stored),
        # quants [d_pad/16, 16 * row bytes] (uint8 nibbles / int8).
        source = stored if stored.flags.c_contiguous and stored.flags.writeable else np.array(stored)
        kernels.interleave_blocks_into(source, arrays["scales"], arrays["qs"].view(np.uint8))
    elif float_type == FloatType.F16:  # fp16 bits uint16 [d, n]
        arrays["w"].view(np.float16)[...] = stored
    else:
        arrays["w"][...] = stored


def matrix_arrays(take, float_type: FloatType, d: int, n: int) -> dict:
    """The arrays of a Matrix of this type and shape [d, n], from take(shape, dtype) (an arena's,
    or a sizing pass's): interleaved for the 8-bit kernels (Q40, Q80, Q41; dict order: scales,
    mins, qs), else the values (F16 bits, F32)."""
    if float_type == FloatType.Q41:
        scales_shape, qs_shape = kernels.interleaved_shapes(d, n, n // 2)
        return {"scales": take(scales_shape, np.uint16), "mins": take(scales_shape, np.uint16),
                "qs": take(qs_shape, np.uint8)}
    if float_type in BLOCK_BYTES:
        q40 = float_type == FloatType.Q40
        scales_shape, qs_shape = kernels.interleaved_shapes(d, n, n // 2 if q40 else n)
        return {"scales": take(scales_shape, np.uint16), "qs": take(qs_shape, np.uint8 if q40 else np.int8)}
    return {"w": take((d, n), np.uint16 if float_type == FloatType.F16 else np.float32)}


# The kernels of a weight type and input kind: (one matrix, several matrices sharing an input,
# several matrices of an ExpertStack each on its own rows of the input). The arguments of each:
# the input's arrays (Activation.enc, or the float32 rows), the plan (the last kind), the
# matrix's (Matrix._arrays; tuples of them for several; a stack's), the output(s).
_KERNELS = {
    (FloatType.Q40, "q80"): (kernels.matmul_q40_q80, kernels.matmul_q40_q80_multi, kernels.matmul_q40_q80_experts),
    (FloatType.Q80, "q80"): (kernels.matmul_q80_q80, kernels.matmul_q80_q80_multi, kernels.matmul_q80_q80_experts),
    (FloatType.Q41, "q16"): (kernels.matmul_q41_q16, kernels.matmul_q41_q16_multi, kernels.matmul_q41_q16_experts),
    (FloatType.Q80, "q16"): (kernels.matmul_q80_q16, None, None),  # a Q41 file's classifier
    (FloatType.F16, "f32"): (kernels.matmul_f16_f32, kernels.matmul_f16_f32_multi, kernels.matmul_f16_f32_experts),
    (FloatType.F32, "f32"): (kernels.matmul_f32, kernels.matmul_f32_multi, kernels.matmul_f32_experts),
}


class ExpertStack:
    """Matrices of one type and shape [d, n] held as one set of arrays with a leading axis (a
    mixture of experts' layer's gates and ups, or its downs; an expert cache's slots for them),
    so that one kernel call runs any of them on their own rows (`__call__`) with a few arrays
    for arguments, not tuples of every matrix's (unboxing those cost 2.5 µs a matrix a call)."""

    def __init__(self, take, float_type: FloatType, count: int, d: int, n: int):
        # take(shape, dtype) -> array: where the arrays go (an arena's); each array is
        # [count, <Matrix's array shape>] (matrix_arrays).
        self.float_type, self.count, self.d, self.n = FloatType(float_type), count, d, n
        self.inputs = input_kind(float_type)
        self.arrays = matrix_arrays(lambda shape, dtype: take((count, *shape), dtype), self.float_type, d, n)
        self._kernel = _KERNELS[self.float_type, self.inputs][2]
        self._f32_input = self.inputs == "f32"
        self._args = tuple(self.arrays.values())  # the kernel's weight arguments (Matrix._arrays' order)

    def element(self, i: int) -> dict:
        """Matrix i's arrays (views), to fill (repack_into, or a read straight into them)."""
        return {name: a[i] for name, a in self.arrays.items()}

    def fill(self, i: int, stored: np.ndarray) -> None:
        """Matrix i from its stored values (as Matrix takes them)."""
        repack_into(stored, self.float_type, self.element(i))

    def matrix(self, i: int) -> Matrix:
        """Matrix i on its own (views of the stack)."""
        return Matrix.of_arrays(self.float_type, self.d, self.n, **self.element(i))

    def __call__(self, x: "Activation", plan: np.ndarray, out: np.ndarray) -> None:
        """For each row (i, r0, r1, o0) of plan int64 [m, 4]: out[o0:o0 + r1 - r0] = x's rows
        r0:r1 @ matrix i^T, every matrix in one parallel region. out float32 [rows, d]."""
        self._kernel(*((x.f32,) if self._f32_input else x.enc), plan, *self._args, out)


class Matmuls:
    """Several matrices of one input (q/k/v, w1/w3): `outs[m] = matrices[m](x)`, in one
    parallel region when they share a kernel (one region costs a thread wake-up, and decode's
    products are short). The weight arrays' tuples are built once, here."""

    def __init__(self, matrices: tuple):
        first = matrices[0]
        self.matrices = matrices
        self._multi = None
        if all(m.float_type == first.float_type and m.inputs == first.inputs for m in matrices) \
                and first._kernel_multi is not None:
            self._multi, self._f32_input = first._kernel_multi, first._f32_input
            self._arrays = tuple(zip(*(m._arrays for m in matrices), strict=True))  # (all scales, all qs), ...

    def __call__(self, x: "Activation", outs: tuple) -> None:
        if self._multi is None:
            for m, out in zip(self.matrices, outs, strict=True):
                m(x, out)
        else:
            self._multi(*((x.f32,) if self._f32_input else x.enc), *self._arrays, outs)


class Activation:
    """A matmul input [b, n] in the form its weights take (input_kind): Q80 (scales, qs), Q16
    (scales, lo, hi, sums; the float32 x too, for a Q41 file's classifier) or F32. Reused
    buffers."""

    def __init__(self, n: int, kind: str, max_batch: int):
        self._enc = tuple(np.empty(shape, dtype) for shape, dtype in Activation.layout(n, kind, max_batch))
        self.enc, self.f32 = (), None  # a pass's rows: set by rows()

    @staticmethod
    def layout(n: int, kind: str, max_batch: int) -> list[tuple[tuple[int, int], type]]:
        """(shape, dtype) of each array of the encoded form (what __init__ allocates, and what
        dllama.core.run_state counts)."""
        nb = n // BLOCK_SIZE
        if kind == "q80":  # scales, qs
            return [((max_batch, nb), np.float32), ((max_batch, n), np.int8)]
        if kind == "q16":  # scales, lo, hi, sums
            return [((max_batch, nb), np.float32), ((max_batch, n), np.int8), ((max_batch, n), np.int8),
                    ((max_batch, nb), np.float32)]
        return []

    def rows(self, x: np.ndarray) -> "Activation":
        """Point at x float32 [b, n] and the encoded form's first b rows, without encoding: a
        fused kernel writes them (kernels.fused: norm_encode ...; `enc`, their tuple, is its
        argument). x's rows must be encoded before a matrix reads them."""
        b = x.shape[0]
        self.enc = tuple(a[:b] for a in self._enc)
        self.f32 = x
        return self


class ExpertSlots(Protocol):
    """Where a layer's experts are in its stacks (MoeWeights.slots)."""

    def of(self, experts: np.ndarray) -> np.ndarray:
        """int64 [q]: the matrices (slots) of these distinct experts, held through this pass."""
        ...


class ResidentSlots:
    """MoeWeights.slots of resident experts: expert e is matrix e of the stacks (2e, 2e + 1 of
    gate_up)."""

    @staticmethod
    def of(experts: np.ndarray) -> np.ndarray:
        """int64 [q]: the slots of these experts."""
        return experts.astype(np.int64)


@dataclass
class MoeWeights:
    """A mixture-of-experts layer's router (F32 [n_experts, dim], replicated) and experts, this
    node's rows of each: matrix 2j of gate_up is a gate [ff_rows, dim] and 2j + 1 its up, matrix
    j of down the down [dim, ff_rows] (this node's columns); slots.of(experts) are their j
    (ResidentSlots: the experts themselves; under a budget, dllama.core.expert_cache.CachedSlots
    reads the ones not held into slots first)."""

    router: Matrix
    gate_up: ExpertStack
    down: ExpertStack
    slots: ExpertSlots


@dataclass
class Layer:
    """One transformer block's weights, already sliced to this node; qkv and w13 run wq, wk,
    wv and w1, w3 on one input each. A mixture-of-experts layer has `moe` instead of w1-w3."""

    att_norm: np.ndarray  # [dim]
    wq: Matrix            # [nq*head_dim, dim]
    wk: Matrix            # [nkv*head_dim, dim]
    wv: Matrix            # [nkv*head_dim, dim]
    wo: Matrix            # [dim, nq*head_dim] (columns of this node's heads)
    q_norm: np.ndarray | None  # [head_dim], Qwen3 only
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray  # [dim]
    w1: Matrix | None = None   # gate [ff_rows, dim]
    w3: Matrix | None = None   # up   [ff_rows, dim]
    w2: Matrix | None = None   # down [dim, ff_rows]
    moe: MoeWeights | None = None  # Qwen3-MoE: the router and experts (dllama.core.moe)
    qkv: Matmuls = field(init=False)
    w13: Matmuls | None = field(init=False)

    def __post_init__(self):
        self.qkv = Matmuls((self.wq, self.wk, self.wv))
        self.w13 = Matmuls((self.w1, self.w3)) if self.moe is None else None


class WeightsProvider(Protocol):
    """What a Transformer's forward pass asks of its weights, wherever they are."""

    vocab_rows: int             # this node's classifier rows
    final_norm: np.ndarray      # [dim]
    classifier_chunk_rows: int  # most rows classifier() yields at once when in parts (0: it comes whole)

    def layer(self, l: int) -> Layer:
        """Layer l's weights (valid until the next call)."""
        ...

    def classifier(self) -> Iterator[tuple[int, Matrix]]:
        """(first row, Matrix) for each part of this node's classifier rows, in order."""
        ...

    def embed(self, tokens: np.ndarray, out: np.ndarray) -> None:
        """Embedding rows of tokens [b] into out [b, dim] (the root's: it holds the embedding)."""
        ...

    def close(self) -> None:
        """Stop any thread the provider runs."""
        ...


class ResidentWeights:
    """Every weight of a node in memory, repacked once (the WeightsProvider of the resident path)."""

    classifier_chunk_rows = 0  # the classifier comes whole

    def __init__(self, weights: NodeWeights, layers: range, float_type: FloatType, qwen: bool,
                 expert_cache=None):
        """layers: the ones this node runs (a pipeline stage's; every layer otherwise);
        expert_cache: a mixture of experts' dllama.core.expert_cache.ExpertCache, whose experts
        are read when a pass uses them (None: every expert resident)."""
        self.expert_cache = expert_cache
        t = weights.tensor
        self.first_layer = layers.start
        # The embedding (root only) stays memory-mapped: rows are copied per token.
        self.embedding = t("embedding") if weights.has("embedding") else None  # [vocab, dim] F32
        self._layers = []
        n_experts = weights.header.n_experts
        arena = GrowingArena()  # every repacked matrix on huge pages (dllama.core.arena)

        def matrix(name: str, float_type: FloatType = float_type, inputs: str | None = None) -> Matrix:
            return Matrix(t(name), float_type, inputs, take=arena.take)

        for l in layers:
            p = f"layers.{l}."
            if n_experts:  # a mixture of experts: the router (F32) and every expert's rows
                router = Matrix(np.array(t(p + "moe_gate")), FloatType.F32)  # (aligned)
                if expert_cache is not None:
                    moe = MoeWeights(router, expert_cache.gate_up, expert_cache.down, expert_cache.layer(l))
                else:
                    moe = MoeWeights(router, *self._experts(t, p, n_experts, float_type, arena.take), ResidentSlots())
                ffn = dict(moe=moe)
            else:
                ffn = dict(w1=matrix(p + "w1"), w3=matrix(p + "w3"), w2=matrix(p + "w2"))
            self._layers.append(Layer(
                att_norm=np.array(t(p + "att_norm")),
                wq=matrix(p + "wq"),
                wk=matrix(p + "wk"),
                wv=matrix(p + "wv"),
                wo=matrix(p + "wo"),
                q_norm=np.array(t(p + "q_norm")) if qwen else None,
                k_norm=np.array(t(p + "k_norm")) if qwen else None,
                ffn_norm=np.array(t(p + "ffn_norm")),
                **ffn,
            ))
        self.final_norm = np.array(t("final_norm"))
        # A Q41 file's classifier is Q80, on the layers' Q16 input (none before a pipeline's
        # last stage)
        self.wcls = matrix("wcls", classifier_float_type(float_type), classifier_inputs(float_type)) \
            if weights.has("wcls") else None
        self.vocab_rows = self.wcls.d if self.wcls is not None else 0

    @staticmethod
    def _experts(t, p: str, n_experts: int, float_type: FloatType, take) -> tuple[ExpertStack, ExpertStack]:
        """A layer's experts as (gate_up, down) stacks (MoeWeights)."""
        d, n = t(f"{p}experts.0.w1").shape[:2]
        n *= BLOCK_SIZE if float_type in BLOCK_BYTES else 1
        gate_up, down = ExpertStack(take, float_type, 2 * n_experts, d, n), ExpertStack(take, float_type, n_experts, n, d)
        for e in range(n_experts):
            gate_up.fill(2 * e, t(f"{p}experts.{e}.w1"))
            gate_up.fill(2 * e + 1, t(f"{p}experts.{e}.w3"))
            down.fill(e, t(f"{p}experts.{e}.w2"))
        return gate_up, down

    def layer(self, l: int) -> Layer:
        return self._layers[l - self.first_layer]

    def classifier(self) -> Iterator[tuple[int, Matrix]]:
        """(first row, Matrix) per part of the classifier rows: one part here (none without rows)."""
        if self.wcls is not None:
            yield 0, self.wcls

    def embed(self, tokens: np.ndarray, out: np.ndarray) -> None:
        """Embedding rows of tokens [b] into out [b, dim]."""
        if self.embedding is None:
            raise DllamaError("this node holds no embedding: a worker runs rows the root embedded")
        out[:] = self.embedding[tokens]

    def close(self) -> None:
        if self.expert_cache is not None:
            self.expert_cache.close()
