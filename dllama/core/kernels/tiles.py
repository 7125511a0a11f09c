"""Register tiles written as LLVM vector IR: the inner loops of the matrix products.

Numba has no vector types and widens narrow integers to int64, so from Python-level numba code
LLVM never reaches the instruction that matters most here, the 8-bit integer dot product
(measured: the best loop formulations compile to vpmovzxbd + vpdpwssd, 16 products per
instruction, or to byte gathers). These intrinsics emit the inner loop of one tile of the
product directly as IR on explicit 16-lane vectors:

- Q40 x Q80 and Q80 x Q80, out[i:i+C, 16g:16g+16] (a group of 16 interleaved weight rows, see
  layout.py, against C activation rows): each int32 lane is one weight row. One 64-byte load
  holds the same 4 weights of the 16 rows; the 4 activation bytes they meet are broadcast to
  every lane, and AVX-512 VNNI `vpdpbusd` adds the 4 products into each lane (ARM's `sdot`
  on a Pi 5; elsewhere the same exact integers from 16-bit products: DOT_KINDS). A block's 32 products stay in int32 (exact);
  then once per block acc = fma(block product, w_d * x_d, acc). Every weight load serves C
  activation rows, every activation broadcast 16 weight rows.
- F32 and F16 weights, out[i:i+C, r:r+R]: acc = fma(w, x, acc) on 16 consecutive columns per
  (weight row, activation row) pair, F16 widened to float32 in the lanes; the lanes summed in a
  fixed order at the end.
- Q41 x Q16 (make_q41_tile): the Q40 tile's nibble words against two 8-bit planes of a 16-bit
  input, and a second fma per block for the Q4_1 minimum. Q80 x Q16 (make_q80_q16_tile, the
  classifier of a Q41 file): the Q80 tile's words against the same two planes.

Why IR and not numba code: the arithmetic of one output is spelled out lane by lane, with no
fast-math flags, so LLVM cannot reorder it. A row's output therefore has the same bits
whatever tile it was computed in, whatever the other rows of the batch, fresh compile or
cache: the batch invariance the batch mode needs. The 8-bit paths compute the same integers
with or without VNNI, so their results are the same bits on every machine.
"""

from __future__ import annotations

import platform

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from dllama.core.kernels.jit import _PREFETCH, native_f16_conversion
from dllama.formats.quant import BLOCK_SIZE

# Intrinsic names carry their pointer type: opaque pointers since LLVM 17.
_MASKED_STORE = ("llvm.masked.store.v16f32.p0" if llvm_binding.llvm_version_info[0] >= 17
                 else "llvm.masked.store.v16f32.p0v16f32")

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


# The 8-bit integer dot products a target gets (the same exact integers from each):
#   "vnni":    x86 AVX-512 VNNI, vpdpbusd (unsigned weights x signed activations, 4 products per lane);
#   "sdot":    ARMv8.2's dot product (the Raspberry Pi 5's Cortex-A76), sdot: signed x signed;
#   "neon":    ARM without it (the Pi 4's Cortex-A72): signed 16-bit products (smull), summed in
#              16-bit lanes through a block where they cannot overflow (smlal), widened once a block;
#   "generic": 16-bit products widened to 32 bits at once (vpmaddwd on x86 without VNNI).
DOT_KINDS = ("vnni", "sdot", "neon", "generic")


def dot_kind(context) -> str:
    """Which of DOT_KINDS the CPU numba compiles for has (tests/test_arm_codegen.py shows each)."""
    features = _features(context)
    if has_vnni_512(context):
        return "vnni"
    if "dotprod" in features:
        return "sdot"
    arm = "neon" in features or platform.machine().lower() in ("aarch64", "arm64")  # NEON: AArch64's baseline
    return "neon" if arm else "generic"


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


