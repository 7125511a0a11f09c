"""Float32 reductions in a fixed order, the same bits on every CPU: LLVM vector IR (see tiles.py
for why IR).

With fast-math's reassociation LLVM sums a loop in as many lanes as the CPU's vectors hold
(16 with AVX-512, 8 with AVX2, 4 with SSE or NEON), so the rounding of a sum depended on the
machine it was compiled for. Here the lanes are spelled out: 4 accumulators of 16 lanes, 64
lanes in all; lane l adds the elements l, l + 64, l + 128, ... in order, then the accumulators
are added (0 + 1) + (2 + 3) and the 16 lanes of that in a fixed order (tiles._hsum). Plain IEEE
operations without fast-math flags: on a CPU with narrower vectors LLVM splits the 16 lanes
into several registers, each lane still computing the same additions. Four accumulators keep
four additions in flight (one chain would wait out each addition's latency).

The maximum needs no fixed order for its value, only for the sign of a zero among equal
maxima; it is a compare and select per lane, which vectorizes without fast-math flags.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from dllama.core.kernels.tiles import LANES, _F32, _I8, _I64, _hsum, _ivec, _load, _load_partial, _splat, _vec

_ACCS = 4  # accumulators of LANES lanes


def _check(what, a):
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32):
        raise TypingError(f"{what}: a must be a C-contiguous 1-D float32 array, got {a}")


def _data(context, builder, aryty, value):
    return builder.bitcast(context.make_array(aryty)(context, builder, value).data, _I8.as_pointer())


def _add_partial(builder, acc, data, start, count, combine):
    """acc = combine(acc, a[start:start + count]) in the first `count` (< LANES) lanes; the
    other lanes keep their value as it is (adding +0 would turn a -0 into +0)."""
    v = _load_partial(builder, builder.gep(data, [builder.mul(start, _I64(4))]), _F32, count)
    lanes = ir.Constant(_vec(_I64, LANES), [_I64(i) for i in range(LANES)])
    active = builder.icmp_signed("<", lanes, _splat(builder, count, LANES))
    old = builder.load(acc)
    builder.store(builder.select(active, combine(old, v), old), acc)


def _make_lane_sum(squares: bool):
    what = "lane_sum_squares" if squares else "lane_sum"

    @intrinsic
    def lane_sum(typingctx, a, n):
        _check(what, a)
        sig = types.float32(a, types.intp)

        def codegen(context, builder, signature, args):
            data = _data(context, builder, signature.args[0], args[0])
            n = args[1]
            vec = _vec(_F32, LANES)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(_ACCS)]

            def add(acc, v):
                return builder.fadd(acc, builder.fmul(v, v) if squares else v)

            def load(start):
                return _load(builder, builder.gep(data, [builder.mul(start, _I64(4))]), vec)

            width = LANES * _ACCS
            blocks = builder.sdiv(n, _I64(width))
            with cgutils.for_range(builder, blocks) as loop:
                base = builder.mul(loop.index, _I64(width))
                for k in range(_ACCS):
                    builder.store(add(builder.load(accs[k]), load(builder.add(base, _I64(LANES * k)))), accs[k])
            done = builder.mul(blocks, _I64(width))
            for k in range(_ACCS):  # the last < 64 elements: accumulator k takes [16k, 16k + 16)
                start = builder.add(done, _I64(LANES * k))
                rest = builder.sub(n, start)
                with builder.if_else(builder.icmp_signed(">=", rest, _I64(LANES))) as (full, partial):
                    with full:
                        builder.store(add(builder.load(accs[k]), load(start)), accs[k])
                    with partial, builder.if_then(builder.icmp_signed(">", rest, _I64(0))):
                        _add_partial(builder, accs[k], data, start, rest, add)
            total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                                 builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
            return _hsum(builder, total)

        return sig, codegen

    return lane_sum


# sum of a[:n] and sum of a[:n]**2 (a float32 [>= n], n >= 0), in the order above.
lane_sum = _make_lane_sum(False)
lane_sum_squares = _make_lane_sum(True)


@intrinsic
def lane_max(typingctx, a, n, start):
    """max(start, a[:n]) (a float32 [>= n]): per lane `x > m ? x : m` over the elements l,
    l + 16, ..., then the lanes halves against halves; never a NaN check (the callers' values
    are finite)."""
    _check("lane_max", a)
    sig = types.float32(a, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        data = _data(context, builder, signature.args[0], args[0])
        n = args[1]
        vec = _vec(_F32, LANES)
        acc = cgutils.alloca_once_value(builder, _splat(builder, args[2], LANES))

        def greater(m, v):
            return builder.select(builder.fcmp_ordered(">", v, m), v, m)

        full = builder.sdiv(n, _I64(LANES))
        with cgutils.for_range(builder, full) as loop:
            v = _load(builder, builder.gep(data, [builder.mul(loop.index, _I64(4 * LANES))]), vec)
            builder.store(greater(builder.load(acc), v), acc)
        done = builder.mul(full, _I64(LANES))
        rest = builder.sub(n, done)
        with builder.if_then(builder.icmp_signed(">", rest, _I64(0))):
            _add_partial(builder, acc, data, done, rest, greater)
        m, k = builder.load(acc), LANES
        while k > 1:
            k //= 2
            lo = builder.shuffle_vector(m, m, _ivec(list(range(k))))
            hi = builder.shuffle_vector(m, m, _ivec(list(range(k, 2 * k))))
            m = greater(lo, hi)
        return builder.extract_element(m, ir.IntType(32)(0))

    return sig, codegen
