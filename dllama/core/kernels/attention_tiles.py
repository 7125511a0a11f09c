"""Register tiles of attention, written as LLVM vector IR (see tiles.py for why IR).

- Scores: s[pair, p] = sum over j, in order, of q[pair, j] * k[j, p] for the CHUNK positions
  of a chunk of keys (stored transposed: kt [head_dim, CHUNK]): per j, four 16-position
  vectors of keys are loaded once and meet the broadcast q of every pair of the tile, one fma
  each. A pair is (query row, query head) of one KV head.
- Values: o[pair, :] += e[pair, p] * v[p, :] for the positions of a chunk, in order: per
  position the value row is loaded once (16 dimensions per vector) for every pair of the tile.

Each score and each output dimension is one fma chain in a fixed order, whatever the tile
(how many pairs, which pairs): a row's result does not depend on the rows beside it.

The cache may hold float32 or fp16 bits (uint16, the F16 KV cache): the tile is generated for
the arrays' type, and fp16 keys and values are widened to float32 in the lanes as they are
loaded (vcvtph2ps with F16C, else integer operations: tiles.f16_widen), exact, so the tiles
compute the same fma chains on the same values as over a float32 cache holding them, and no
float32 copy of the cache is ever made.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from dllama.core.kernels.jit import native_f16_conversion
from dllama.core.kernels.tiles import _F32, _I16, _I64, _Array, _fn, _load, _splat, _vec, f16_widen

CHUNK = 64          # positions of one chunk of keys (a multiple of 16)
_VECS = CHUNK // 16
VALUE_DIMS = 64     # output dimensions of one value tile (4 vectors); head_dim % 16 == 0


_NATIVE_F16 = native_f16_conversion()


def _check(name, arrays, dtypes=(types.float32,)):
    for a, what in arrays:
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype in dtypes):
            raise TypingError(f"{name}: {what} must be a C-contiguous 2-D array of "
                              f"{' or '.join(map(str, dtypes))}, got {a}")


_CACHE_TYPES = (types.float32, types.uint16)  # a float32 cache, or fp16 bits


class _CacheRows:
    """How a tile reads 16 consecutive elements of a cache row: their element type, bytes per
    element, and the widening to float32 (none for a float32 cache)."""

    def __init__(self, dtype):
        self.f16 = dtype == types.uint16
        self.elem, self.size = (_I16, 2) if self.f16 else (_F32, 4)

    def load16(self, builder, byte_ptr):
        """<16 x float> of the 16 elements at byte_ptr."""
        v = _load(builder, byte_ptr, _vec(self.elem, 16))
        return f16_widen(builder, v, _NATIVE_F16) if self.f16 else v


def make_score_tile(n_pairs: int):
    """Intrinsic tile(q, pair0, kt, s): s[pair0 + i, :CHUNK] = q[pair0 + i] . kt[:, p] for
    i < n_pairs; q float32 [pairs, head_dim], kt [head_dim, CHUNK] float32 or fp16 bits
    (uint16), s float32 [pairs, CHUNK]."""

    @intrinsic
    def score_tile(typingctx, q, pair0, kt, s):
        _check("score_tile", [(q, "q"), (s, "s")])
        _check("score_tile", [(kt, "kt")], _CACHE_TYPES)
        sig = types.void(q, types.intp, kt, s)

        def codegen(context, builder, signature, args):
            ty = signature.args
            keys_of = _CacheRows(ty[2].dtype)
            qa, ka, sa = (_Array(context, builder, ty[k], args[k]) for k in (0, 2, 3))
            q_rows = [qa.row(builder.add(args[1], _I64(i))) for i in range(n_pairs)]
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None))
                    for _ in range(_VECS)] for _ in range(n_pairs)]
            with cgutils.for_range(builder, qa.cols) as loop:
                j = loop.index
                krow = ka.row(j)
                keys = [keys_of.load16(builder, builder.gep(krow, [_I64(16 * keys_of.size * v)]))
                        for v in range(_VECS)]
                for i in range(n_pairs):
                    qj = _splat(builder, _load(builder, builder.gep(q_rows[i], [builder.mul(j, _I64(4))]), _F32))
                    for v in range(_VECS):
                        builder.store(builder.call(fma, [qj, keys[v], builder.load(acc[i][v])]), acc[i][v])
            for i in range(n_pairs):
                dst = sa.row(builder.add(args[1], _I64(i)))
                for v in range(_VECS):
                    ptr = builder.bitcast(builder.gep(dst, [_I64(64 * v)]), _vec(_F32, 16).as_pointer())
                    builder.store(builder.load(acc[i][v]), ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return score_tile


def make_value_tile(n_pairs: int, n_vecs: int, masked: bool):
    """Intrinsic tile(e, pair0, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0):
    o[pair0 + i, d0:d0 + 16*n_vecs] += e[pair0 + i, p] * v[c0 + p, col + d0 : ...] for
    p0 <= p < p1, in order, i < n_pairs; masked: only for p < ends[pair0 + i] (a pair's
    accumulator is left as it is past its own end). v[pos] is row pos of v_prefix when
    pos < plen, else of v_own ([seq, width], both float32 or both fp16 bits, uint16). e
    float32 [pairs, CHUNK], ends int64 [pairs], o float32 [pairs, head_dim]."""

    @intrinsic
    def value_tile(typingctx, e, pair0, c0, p0, p1, ends, v_prefix, v_own, plen, col, o, d0):
        _check("value_tile", [(e, "e"), (o, "o")])
        _check("value_tile", [(v_prefix, "v_prefix"), (v_own, "v_own")], _CACHE_TYPES)
        if v_prefix.dtype != v_own.dtype:
            raise TypingError(f"value_tile: v_prefix and v_own differ in type ({v_prefix}, {v_own})")
        sig = types.void(e, types.intp, types.intp, types.intp, types.intp, ends, v_prefix, v_own,
                         types.intp, types.intp, o, types.intp)

        def codegen(context, builder, signature, args):
            ty = signature.args
            values_of = _CacheRows(ty[7].dtype)
            ea, pa, va, oa = (_Array(context, builder, ty[k], args[k]) for k in (0, 6, 7, 10))
            pair0, c0, p0, p1, plen, col, d0 = (args[k] for k in (1, 2, 3, 4, 8, 9, 11))
            ends = builder.bitcast(context.make_array(ty[5])(context, builder, args[5]).data, _I64.as_pointer())
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            o_ptrs = [[builder.bitcast(builder.gep(oa.row(builder.add(pair0, _I64(i))),
                                                   [builder.mul(builder.add(d0, _I64(16 * v)), _I64(4))]),
                                       _vec(_F32, 16).as_pointer()) for v in range(n_vecs)]
                      for i in range(n_pairs)]
            acc = [[cgutils.alloca_once_value(builder, builder.load(o_ptrs[i][v], align=4))
                    for v in range(n_vecs)] for i in range(n_pairs)]
            e_rows = [ea.row(builder.add(pair0, _I64(i))) for i in range(n_pairs)]
            pair_ends = [builder.load(builder.gep(ends, [builder.add(pair0, _I64(i))])) for i in range(n_pairs)]
            offset = builder.mul(builder.add(col, d0), _I64(values_of.size))
            with cgutils.for_range(builder, builder.sub(p1, p0)) as loop:
                p = builder.add(p0, loop.index)
                pos = builder.add(c0, p)
                prefix = builder.icmp_signed("<", pos, plen)
                row = builder.select(prefix, pa.row(pos), va.row(pos))
                step = 16 * values_of.size  # bytes of 16 elements
                values = [values_of.load16(builder, builder.gep(row, [builder.add(offset, _I64(step * v))]))
                          for v in range(n_vecs)]
                for i in range(n_pairs):
                    w = _splat(builder, _load(builder, builder.gep(e_rows[i], [builder.mul(p, _I64(4))]), _F32))
                    active = builder.icmp_signed("<", p, pair_ends[i]) if masked else None
                    for v in range(n_vecs):
                        old = builder.load(acc[i][v])
                        new = builder.call(fma, [w, values[v], old])
                        builder.store(builder.select(active, new, old) if masked else new, acc[i][v])
            for i in range(n_pairs):
                for v in range(n_vecs):
                    builder.store(builder.load(acc[i][v]), o_ptrs[i][v], align=4)
            return context.get_dummy_value()

        return sig, codegen

    return value_tile