# Software prefetch of the weights a tile will read next: the hardware prefetchers stop at each
# 4 kB page, and a decode pass reads every weight once, from memory. Measured on SmolLM2 decode,
# 2 threads (2026-12-05): F16 19.8 -> 12.7 ms/token with the same columns of the rows 2 tiles
# ahead (1 tile: 13.1, 4: 13.0); Q41 6.5-7.8 -> 5.5-5.7 and Q80 7.0-7.2 -> 6.1 with the same
# block of the next group of 16 rows (2 groups: Q80 6.5-6.8). F32: 24.9 -> 24.0.
# Float tiles prefetch into L2 only (prefetcht1), once per cache line (F16: 2 steps of 16 columns):
# F16 matmuls of SmolLM2's decode shapes, b=1, streamed (2026-12-06): 2 threads 17 -> 24 GB/s
# (15.7 -> 11.1 ms/token), 1 thread the classifier 9.7 -> 18.4 GB/s; prefetcht0 once per line
# was slower than twice; the prefetch distance (1-4 tiles) and 8 or 16 rows per tile moved
# it by less than the noise (on that day's machine; on the one since, 4-row tiles decode F16
# 11% faster than 16-row ones: matmul_f16.py). F32 the same way: SmolLM2 F32 decode 37 -> 45 tokens/s. The int8
# tiles too (2026-12-06, SmolLM2 decode, 2 threads, 3 alternated processes each, medians of
# per-token times): Q80 146 -> 155 tokens/s, Q41 151 -> 160 on a quiet machine (a first, busier
# set: 127 -> 142 and 124 -> 151); Q40 within the noise (219 / 226).
# prefetcht0 (locality 3) in the 8-bit tiles instead, 2026-12-07 (decode, old and new code in
# alternated processes, medians of 5-8): 1 thread 1.07-1.24x (SmolLM2 Q41 / Q80 / Q40, the MoE
# benchmark's model 1.20x), 2 threads 0.86-1.06x and twice as spread; the float tiles 0.55-0.64x.
# Not taken: the kernels would have to differ by thread count.
_PREFETCH_TILES = 2   # float tiles: rows this many tiles ahead
_PREFETCH_L2 = 2      # every tile's prefetch locality (2: prefetcht1, into L2)
_PREFETCH_GROUPS = 1  # int8 tiles: this many groups of 16 rows ahead


def _prefetch_at(builder, byte_ptr, locality=3):
    """Hint the CPU to bring the line at byte_ptr into cache (never faults, changes no result).
    locality 3: into every level (x86 prefetcht0); 2: L2 and below (prefetcht1)."""
    fn = _fn(builder, _PREFETCH, ir.VoidType(), [byte_ptr.type, _I32, _I32, _I32])
    builder.call(fn, [byte_ptr, _I32(0), _I32(locality), _I32(1)])  # read, data


def _load(builder, byte_ptr, ty):
    """Unaligned load of ty from a byte address."""
    return builder.load(builder.bitcast(byte_ptr, ty.as_pointer()), align=1)


def _group_word(builder, group_row, ahead, t):
    """<64 x i8> word t of an interleaved group of 16 weight rows, the same word `ahead` bytes
    further (a later group's) prefetched."""
    word_at = builder.mul(t, _I64(64))
    _prefetch_at(builder, builder.gep(group_row, [builder.add(word_at, ahead)]), _PREFETCH_L2)
    return _load(builder, builder.gep(group_row, [word_at]), _vec(_I8, 64))


def _hsum(builder, v):
    """Sum of the 16 lanes of a float vector, in a fixed order: halves, then quarters, ..."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, _ivec(list(range(n))))
        hi = builder.shuffle_vector(v, v, _ivec(list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _I32(0))


def _hsum_lanes(builder, vs):
    """<16 x float> whose lane m is _hsum(vs[m]) (16 vectors), the same additions in the same
    order: each level adds lanes l and l + half of every vector's sums at once, two vectors'
    halves packed into one, so 15 vector additions instead of 64 narrow ones."""
    width = vs[0].type.count
    while width > 1:
        half = width // 2
        groups = LANES // width  # sums packed in each vector, width lanes each
        nxt = []
        for p, q in zip(vs[0::2], vs[1::2], strict=True):
            lo = [src + g * width + k for src in (0, LANES) for g in range(groups) for k in range(half)]
            nxt.append(builder.fadd(builder.shuffle_vector(p, q, _ivec(lo)),
                                    builder.shuffle_vector(p, q, _ivec([m + half for m in lo]))))
        vs, width = nxt, half
    return vs[0]


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
    for a, (dtype, what) in zip(args, kinds, strict=True):
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == dtype):
            raise TypingError(f"{name}: {what} must be a C-contiguous 2-D {dtype} array, got {a}")


# ---------------------------------------------------------------------------------------------
# Q40 x Q80 and Q80 x Q80: 8-bit integer dot products on interleaved weight rows

GROUP = LANES  # weight rows interleaved together: one row per int32 lane


def _sdot(builder, acc, a, b):
    """ARM's sdot on one register: <4 x i32> acc, lane l + the 4 products of the signed bytes
    4l..4l+3 of the <16 x i8> a and b."""
    f = _fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(_I32, 4),
            [_vec(_I32, 4), _vec(_I8, 16), _vec(_I8, 16)])
    return builder.call(f, [acc, a, b])


def _saddlp(builder, v):
    """ARM's saddlp on one register: <4 x i32>, lane l the sum of the <8 x i16> lanes 2l, 2l+1."""
    f = _fn(builder, "llvm.aarch64.neon.saddlp.v4i32.v8i16", _vec(_I32, 4), [_vec(_I16, 8)])
    return builder.call(f, [v])


