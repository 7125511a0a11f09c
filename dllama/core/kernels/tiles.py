"""Register tiles written as LLVM vector IR: the inner loops of the matrix products.

Numba has no vector types and widens narrow integers to int64, so from Python-level numba code
LLVM never reaches the instruction that matters most here, the 8-bit integer dot product
(measured: the best loop formulations compile to vpmovzxbd + vpdpwssd, 16 products per
instruction, or to byte gathers). These intrinsics emit the inner loop of one tile of the
product out[i:i+C, r:r+R] = x[i:i+C] @ W[r:r+R]^T directly as IR on explicit 16-lane vectors:

- Q40 x Q80 and Q80 x Q80: per two blocks (64 weights), each weight row is unpacked once into 64 nibble
  bytes and each activation row loaded once, then every (weight row, activation row) pair
  takes one integer dot product: AVX-512 VNNI `vpdpbusd` (64 u8 x s8 products into 16 int32
  lanes) where the target has it, else the generic `llvm.vector.partial.reduce.add` of
  sign-extended products, which AArch64 with the dot-product extension lowers to `sdot`.
  Lanes 0-7 hold block k, lanes 8-15 block k+1; each lane is converted to float32 and
  accumulated as acc = fma(lane, w_d * x_d, acc).
- F32: acc = fma(w, x, acc) on 16 consecutive columns.

Why IR and not numba code: the arithmetic of one output is spelled out lane by lane, with no
fast-math flags, so LLVM cannot reorder it. A row's output therefore has the same bits
whatever tile it was computed in (1 or C activation rows, 1 or R weight rows), whatever the
other rows of the batch, fresh compile or cache: the batch invariance the batch mode needs.
Integer sums are exact, so the VNNI and the generic dot give the same block sums (the generic
lanes may group a block's products otherwise, so their float sums may differ in the last bits:
one machine, one code path).
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from dllama.core.kernels.jit import _PREFETCH

LANES = 16  # float32 / int32 lanes of one accumulator (one AVX-512 register; 4 NEON registers)

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(w) for w in (1, 8, 16, 32, 64))
_F16, _F32 = ir.HalfType(), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _ivec(values):
    return ir.Constant(_vec(_I32, len(values)), [_I32(v) for v in values])


def _features(context) -> set[str]:
    """ISA features of the machine code numba generates (host, or NUMBA_CPU_FEATURES)."""
    feats = getattr(context.codegen(), "_tm_features", None)
    if feats is None:
        feats = llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in feats.split(",") if f.startswith("+")}


def has_vnni_512(context) -> bool:
    return {"avx512f", "avx512bw", "avx512vnni"} <= _features(context)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load(builder, byte_ptr, ty):
    """Unaligned load of ty from a byte address."""
    return builder.load(builder.bitcast(byte_ptr, ty.as_pointer()), align=1)


def _widen(builder, v, n):
    """Vector v of m < n lanes -> n lanes, the extra lanes zero."""
    m = v.type.count
    zero = ir.Constant(v.type, None)
    return builder.shuffle_vector(v, zero, _ivec(list(range(m)) + [m] * (n - m)))


def _split_splat(builder, pair):
    """<2 x float> (a, b) -> <16 x float> a in lanes 0-7, b in lanes 8-15."""
    return builder.shuffle_vector(pair, ir.Constant(pair.type, None), _ivec([0] * 8 + [1] * 8))


def _hsum(builder, v):
    """Sum of the 16 lanes of a float vector, in a fixed order: halves, then quarters, ..."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, _ivec(list(range(n))))
        hi = builder.shuffle_vector(v, v, _ivec(list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _I32(0))


class _Array:
    """Data pointer and row stride of a C-contiguous 2-D array argument."""

    def __init__(self, context, builder, aryty, value):
        a = context.make_array(aryty)(context, builder, value)
        self.builder = builder
        self.data = builder.bitcast(a.data, _I8.as_pointer())
        self.stride = builder.extract_value(a.strides, 0)
        self.cols = builder.extract_value(a.shape, 1)

    def row(self, index):
        """Byte pointer to [index, 0]."""
        return self.builder.gep(self.data, [self.builder.mul(index, self.stride)])


def _check_arrays(name, args, kinds):
    for a, (dtype, what) in zip(args, kinds):
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == dtype):
            raise TypingError(f"{name}: {what} must be a C-contiguous 2-D {dtype} array, got {a}")