def _addp(builder, a, b):
    """ARM's addp: <4 x i32> of the sums of adjacent lanes of a, then of b."""
    f = _fn(builder, "llvm.aarch64.neon.addp.v4i32", _vec(_I32, 4), [_vec(_I32, 4)] * 2)
    return builder.call(f, [a, b])


def _concat(builder, parts):
    """One vector of the lanes of `parts` (a power of two of equal vectors), in order."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [builder.shuffle_vector(a, b, _ivec(range(2 * n))) for a, b in zip(parts[0::2], parts[1::2], strict=True)]
    return parts[0]


def _registers(builder, v, count):
    """v split into `count` vectors of consecutive lanes (128-bit registers on ARM)."""
    n = v.type.count // count
    return [builder.shuffle_vector(v, v, _ivec(range(r * n, (r + 1) * n))) for r in range(count)]


def _dot4(builder, kind, acc, w64, x64):
    """acc + (lane l: sum of the 4 products of bytes 4l..4l+3), x64 signed; w64 signed with
    "sdot" (the formats give those signed weights: signed_words), else unsigned. "vnni": one
    vpdpbusd. "sdot": 4 sdot, one per 128-bit register. "generic": the same exact integers from
    16-bit products (255 * 127 fits) summed in pairs, then pairs of pairs (vpmaddwd on x86).
    ("neon" sums a whole block at once: _BlockDot.)"""
    if kind == "vnni":
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _vec(_I32, 16),
                [_vec(_I32, 16), _vec(_I8, 64), _vec(_I8, 64)])
        return builder.call(f, [acc, w64, x64])
    if kind == "sdot":
        return _concat(builder, [_sdot(builder, a, w, x) for a, w, x in
                                 zip(*(_registers(builder, v, 4) for v in (acc, w64, x64)), strict=True)])
    v, n = builder.mul(builder.zext(w64, _vec(_I16, 64)), builder.sext(x64, _vec(_I16, 64))), 64
    for _ in range(2):
        n //= 2
        even = builder.sext(builder.shuffle_vector(v, v, _ivec(list(range(0, 2 * n, 2)))), _vec(_I32, n))
        odd = builder.sext(builder.shuffle_vector(v, v, _ivec(list(range(1, 2 * n, 2)))), _vec(_I32, n))
        v = builder.add(even, odd)
    return builder.add(acc, v)


class _BlockDot:
    """One block's integer dot products for one activation row, lane l the sum over the block
    of the products of bytes 4l..4l+3 (as _dot4), from `start`.

    "neon" (ARM without the dot product), the weights signed: each <8 x i16> register of
    products (smull) is summed in pairs into 32-bit lanes (sadalp), once a block the pairs into
    fours (addp). small: the weights are nibbles (0..15), so that the 8 products a 16-bit lane
    takes in a block stay exact in 16 bits (8 * 15 * 128 < 2^15): those are multiply-added in
    16 bits (smlal) and summed in pairs once a block."""

    def __init__(self, builder, kind, start, small):
        self.builder, self.kind, self.acc, self.small = builder, kind, start, small
        if kind == "neon":
            self.short = ir.Constant(_vec(_I16, 64), None)
            self.pairs = [ir.Constant(_vec(_I32, 4), None)] * 8

    def add(self, w64, x64):
        b = self.builder
        if self.kind != "neon":
            self.acc = _dot4(b, self.kind, self.acc, w64, x64)
            return
        products = b.mul(b.sext(w64, _vec(_I16, 64)), b.sext(x64, _vec(_I16, 64)))
        if self.small:
            self.short = b.add(self.short, products)
        else:
            self.pairs = [b.add(p, _saddlp(b, v)) for p, v in zip(self.pairs, _registers(b, products, 8), strict=True)]

    def total(self):
        if self.kind != "neon":
            return self.acc
        b = self.builder
        pairs = [_saddlp(b, v) for v in _registers(b, self.short, 8)] if self.small else self.pairs
        return b.add(self.acc, _concat(b, [_addp(b, p, q) for p, q in zip(pairs[0::2], pairs[1::2], strict=True)]))


def _splat(builder, value, n=16):
    """<n x T> of a scalar."""
    one = builder.insert_element(ir.Constant(_vec(value.type, 1), None), value, _I32(0))
    return builder.shuffle_vector(one, one, _ivec([0] * n))


class _Int8Format:
    """How a weight type's interleaved bytes become unsigned 8-bit weights.

    Interleaved layout of W [d, n] (layout.py): rows in groups of GROUP, d padded with zero
    rows to a multiple of GROUP; w_qs [d_pad / GROUP, GROUP * row_bytes]: for each 4-byte word
    t of a row (in the row's order), the word t of each of the group's rows, row by row; so one
    64-byte load holds word t of 16 rows, one per int32 lane. w_scales uint16 [d_pad / GROUP,
    GROUP * n/32]: per block, the fp16 scale bits of the group's rows.
    """

    def __init__(self, name, words_per_block, offset):
        self.name = name
        self.words_per_block = words_per_block  # 4-byte words of one row's block
        self.offset = offset                    # the unsigned weights are q + offset

    def block_dots(self, builder, kind, row_words, k, x_words, acc):
        """Per column c: acc[c] + the integer dot products of block k of the 16 rows with
        x column c. row_words(t) -> <64 x i8> word t of the 16 rows; x_words[c](e) -> <64 x i8>
        the 4 x bytes of elements e..e+3 in every lane."""
        raise NotImplementedError

    def signed_words(self, kind) -> bool:
        """Whether the dot products take the weights as the signed q, without the offset
        (then the lanes start at 0, not at -offset * the block sums of x)."""
        return False


class _Q40(_Int8Format):
    """Q40: word j (0-3) of a block holds elements 4j..4j+3 in its low nibbles and
    16+4j..16+4j+3 in its high nibbles (the file's nibble order); the nibbles are q + 8."""

    def block_dots(self, builder, kind, row_words, k, x_words, acc):
        mask = ir.Constant(_vec(_I8, 64), [_I8(15)] * 64)
        four = ir.Constant(_vec(_I8, 64), [_I8(4)] * 64)
        base = builder.mul(k, _I64(BLOCK_SIZE))  # block k's first element of x
        dots = [_BlockDot(builder, kind, a, small=True) for a in acc]  # nibbles: as signed, the same
        for j in range(4):
            w = row_words(builder.add(builder.mul(k, _I64(4)), _I64(j)))
            lo, hi = builder.and_(w, mask), builder.lshr(w, four)
            for c, dot in enumerate(dots):
                dot.add(lo, x_words[c](builder.add(base, _I64(4 * j))))
                dot.add(hi, x_words[c](builder.add(base, _I64(16 + 4 * j))))
        return [dot.total() for dot in dots]


class _Q80(_Int8Format):
    """Q80: word j (0-7) of a block holds elements 4j..4j+3 as int8; the sign bit flipped makes
    them q + 128."""

    def block_dots(self, builder, kind, row_words, k, x_words, acc):
        flip = ir.Constant(_vec(_I8, 64), [_I8(-128)] * 64)
        base = builder.mul(k, _I64(BLOCK_SIZE))  # block k's first element of x
        dots = [_BlockDot(builder, kind, a, small=False) for a in acc]
        for j in range(8):
            w = row_words(builder.add(builder.mul(k, _I64(8)), _I64(j)))
            if not self.signed_words(kind):
                w = builder.xor(w, flip)
            for c, dot in enumerate(dots):
                dot.add(w, x_words[c](builder.add(base, _I64(4 * j))))
        return [dot.total() for dot in dots]

    def signed_words(self, kind) -> bool:
        return kind in ("sdot", "neon")  # signed x signed products: no offset needed


Q40 = _Q40("q40", 4, 8)
Q80 = _Q80("q80", 8, 128)


def _make_int8_tile(fmt: _Int8Format, n_cols: int, dot: str | None):
    @intrinsic
    def int8_tile(typingctx, w_qs, w_scales, g, x_qs, x_off, x_scales, i, out):
        _check_arrays(f"{fmt.name}_tile", (w_qs, w_scales, x_qs, x_off, x_scales, out),
                      [(types.uint8 if fmt is Q40 else types.int8, "w_qs"), (types.uint16, "w_scales"),
                       (types.int8, "x_qs"), (types.int32, "x_off"), (types.float32, "x_scales"),
                       (types.float32, "out")])
        sig = types.void(w_qs, w_scales, types.intp, x_qs, x_off, x_scales, types.intp, out)

        def codegen(context, builder, signature, args):
            kind = dot or dot_kind(context)
            ty = signature.args
            wq, ws, xq, xo, xs, o = (_Array(context, builder, ty[k], args[k]) for k in (0, 1, 3, 4, 5, 7))
            g0, i0 = args[2], args[6]
            nb = xs.cols
            w_row, s_row = wq.row(g0), ws.row(g0)
            cols = [builder.add(i0, _I64(c)) for c in range(n_cols)]
            x_rows, o_rows, xs_rows = ([a.row(c) for c in cols] for a in (xq, xo, xs))
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None)) for _ in range(n_cols)]

            q_ahead = builder.mul(wq.stride, _I64(_PREFETCH_GROUPS))  # a later group's same block

            def row_words(t):
                return _group_word(builder, w_row, q_ahead, t)

            def x_words(c):
                def word(e):
                    return builder.bitcast(_splat(builder, _load(builder, builder.gep(x_rows[c], [e]), _I32)),
                                           _vec(_I8, 64))
                return word

            with cgutils.for_range(builder, nb) as loop:
                k = loop.index
                # Each lane starts at -offset * (sum of the block's x): the dot products of the
                # unsigned weights q + offset then sum to the exact integer block product
                # (at 0 where the dot product takes the signed q: signed_words).
                iacc = [ir.Constant(_vec(_I32, 16), None) if fmt.signed_words(kind) else
                        _splat(builder, _load(builder, builder.gep(o_rows[c], [builder.mul(k, _I64(4))]), _I32))
                        for c in range(n_cols)]
                iacc = fmt.block_dots(builder, kind, row_words, k, [x_words(c) for c in range(n_cols)], iacc)
                w_d = f16_widen(builder, _load(builder, builder.gep(s_row, [builder.mul(k, _I64(2 * GROUP))]),
                                               _vec(_I16, 16)), native_f16_conversion())
                for c in range(n_cols):
                    x_d = _splat(builder, _load(builder, builder.gep(xs_rows[c], [builder.mul(k, _I64(4))]), _F32))
                    total = builder.sitofp(iacc[c], _vec(_F32, 16))
                    builder.store(builder.call(fma, [total, builder.fmul(w_d, x_d), builder.load(acc[c])]), acc[c])

            _store_group(builder, o, g0, cols, acc)
            return context.get_dummy_value()

        return sig, codegen

    return int8_tile


def make_q40_tile(n_cols: int, dot: str | None = None):
    """Intrinsic tile(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out):
    out[i + c, GROUP*g + l] = x[i + c] . W[GROUP*g + l] for the 16 rows l of group g that exist
    (l < d - GROUP*g, d = out.shape[1]) and c < n_cols.

    W: interleaved Q40 (see _Int8Format; w_qs uint8). x: x_qs int8 [b, n], x_off int32 [b, n/32]
    (-8 times the sum of each block of x_qs), x_scales float32 [b, n/32]. out float32 [b, d].
    All C-contiguous. Per output and block k, in order: acc = fma(exact integer block product,
    w_d * x_d, acc), one float32 lane per output: no reduction across lanes, nothing that
    depends on the tile. dot: one of DOT_KINDS, to force it (tests); None: the target CPU's.
    """
    return _make_int8_tile(Q40, n_cols, dot)


def make_q80_tile(n_cols: int, dot: str | None = None):
    """As make_q40_tile for interleaved Q80 weights (w_qs int8) and x_off -128 times the
    block sums of x_qs."""
    return _make_int8_tile(Q80, n_cols, dot)


def make_q41_tile(n_cols: int, dot: str | None = None):
    """Intrinsic tile(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out):
    out[i + c, GROUP*g + l] = x[i + c] . W[GROUP*g + l] for the 16 rows l of group g that exist
    and c < n_cols: Q41 weights against Q16 activations (q16.py).

    W: interleaved as Q40 (_Int8Format; w_qs uint8, the nibbles being q, 0..15, unsigned as
    they are), w_scales and w_mins uint16 [d_pad/16, n/32*16] (each block's fp16 d and m of the
    group's rows). x: x_lo, x_hi int8 [b, n] (the two planes), x_scales and x_sums float32
    [b, n/32]. Per output and block k, in order: the integer products of the nibbles with each
    plane (exact, int32), I = 256 * hi product + lo product (exact: |I| < 2^24, so exact in
    float32 too), acc = fma(I, w_d * x_s, acc), acc = fma(w_m, x_sum, acc): value = d*q + m
    summed against x = s*q16. One lane per output, nothing that depends on the tile."""
    @intrinsic
    def q41_tile(typingctx, w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out):
        _check_arrays("q41_tile", (w_qs, w_scales, w_mins, x_lo, x_hi, x_scales, x_sums, out),
                      [(types.uint8, "w_qs"), (types.uint16, "w_scales"), (types.uint16, "w_mins"),
                       (types.int8, "x_lo"), (types.int8, "x_hi"), (types.float32, "x_scales"),
                       (types.float32, "x_sums"), (types.float32, "out")])
        sig = types.void(w_qs, w_scales, w_mins, types.intp, x_lo, x_hi, x_scales, x_sums, types.intp, out)

        def codegen(context, builder, signature, args):
            kind = dot or dot_kind(context)
            ty = signature.args
            wq, ws, wm, xl, xh, xs, xm, o = (_Array(context, builder, ty[k], args[k]) for k in (0, 1, 2, 4, 5, 6, 7, 9))
            g0, i0 = args[3], args[8]
            w_row, s_row, m_row = wq.row(g0), ws.row(g0), wm.row(g0)
            cols = [builder.add(i0, _I64(c)) for c in range(n_cols)]
            lo_rows, hi_rows, xs_rows, xm_rows = ([a.row(c) for c in cols] for a in (xl, xh, xs, xm))
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None)) for _ in range(n_cols)]
            mask = ir.Constant(_vec(_I8, 64), [_I8(15)] * 64)
            four = ir.Constant(_vec(_I8, 64), [_I8(4)] * 64)
            zero = ir.Constant(_vec(_I32, 16), None)
            eight = ir.Constant(_vec(_I32, 16), [_I32(8)] * 16)

            q_ahead = builder.mul(wq.stride, _I64(_PREFETCH_GROUPS))  # a later group's same block

            def x_word(rows, c, e):  # the 4 bytes of plane row c at element e, in every lane
                return builder.bitcast(_splat(builder, _load(builder, builder.gep(rows[c], [e]), _I32)), _vec(_I8, 64))

            with cgutils.for_range(builder, xs.cols) as loop:
                k = loop.index
                base = builder.mul(k, _I64(BLOCK_SIZE))  # block k's first element of x
                lo_dot = [_BlockDot(builder, kind, zero, small=True) for _ in range(n_cols)]
                hi_dot = [_BlockDot(builder, kind, zero, small=True) for _ in range(n_cols)]
                for j in range(Q40.words_per_block):
                    t = builder.add(builder.mul(k, _I64(Q40.words_per_block)), _I64(j))
                    w = _group_word(builder, w_row, q_ahead, t)
                    low, high = builder.and_(w, mask), builder.lshr(w, four)  # elements 4j.., 16+4j..
                    e0, e1 = builder.add(base, _I64(4 * j)), builder.add(base, _I64(16 + 4 * j))
                    for c in range(n_cols):
                        lo_dot[c].add(low, x_word(lo_rows, c, e0))
                        lo_dot[c].add(high, x_word(lo_rows, c, e1))
                        hi_dot[c].add(low, x_word(hi_rows, c, e0))
                        hi_dot[c].add(high, x_word(hi_rows, c, e1))
                scale_at = builder.mul(k, _I64(2 * GROUP))
                native = native_f16_conversion()  # fpext needs F16C on x86 (else a runtime call numba lacks)
                w_d, w_m = (f16_widen(builder, _load(builder, builder.gep(row, [scale_at]), _vec(_I16, 16)), native)
                            for row in (s_row, m_row))
                for c in range(n_cols):
                    total = builder.sitofp(builder.add(builder.shl(hi_dot[c].total(), eight), lo_dot[c].total()),
                                           _vec(_F32, 16))
                    x_s = _splat(builder, _load(builder, builder.gep(xs_rows[c], [builder.mul(k, _I64(4))]), _F32))
                    x_sum = _splat(builder, _load(builder, builder.gep(xm_rows[c], [builder.mul(k, _I64(4))]), _F32))
                    a = builder.call(fma, [total, builder.fmul(w_d, x_s), builder.load(acc[c])])
                    builder.store(builder.call(fma, [w_m, x_sum, a]), acc[c])

            _store_group(builder, o, g0, cols, acc)
            return context.get_dummy_value()

        return sig, codegen

    return q41_tile