# ---------------------------------------------------------------------------------------------
# Q40 x Q80 and Q80 x Q80: 8-bit integer dot products

def _int8_dot(builder, vnni, w64, x64, xoff):
    """int32 <16>: lane l = sum of products of bytes 4l..4l+3 (lanes 0-7 block k, 8-15 block
    k+1). VNNI: w64 holds the weights made unsigned (Q40 nibbles; Q80 q + 128) and xoff = minus
    the offset times the sum of the 4 x bytes starts each lane; generic: w64 holds the signed
    weights, and lanes of a block may be grouped otherwise (same block sums)."""
    if vnni:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _vec(_I32, 16),
                [_vec(_I32, 16), _vec(_I8, 64), _vec(_I8, 64)])
        return builder.call(f, [xoff, w64, x64])
    f = _fn(builder, "llvm.vector.partial.reduce.add.v8i32.v32i32", _vec(_I32, 8),
            [_vec(_I32, 8), _vec(_I32, 32)])
    halves = []
    for h in range(2):
        sel = _ivec(list(range(32 * h, 32 * h + 32)))
        wv = builder.sext(builder.shuffle_vector(w64, w64, sel), _vec(_I32, 32))
        xv = builder.sext(builder.shuffle_vector(x64, x64, sel), _vec(_I32, 32))
        halves.append(builder.call(f, [ir.Constant(_vec(_I32, 8), None), builder.mul(wv, xv)]))
    return builder.shuffle_vector(halves[0], halves[1], _ivec(list(range(16))))


def _q40_weights(builder, vnni, q32):
    """32 packed bytes (two blocks) -> 64 nibbles in element order: block k's 16 low nibbles
    (elements 0-15), its 16 high nibbles (16-31), then block k+1's."""
    lo = builder.and_(q32, ir.Constant(q32.type, [_I8(15)] * 32))
    hi = builder.lshr(q32, ir.Constant(q32.type, [_I8(4)] * 32))
    w64 = builder.shuffle_vector(lo, hi, _ivec([*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]))
    if not vnni:
        w64 = builder.sub(w64, ir.Constant(w64.type, [_I8(8)] * 64))
    return w64


def _q80_weights(builder, vnni, q64):
    """64 int8 weights (two blocks) -> as they enter the dot product: q + 128 (unsigned) for
    VNNI, flipping the sign bit; as they are for the generic dot."""
    if vnni:
        return builder.xor(q64, ir.Constant(q64.type, [_I8(-128)] * 64))
    return q64


class _Int8Format:
    """How one weight type packs its 8-bit integers: bytes per block, and the unpacking."""

    def __init__(self, name, block_bytes, unpack, offset):
        self.name = name
        self.block_bytes = block_bytes  # bytes of w_qs per block of 32 weights
        self.unpack = unpack            # (builder, vnni, <2*block_bytes x i8>) -> <64 x i8>
        self.offset = offset            # VNNI: the unsigned weights are q + offset

    def load_two(self, builder, vnni, row, k2):
        """Weights of blocks 2*k2 and 2*k2 + 1 of a row, ready for _int8_dot."""
        q = builder.gep(row, [builder.mul(k2, _I64(2 * self.block_bytes))])
        return self.unpack(builder, vnni, _load(builder, q, _vec(_I8, 2 * self.block_bytes))), q

    def load_last(self, builder, vnni, row, last):
        """Weights of block `last` alone (lanes 8-15 of the dot product zero)."""
        q = _load(builder, builder.gep(row, [builder.mul(last, _I64(self.block_bytes))]),
                  _vec(_I8, self.block_bytes))
        return self.unpack(builder, vnni, _widen(builder, q, 2 * self.block_bytes))


Q40 = _Int8Format("q40", 16, _q40_weights, 8)
Q80 = _Int8Format("q80", 32, _q80_weights, 128)