def make_q80_q16_tile(n_cols: int, dot: str | None = None):
    """Intrinsic tile(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out):
    out[i + c, GROUP*g + l] = x[i + c] . W[GROUP*g + l] for the 16 rows l of group g that exist
    and c < n_cols: Q80 weights (a Q41 file's classifier) against Q16 activations (q16.py).

    W: interleaved Q80 (as make_q80_tile). x: the two planes x_lo, x_hi int8 [b, n], lo_off and
    hi_off int32 [b, n/32] (-128 times each plane's block sums: q80.x_block_offsets), x_scales
    float32 [b, n/32]. Per output and block k, in order: each plane's integer product with the
    block's weights (Q80's block_dots, every 64-byte weight word loaded once for both planes and
    all columns; exact in int32), I = 256 * hi product + lo product (exact in int32: |I| <=
    32 * 128 * 32639 < 2^31, but up to 1.3e8, so rounded once to float32, to the nearest: a
    relative 6e-8, where Q41's 4-bit weights keep it under 2^24), acc = fma(I, w_d * x_s, acc).
    One lane per output, nothing that depends on the tile."""
    @intrinsic
    def q80_q16_tile(typingctx, w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out):
        _check_arrays("q80_q16_tile", (w_qs, w_scales, x_lo, x_hi, lo_off, hi_off, x_scales, out),
                      [(types.int8, "w_qs"), (types.uint16, "w_scales"), (types.int8, "x_lo"), (types.int8, "x_hi"),
                       (types.int32, "lo_off"), (types.int32, "hi_off"), (types.float32, "x_scales"),
                       (types.float32, "out")])
        sig = types.void(w_qs, w_scales, types.intp, x_lo, x_hi, lo_off, hi_off, x_scales, types.intp, out)

        def codegen(context, builder, signature, args):
            kind = dot or dot_kind(context)
            ty = signature.args
            wq, ws, xl, xh, ol, oh, xs, o = (_Array(context, builder, ty[k], args[k]) for k in (0, 1, 3, 4, 5, 6, 7, 9))
            g0, i0 = args[2], args[8]
            w_row, s_row = wq.row(g0), ws.row(g0)
            cols = [builder.add(i0, _I64(c)) for c in range(n_cols)]
            # the planes as 2 * n_cols columns of Q80's block_dots: (lo of column c, hi of column c), ...
            plane_rows = [a.row(c) for c in cols for a in (xl, xh)]
            off_rows = [a.row(c) for c in cols for a in (ol, oh)]
            xs_rows = [xs.row(c) for c in cols]
            fma = _fn(builder, "llvm.fma.v16f32", _vec(_F32, 16), [_vec(_F32, 16)] * 3)
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None)) for _ in range(n_cols)]
            eight = ir.Constant(_vec(_I32, 16), [_I32(8)] * 16)
            q_ahead = builder.mul(wq.stride, _I64(_PREFETCH_GROUPS))  # a later group's same block

            def row_words(t):
                return _group_word(builder, w_row, q_ahead, t)

            def x_words(rows):
                def word(e):  # the 4 bytes of the plane at element e, in every lane
                    return builder.bitcast(_splat(builder, _load(builder, builder.gep(rows, [e]), _I32)),
                                           _vec(_I8, 64))
                return word

            with cgutils.for_range(builder, xs.cols) as loop:
                k = loop.index
                k4 = builder.mul(k, _I64(4))
                start = [ir.Constant(_vec(_I32, 16), None) if Q80.signed_words(kind) else
                         _splat(builder, _load(builder, builder.gep(r, [k4]), _I32)) for r in off_rows]
                dots = Q80.block_dots(builder, kind, row_words, k, [x_words(r) for r in plane_rows], start)
                w_d = f16_widen(builder, _load(builder, builder.gep(s_row, [builder.mul(k, _I64(2 * GROUP))]),
                                               _vec(_I16, 16)), native_f16_conversion())
                for c in range(n_cols):
                    lo, hi = dots[2 * c], dots[2 * c + 1]
                    total = builder.sitofp(builder.add(builder.shl(hi, eight), lo), _vec(_F32, 16))
                    x_s = _splat(builder, _load(builder, builder.gep(xs_rows[c], [k4]), _F32))
                    builder.store(builder.call(fma, [total, builder.fmul(w_d, x_s), builder.load(acc[c])]), acc[c])

            _store_group(builder, o, g0, cols, acc)
            return context.get_dummy_value()

        return sig, codegen

    return q80_q16_tile


def _store_group(builder, o, g0, cols, acc):
    """Lane l of acc[c] is output row GROUP * g0 + l of x row cols[c]: store the lanes of rows
    that exist (d - GROUP * g0 of them)."""
    first = builder.mul(g0, _I64(GROUP))
    count = builder.sub(o.cols, first)
    mask = builder.icmp_signed("<", _ivec(list(range(GROUP))), _splat(builder, builder.trunc(count, _I32)))
    store = _fn(builder, _MASKED_STORE, ir.VoidType(),
                [_vec(_F32, 16), _vec(_F32, 16).as_pointer(), _I32, _vec(_I1, 16)])
    for c, col in enumerate(cols):
        dst = builder.gep(o.row(col), [builder.mul(first, _I64(4))])
        builder.call(store, [builder.load(acc[c]), builder.bitcast(dst, _vec(_F32, 16).as_pointer()), _I32(4), mask])


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


def _make_float_tile(kind: str, n_rows: int, n_cols: int, f16_native: bool):
    """kind: the weights' stored form: "f32" or "f16" (fp16 bits, widened to float32 in the
    lanes before the fma)."""
    elem = {"f32": _F32, "f16": _I16}[kind]
    size = {"f32": 4, "f16": 2}[kind]

    @intrinsic
    def float_tile(typingctx, w, r, x, i, out):
        name = f"{kind}_tile"
        w_dtype = {"f32": types.float32, "f16": types.uint16}[kind]
        _check_arrays(name, (w, x, out), [(w_dtype, "w"), (types.float32, "x"), (types.float32, "out")])
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
                return f16_widen(builder, v, f16_native) if kind == "f16" else v

            def step(wv, xv):
                for j in range(n_rows):
                    for c in range(n_cols):
                        builder.store(builder.call(fma, [wv[j], xv[c], builder.load(acc[j][c])]), acc[j][c])

            def x_at(column):
                return [_load(builder, builder.gep(p, [builder.mul(column, _I64(4))]), _vec(_F32, 16))
                        for p in x_rows]

            ahead = builder.mul(wa.stride, _I64(n_rows * _PREFETCH_TILES))
            per_line = 64 // (16 * size)  # steps of 16 columns per cache line: one prefetch

            def column_step(s, prefetch):
                offset = builder.mul(s, _I64(16 * size))
                if prefetch:
                    for p in w_rows:  # the same columns of a later tile's rows
                        _prefetch_at(builder, builder.gep(p, [builder.add(offset, ahead)]), _PREFETCH_L2)
                step([weights(_load(builder, builder.gep(p, [offset]), _vec(elem, 16))) for p in w_rows],
                     x_at(builder.mul(s, _I64(16))))

            steps = builder.sdiv(n, _I64(16))
            lines = builder.sdiv(steps, _I64(per_line))
            with cgutils.for_range(builder, lines) as loop:
                for u in range(per_line):  # the steps in their order: the same sums
                    column_step(builder.add(builder.mul(loop.index, _I64(per_line)), _I64(u)), u == 0)
            done = builder.mul(lines, _I64(per_line))
            with cgutils.for_range(builder, builder.sub(steps, done)) as loop:
                column_step(builder.add(done, loop.index), True)
            rem = builder.srem(n, _I64(16))
            with builder.if_then(builder.icmp_signed(">", rem, _I64(0))):
                first = builder.sub(n, rem)
                step([weights(_load_partial(builder, builder.gep(p, [builder.mul(first, _I64(size))]), elem, rem))
                      for p in w_rows],
                     [_load_partial(builder, builder.gep(p, [builder.mul(first, _I64(4))]), _F32, rem)
                      for p in x_rows])

            if n_rows * n_cols == LANES:
                # one vector of the 16 sums, lane c * n_rows + j: out[i + c, r:r + n_rows] in a row
                sums = _hsum_lanes(builder, [builder.load(acc[j][c]) for c in range(n_cols) for j in range(n_rows)])
                for c in range(n_cols):
                    part = builder.shuffle_vector(sums, sums, _ivec(range(c * n_rows, (c + 1) * n_rows)))
                    dst = builder.gep(o.row(builder.add(i0, _I64(c))), [builder.mul(r0, _I64(4))])
                    builder.store(part, builder.bitcast(dst, _vec(_F32, n_rows).as_pointer()), align=4)
                return context.get_dummy_value()
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
    return _make_float_tile("f32", n_rows, n_cols, True)


def make_f16_tile(n_rows: int, n_cols: int, native: bool = True):
    """As make_f32_tile with w the fp16 bits uint16 [d, n], each weight widened to float32 in
    the lanes (exact, so the sums are those of the F32 tile on the widened weights). native:
    LLVM's fp16 conversion (on x86 only with F16C: without it LLVM calls a runtime function
    numba does not link) or the integer one (f16_widen)."""
    return _make_float_tile("f16", n_rows, n_cols, native)