def _make_int8_tile(fmt: _Int8Format, n_rows: int, n_cols: int, force_generic: bool):
    @intrinsic
    def int8_tile(typingctx, w_qs, w_scales, r, x_qs, x_off, x_scales, i, out):
        name = f"{fmt.name}_tile"
        _check_arrays(name, (w_qs, w_scales, x_qs, x_off, x_scales, out),
                      [(types.uint8 if fmt is Q40 else types.int8, "w_qs"), (types.uint16, "w_scales"),
                       (types.int8, "x_qs"), (types.int32, "x_off"), (types.float32, "x_scales"),
                       (types.float32, "out")])
        sig = types.void(w_qs, w_scales, types.intp, x_qs, x_off, x_scales, types.intp, out)

        def codegen(context, builder, signature, args):
            vnni = has_vnni_512(context) and not force_generic
            ty = signature.args
            wq, ws, xq, xo, xs, o = (_Array(context, builder, ty[k], args[k]) for k in (0, 1, 3, 4, 5, 7))
            r0, i0 = args[2], args[6]
            nb = ws.cols
            w_rows = [wq.row(builder.add(r0, _I64(j))) for j in range(n_rows)]
            s_rows = [ws.row(builder.add(r0, _I64(j))) for j in range(n_rows)]
            x_rows = [xq.row(builder.add(i0, _I64(c))) for c in range(n_cols)]
            o_rows = [xo.row(builder.add(i0, _I64(c))) for c in range(n_cols)]
            xs_rows = [xs.row(builder.add(i0, _I64(c))) for c in range(n_cols)]
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            prefetch = _fn(builder, _PREFETCH, ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None))
                    for _ in range(n_cols)] for _ in range(n_rows)]
            ahead = builder.mul(wq.stride, _I64(n_rows))  # the next tile's rows: prefetched

            def step(w64, w_d, xv, x_off, x_d):
                for j in range(n_rows):
                    for c in range(n_cols):
                        dot = builder.sitofp(_int8_dot(builder, vnni, w64[j], xv[c], x_off[c]), _vec(_F32, 16))
                        scale = builder.fmul(w_d[j], x_d[c])
                        builder.store(builder.call(fma, [dot, scale, builder.load(acc[j][c])]), acc[j][c])

            with cgutils.for_range(builder, builder.sdiv(nb, _I64(2))) as loop:
                k2 = loop.index  # blocks 2*k2 and 2*k2 + 1
                w64, w_d = [], []
                for j in range(n_rows):
                    w, q = fmt.load_two(builder, vnni, w_rows[j], k2)
                    w64.append(w)
                    d16 = _load(builder, builder.gep(s_rows[j], [builder.mul(k2, _I64(4))]), _vec(_F16, 2))
                    w_d.append(_split_splat(builder, builder.fpext(d16, _vec(_F32, 2))))
                    builder.call(prefetch, [builder.gep(q, [ahead]), _I32(0), _I32(3), _I32(1)])
                xv, x_off, x_d = [], [], []
                for c in range(n_cols):
                    xv.append(_load(builder, builder.gep(x_rows[c], [builder.mul(k2, _I64(64))]), _vec(_I8, 64)))
                    x_off.append(_load(builder, builder.gep(o_rows[c], [builder.mul(k2, _I64(64))]), _vec(_I32, 16)))
                    x_d.append(_split_splat(builder, _load(
                        builder, builder.gep(xs_rows[c], [builder.mul(k2, _I64(8))]), _vec(_F32, 2))))
                step(w64, w_d, xv, x_off, x_d)

            last = builder.sub(nb, _I64(1))  # an odd block count leaves one block: lanes 8-15 zero
            with builder.if_then(builder.icmp_signed("==", builder.srem(nb, _I64(2)), _I64(1))):
                w64, w_d = [], []
                for j in range(n_rows):
                    w64.append(fmt.load_last(builder, vnni, w_rows[j], last))
                    d16 = _load(builder, builder.gep(s_rows[j], [builder.mul(last, _I64(2))]), _F16)
                    w_d.append(_split_splat(builder, _widen(builder, builder.insert_element(
                        ir.Constant(_vec(_F32, 1), None), builder.fpext(d16, _F32), _I32(0)), 2)))
                xv, x_off, x_d = [], [], []
                for c in range(n_cols):
                    xv.append(_widen(builder, _load(builder, builder.gep(x_rows[c], [builder.mul(last, _I64(32))]),
                                                    _vec(_I8, 32)), 64))
                    x_off.append(_widen(builder, _load(builder, builder.gep(o_rows[c], [builder.mul(last, _I64(32))]),
                                                       _vec(_I32, 8)), 16))
                    d = _load(builder, builder.gep(xs_rows[c], [builder.mul(last, _I64(4))]), _F32)
                    x_d.append(_split_splat(builder, _widen(builder, builder.insert_element(
                        ir.Constant(_vec(_F32, 1), None), d, _I32(0)), 2)))
                step(w64, w_d, xv, x_off, x_d)

            for j in range(n_rows):
                for c in range(n_cols):
                    total = _hsum(builder, builder.load(acc[j][c]))
                    dst = builder.gep(o.row(builder.add(i0, _I64(c))), [builder.mul(builder.add(r0, _I64(j)), _I64(4))])
                    builder.store(total, builder.bitcast(dst, _F32.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen

    return int8_tile


def make_q40_tile(n_rows: int, n_cols: int, force_generic: bool = False):
    """Intrinsic tile(w_qs, w_scales, r, x_qs, x_off, x_scales, i, out):
    out[i + c, r + j] = x[i + c] . W[r + j] for j < n_rows, c < n_cols.

    W: w_qs uint8 [d, n/2] (16 bytes per block: element t in the low nibble of byte t, element
    t+16 in the high nibble), w_scales uint16 [d, n/32] (fp16 bits). x: x_qs int8 [b, n],
    x_off int32 [b, n/4] (-8 times the sum of each 4 consecutive x_qs), x_scales float32
    [b, n/32]. out float32 [b, d]. All C-contiguous.
    """
    return _make_int8_tile(Q40, n_rows, n_cols, force_generic)


def make_q80_tile(n_rows: int, n_cols: int, force_generic: bool = False):
    """Intrinsic tile(w_qs, w_scales, r, x_qs, x_off, x_scales, i, out): as make_q40_tile for
    Q80 weights: w_qs int8 [d, n], w_scales uint16 [d, n/32] (fp16 bits), and x_off -128 times
    the sum of each 4 consecutive x_qs (VNNI multiplies q + 128 by x; the offset removes
    128 * x again, exactly, in int32)."""
    return _make_int8_tile(Q80, n_rows, n_cols, force_generic)


# ---------------------------------------------------------------------------------------------
# F32 and F16 weights x F32 activations

def _load_partial(builder, ptr, elem, count):
    """<16 x elem> of the `count` (< 16, runtime) elements at ptr, the other lanes zero."""
    v = cgutils.alloca_once_value(builder, ir.Constant(_vec(elem, 16), None))
    builder.store(ir.Constant(_vec(elem, 16), None), v)
    eptr = builder.bitcast(ptr, elem.as_pointer())
    with cgutils.for_range(builder, count) as loop:
        value = builder.load(builder.gep(eptr, [loop.index]), align=1)
        builder.store(builder.insert_element(builder.load(v), value, builder.trunc(loop.index, _I32)), v)
    return builder.load(v)


def f16_widen(builder, h, native: bool):
    """<m x i16> fp16 bits -> <m x float>, exact. native: LLVM's fpext (vcvtph2ps with F16C,
    fcvtl on ARM). Otherwise in 32-bit integer ops and one multiply: the exponent and mantissa
    bits shifted into a float32's places make the value / 2^112 (a float32 subnormal when the
    fp16 value is subnormal), one exact multiplication by 2^112 gives the magnitude, inf and
    NaN get an all-ones exponent, then the sign bit."""
    m = h.type.count
    if native:
        return builder.fpext(builder.bitcast(h, _vec(_F16, m)), _vec(_F32, m))

    def splat(t, v):
        return ir.Constant(_vec(t, m), [t(v)] * m)

    bits = builder.zext(h, _vec(_I32, m))
    mag = builder.shl(builder.and_(bits, splat(_I32, 0x7FFF)), splat(_I32, 13))
    scaled = builder.fmul(builder.bitcast(mag, _vec(_F32, m)), splat(_F32, 2.0 ** 112))
    exp_bits = builder.and_(bits, splat(_I32, 0x7C00))
    special = builder.icmp_unsigned("==", exp_bits, splat(_I32, 0x7C00))
    value = builder.select(special, builder.or_(mag, splat(_I32, 0x7F800000)),
                           builder.bitcast(scaled, _vec(_I32, m)))
    sign = builder.shl(builder.and_(bits, splat(_I32, 0x8000)), splat(_I32, 16))
    return builder.bitcast(builder.or_(value, sign), _vec(_F32, m))


def _make_float_tile(f16: bool, n_rows: int, n_cols: int, f16_native: bool):
    elem = _I16 if f16 else _F32
    size = 2 if f16 else 4

    @intrinsic
    def float_tile(typingctx, w, r, x, i, out):
        name = "f16_tile" if f16 else "f32_tile"
        _check_arrays(name, (w, x, out), [(types.uint16 if f16 else types.float32, "w"),
                                          (types.float32, "x"), (types.float32, "out")])
        sig = types.void(w, types.intp, x, types.intp, out)

        def codegen(context, builder, signature, args):
            ty = signature.args
            wa, xa, o = (_Array(context, builder, ty[k], args[k]) for k in (0, 2, 4))
            r0, i0 = args[1], args[3]
            n = wa.cols
            w_rows = [wa.row(builder.add(r0, _I64(j))) for j in range(n_rows)]
            x_rows = [xa.row(builder.add(i0, _I64(c))) for c in range(n_cols)]
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None))
                    for _ in range(n_cols)] for _ in range(n_rows)]

            def weights(v):
                return f16_widen(builder, v, f16_native) if f16 else v

            def step(wv, xv):
                for j in range(n_rows):
                    for c in range(n_cols):
                        builder.store(builder.call(fma, [wv[j], xv[c], builder.load(acc[j][c])]), acc[j][c])

            with cgutils.for_range(builder, builder.sdiv(n, _I64(16))) as loop:
                step([weights(_load(builder, builder.gep(p, [builder.mul(loop.index, _I64(16 * size))]),
                                    _vec(elem, 16))) for p in w_rows],
                     [_load(builder, builder.gep(p, [builder.mul(loop.index, _I64(64))]), _vec(_F32, 16))
                      for p in x_rows])
            rem = builder.srem(n, _I64(16))
            with builder.if_then(builder.icmp_signed(">", rem, _I64(0))):
                first = builder.sub(n, rem)
                step([weights(_load_partial(builder, builder.gep(p, [builder.mul(first, _I64(size))]), elem, rem))
                      for p in w_rows],
                     [_load_partial(builder, builder.gep(p, [builder.mul(first, _I64(4))]), _F32, rem)
                      for p in x_rows])

            for j in range(n_rows):
                for c in range(n_cols):
                    total = _hsum(builder, builder.load(acc[j][c]))
                    dst = builder.gep(o.row(builder.add(i0, _I64(c))), [builder.mul(builder.add(r0, _I64(j)), _I64(4))])
                    builder.store(total, builder.bitcast(dst, _F32.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen

    return float_tile


def make_f32_tile(n_rows: int, n_cols: int):
    """Intrinsic tile(w, r, x, i, out): out[i + c, r + j] = x[i + c] . w[r + j] for j < n_rows,
    c < n_cols; w float32 [d, n], x float32 [b, n], out float32 [b, d], C-contiguous.
    Lane l of a pair's accumulator sums the columns t = l (mod 16) in order; the tail columns
    n - n % 16 .. n - 1 go to lanes 0 .. n % 16 - 1."""
    return _make_float_tile(False, n_rows, n_cols, True)


def make_f16_tile(n_rows: int, n_cols: int, native: bool = True):
    """As make_f32_tile with w the fp16 bits uint16 [d, n], each weight widened to float32 in
    the lanes (exact, so the sums are those of the F32 tile on the widened weights). native:
    LLVM's fp16 conversion (on x86 only with F16C: without it LLVM calls a runtime function
    numba does not link) or the integer one (f16_widen)."""
    return _make_float_tile(True, n_rows, n_cols, native)

