"""Integer dot products of one 32-value sub-block of 16 interleaved weight rows with int16 activations,
written as vector IR (``quant_subblock``'s decode products): unsigned quants times signed 16-bit
activations, adjacent pairs of positions summed in 32 bits (``pmaddwd``). llama.cpp's ``ggml_vec_dot_q*``
round the activations to int8 (``pmaddubsw``); at 16 bits the rounding (1/65534 of a block's largest
activation) stays below float32 kernels' own differences in the logits, where 8 bits parted greedy
decoding from the float32 model's on 4 of 6 recorded prompts of the default model's Q4_K_M file.

Layout (``quant_subblock.repack_subblock``): a sub-block's 256 nibble bytes are 8 vectors of 32 bytes, one
per pair of positions p: byte ``2 r + e`` of vector p holds position ``2 p + e`` of row r in its low nibble
and position ``16 + 2 p + e`` in its high one. The high bits are 2 (5-bit) or 4 (6-bit) vectors of 32
bytes in the same ``2 r + e`` order: 5-bit vector h has bit p = the fifth bit of position ``16 h + 2 p +
e``; 6-bit vector t has bits ``2 k, 2 k + 1`` = the high bits of position ``16 h + 2 p + e`` with
``8 h + p = 4 t + k``. The activations are int16 (``quantize_activation``), read as int32 pairs.

With a pair of positions adjacent in each row, the quants widened to 16 bits and one ``pmaddwd`` per 8
rows (AVX2; a portable sext multiply and pairwise add elsewhere) give the rows' sums of two products in
32 bits (at most 16 * 63 * 32767 < 2^31 over a half sub-block).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from rawpaged.kernels.cpu.intrinsics import half_bits_to_float
from rawpaged.kernels.cpu.jit import JIT
from rawpaged.kernels.quantization import FORMAT_CODES, SUBBLOCK_BITS

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32B = ir.VectorType(_I8, 32)
_V16S = ir.VectorType(_I16, 16)
_V16I = ir.VectorType(_I32, 16)
_V32S = ir.VectorType(_I16, 32)
_F32 = ir.FloatType()
_V16F = ir.VectorType(_F32, 16)


def _splatf(builder, value):
    v = builder.insert_element(ir.Constant(_V16F, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V16F, None), ir.Constant(_V16I, [0] * 16))


def _host_has_avx2() -> bool:
    try:
        import llvmlite.binding as llvm  # deferred: LLVM's host query, only to pick the AVX2 instruction

        return bool(llvm.get_host_cpu_features().get("avx2"))
    except Exception:  # no feature query on this platform: the portable form
        return False


HAS_AVX2 = _host_has_avx2()


def _splat8(value: int):
    return ir.Constant(_V32B, [value & 0xFF] * 32)


_V8I = ir.VectorType(_I32, 8)


def _pmaddwd(builder, a, b):
    """<8 x i32>: a[2i] * b[2i] + a[2i + 1] * b[2i + 1] of <16 x i16> a and b (signed)."""
    if HAS_AVX2:
        fnty = ir.FunctionType(_V8I, [_V16S, _V16S])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [a, b])
    prod = builder.mul(builder.sext(a, _V16I), builder.sext(b, _V16I))
    even = builder.shuffle_vector(prod, ir.Constant(_V16I, None), ir.Constant(_V8I, list(range(0, 16, 2))))
    odd = builder.shuffle_vector(prod, ir.Constant(_V16I, None), ir.Constant(_V8I, list(range(1, 16, 2))))
    return builder.add(even, odd)


def _dot_pairs(builder, q, xpair):
    """<16 x i32>: for the 16 rows r, ``q[2 r] x0 + q[2 r + 1] x1`` (q: <32 x i8> unsigned quants, xpair:
    <16 x i16> holding (x0, x1) eight times)."""
    wide = builder.zext(q, _V32S)
    lo = builder.shuffle_vector(wide, ir.Constant(_V32S, None), ir.Constant(_V16I, list(range(16))))
    hi = builder.shuffle_vector(wide, ir.Constant(_V32S, None), ir.Constant(_V16I, list(range(16, 32))))
    a, b = _pmaddwd(builder, lo, xpair), _pmaddwd(builder, hi, xpair)
    return builder.shuffle_vector(a, b, ir.Constant(_V16I, list(range(16))))


def _half_to_float16(builder, bits16):
    """<16 x float> of <16 x i16> fp16 bit patterns (``intrinsics.half_to_float``'s arithmetic, on vectors)."""
    return half_bits_to_float(builder, bits16, _V16I, _V16F)


#: format code -> bits per quant, for the five formats these products take
BITS = {FORMAT_CODES[name]: bits for name, bits in SUBBLOCK_BITS.items()}


def _make(nr: int):
    def typer(
        typingctx, fmt, qs, qs_off, qh, qh_off, xq16, x_off, x_stride, scales, mins, sc_off, sub, sub_off, dx, dx_off,
        dx_stride, xs, xs_off, xs_stride, acc, acc_off,
    ):  # fmt: skip
        arrays = ((qs, types.uint8), (qh, types.uint8), (xq16, types.int32), (scales, types.uint16))
        arrays += ((mins, types.uint16), (sub, types.uint8), (dx, types.float32), (xs, types.float32))
        arrays += ((acc, types.float32),)
        ok = all(isinstance(a, types.Array) and a.dtype == t for a, t in arrays)
        ints = (qs_off, qh_off, x_off, x_stride, sc_off, sub_off, dx_off, dx_stride, xs_off, xs_stride, acc_off)
        ok = ok and all(isinstance(t, types.Integer) for t in ints + (fmt,))
        if not ok:
            return None

        def codegen(context, builder, sig, all_args):
            fmt_v = context.cast(builder, all_args[0], sig.args[0], types.int64)
            sig = types.void(*sig.args[1:])
            args = all_args[1:]

            def ptr(i, off_i, elem):
                data = context.make_array(sig.args[i])(context, builder, args[i]).data
                base = builder.bitcast(data, elem.as_pointer())
                return builder.gep(base, [context.cast(builder, args[off_i], sig.args[off_i], types.intp)])

            def intp(i):
                return context.cast(builder, args[i], sig.args[i], types.intp)

            def emit(fmt):
                bits = BITS[fmt]
                qbase = ptr(0, 1, _I8)
                xbase = ptr(4, 5, _I32)
                x_stride_v = intp(6)

                def vec(base, i, vt=_V32B, step=32):
                    p = builder.gep(base, [ir.Constant(_I32, step * i)])
                    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)

                high = []
                if bits > 4:
                    hbase = ptr(2, 3, _I8)
                    high = [vec(hbase, i) for i in range(2 if bits == 5 else 4)]

                row_x = [
                    builder.gep(xbase, [builder.mul(x_stride_v, ir.Constant(x_stride_v.type, i))]) for i in range(nr)
                ]

                def x_pair(i, k):
                    v = builder.load(builder.gep(row_x[i], [ir.Constant(_I32, k)]), align=4)
                    s = builder.insert_element(ir.Constant(_V8I, None), v, ir.Constant(_I32, 0))
                    s = builder.shuffle_vector(s, ir.Constant(_V8I, None), ir.Constant(_V8I, [0] * 8))
                    return builder.bitcast(s, _V16S)

                def high_bits(h, p):
                    if bits == 5:
                        b = builder.and_(builder.lshr(high[h], _splat8(p)), _splat8(1))
                    else:
                        c = 8 * h + p
                        b = builder.and_(builder.lshr(high[c // 4], _splat8(2 * (c % 4))), _splat8(3))
                    return builder.shl(b, _splat8(4))

                zero = ir.Constant(_V16I, [0] * 16)
                acc = [[zero, zero] for _ in range(nr)]
                for p in range(8):
                    v = vec(qbase, p)
                    halves = [builder.and_(v, _splat8(15)), builder.lshr(v, _splat8(4))]
                    for h in range(2):
                        q = halves[h]
                        if bits > 4:
                            q = builder.or_(q, high_bits(h, p))
                        for i in range(nr):  # the quants once, against each row's activations
                            acc[i][h] = builder.add(acc[i][h], _dot_pairs(builder, q, x_pair(i, 8 * h + p)))

                # the sub-block's coefficients for the 16 rows: a_h (scale of half h) and b_h (offset)
                v16h = ir.VectorType(_I16, 16)
                v16b = ir.VectorType(_I8, 16)
                d_scale = _half_to_float16(builder, vec(ptr(7, 9, _I16), 0, v16h, 16))
                if fmt == 3:
                    a = [d_scale, d_scale]
                    b = builder.fmul(d_scale, ir.Constant(_V16F, [-16.0] * 16))
                    off = [b, b]
                elif fmt == 4:
                    m = _half_to_float16(builder, vec(ptr(8, 9, _I16), 0, v16h, 16))
                    a, off = [d_scale, d_scale], [m, m]
                elif fmt == 7:
                    sbase = ptr(10, 11, _I8)
                    a = [builder.fmul(d_scale, builder.sitofp(vec(sbase, k, v16b, 16), _V16F)) for k in range(2)]
                    off = [builder.fmul(x, ir.Constant(_V16F, [-32.0] * 16)) for x in a]
                else:
                    sbase = ptr(10, 11, _I8)
                    dmin = _half_to_float16(builder, vec(ptr(8, 9, _I16), 0, v16h, 16))
                    sc = builder.fmul(d_scale, builder.uitofp(vec(sbase, 0, v16b, 16), _V16F))
                    mn = builder.fmul(dmin, builder.uitofp(vec(sbase, 1, v16b, 16), _V16F))
                    neg = builder.fsub(ir.Constant(_V16F, [0.0] * 16), mn)
                    a, off = [sc, sc], [neg, neg]

                fma = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]), "llvm.fmuladd.v16f32"
                )
                dxp, xsp, accb = ptr(12, 13, _F32), ptr(15, 16, _F32), ptr(18, 19, _F32)
                dx_stride_v, xs_stride_v = intp(14), intp(17)
                for i in range(nr):
                    ci = ir.Constant(dx_stride_v.type, i)
                    d_v = builder.load(builder.gep(dxp, [builder.mul(dx_stride_v, ci)]))
                    xsi = builder.gep(xsp, [builder.mul(xs_stride_v, ci)])
                    xs0_v = builder.load(xsi)
                    xs1_v = builder.load(builder.gep(xsi, [ir.Constant(_I32, 1)]))
                    accp = builder.bitcast(builder.gep(accb, [ir.Constant(_I32, 16 * i)]), _V16F.as_pointer())
                    dots = [builder.fmul(builder.sitofp(x, _V16F), _splatf(builder, d_v)) for x in acc[i]]
                    total = builder.load(accp, align=4)
                    total = builder.call(fma, [off[0], _splatf(builder, xs0_v), total])
                    total = builder.call(fma, [off[1], _splatf(builder, xs1_v), total])
                    total = builder.call(fma, [a[0], dots[0], total])
                    total = builder.call(fma, [a[1], dots[1], total])
                    builder.store(total, accp, align=4)

            merge = builder.append_basic_block("dot.end")
            switch = builder.switch(fmt_v, merge)
            for f in BITS:
                case = builder.append_basic_block(f"dot.fmt{f}")
                switch.add_case(ir.Constant(ir.IntType(64), f), case)
                builder.position_at_end(case)
                emit(f)
                builder.branch(merge)
            builder.position_at_end(merge)
            return context.get_dummy_value()

        sig = types.void(
            fmt, qs, qs_off, qh, qh_off, xq16, x_off, x_stride, scales, mins, sc_off, sub, sub_off, dx, dx_off,
            dx_stride, xs, xs_off, xs_stride, acc, acc_off,
        )  # fmt: skip
        return sig, codegen

    typer.__name__ = f"dot_rows{nr}"
    return intrinsic(typer)


#: ``dot1(fmt, qs, qs_off, qh, qh_off, xq16, x_off, x_stride, scales, mins, sc_off, sub, sub_off, dx, dx_off,
#: dx_stride, xs, xs_off, xs_stride, acc, acc_off)`` for one activation row and ``dot4(...)`` for four, the
#: format given by its code (``quant_subblock``'s 3-7; a switch over the five compiled bodies): with
#: ``idot_h[r]`` (int32) the sum over positions ``16 h .. 16 h + 15`` of weight row r's quant times
#: activation row i's int16 values (the sub-block whose nibbles start at byte ``qs_off`` of ``qs`` and high
#: bits at ``qh_off`` of ``qh``, unread for 4 bits; row i's pairs of int16 activations, as int32, at
#: ``xq16[x_off + i x_stride ..][:16]``), adds ``d_i (a_0[r] idot_0[r] + a_1[r] idot_1[r]) + b_0[r] xs_i0 +
#: b_1[r] xs_i1`` to ``acc[acc_off + 16 i + r]`` for r < 16, with ``d_i = dx[dx_off + i dx_stride]``,
#: ``xs_ih = xs[xs_off + i xs_stride + h]`` and the coefficients (``quant_subblock._coeffs``) computed from
#: the 16 weight rows' fp16 ``scales``/``mins`` at element ``sc_off`` and their sub-block bytes ``sub`` at
#: byte ``sub_off``. The quants are expanded once for all the activation rows. No bounds checks.
dot1 = _make(1)
dot4 = _make(4)


#: the activations' integer range: ``quantize_activation`` maps a block's largest |x| to this
QMAX = 32767


@nb.njit(**JIT)
def quantize_activation(x, xq, dx, xs):
    """Per 32-value block s of float32 ``x [K]``: ``dx[s] = max |x| / QMAX``, ``xq[s, j] = round(x / dx)``
    (int16; zeros where the block is zero), and ``xs[s, h]`` = the float32 sums of each 16-value half
    (for the formats' offsets, which take the unrounded activations): llama.cpp's ``quantize_row_q8_0``
    at 16 bits."""
    nsub = dx.shape[0]
    for s in range(nsub):
        amax = np.float32(0.0)
        a = np.float32(0.0)
        b = np.float32(0.0)
        for j in range(16):
            a += x[s * 32 + j]
            b += x[s * 32 + 16 + j]
        for j in range(32):
            amax = max(amax, abs(x[s * 32 + j]))
        xs[s, 0] = a
        xs[s, 1] = b
        d = amax / np.float32(QMAX)
        dx[s] = d
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for j in range(32):
            xq[s, j] = np.int16(np.floor(x[s * 32 + j] * inv + np.float32(0.5)))


def _make_rows(bits: int):
    """``sub_block_rows{bits}``: see ``sub_block_rows4``."""

    def typer(typingctx, qs, qs_off, qh, qh_off, cf, w, row0, col):
        ok = (
            isinstance(qs, types.Array)
            and qs.dtype == types.uint8
            and isinstance(qh, types.Array)
            and qh.dtype == types.uint8
            and isinstance(cf, types.Array)
            and cf.dtype == types.float32
            and isinstance(w, types.Array)
            and w.dtype == types.float32
            and w.ndim == 2
            and w.layout == "C"
            and all(isinstance(t, types.Integer) for t in (qs_off, qh_off, row0, col))
        )
        if not ok:
            return None

        def codegen(context, builder, sig, args):
            qs_t, qs_off_t, qh_t, qh_off_t, cf_t, w_t, row_t, col_t = sig.args
            qs_v, qs_off_v, qh_v, qh_off_v, cf_v, w_v, row_v, col_v = args
            intp = context.get_value_type(types.intp)

            def load(arr_t, arr, off_t, off, n):
                data = builder.bitcast(context.make_array(arr_t)(context, builder, arr).data, _I8.as_pointer())
                p = builder.gep(data, [context.cast(builder, off, off_t, types.intp)])
                vt = ir.VectorType(_I8, n)
                return builder.load(builder.bitcast(p, vt.as_pointer()), align=1), vt

            block, block_t = load(qs_t, qs_v, qs_off_t, qs_off_v, 256)
            if bits > 4:
                high, high_t = load(qh_t, qh_v, qh_off_t, qh_off_v, 64 if bits == 5 else 128)
            cfp = builder.bitcast(context.make_array(cf_t)(context, builder, cf_v).data, _F32.as_pointer())
            warr = context.make_array(w_t)(context, builder, w_v)
            wdata = builder.bitcast(warr.data, _I8.as_pointer())
            stride0 = builder.extract_value(warr.strides, 0)
            row0 = context.cast(builder, row_v, row_t, types.intp)
            col_bytes = builder.mul(context.cast(builder, col_v, col_t, types.intp), ir.Constant(intp, 4))
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]), "llvm.fmuladd.v16f32"
            )
            v16b = ir.VectorType(_I8, 16)

            def splat8(v):
                return ir.Constant(v16b, [v & 0xFF] * 16)

            for r in range(16):
                # row r's 16 nibble bytes in position order: byte 2 r + e of pair vector p is position 2 p + e
                pick = ir.Constant(ir.VectorType(_I32, 16), [32 * (j // 2) + 2 * r + (j % 2) for j in range(16)])
                q = builder.shuffle_vector(block, ir.Constant(block_t, None), pick)
                halves = [builder.and_(q, splat8(15)), builder.lshr(q, splat8(4))]
                row = builder.add(row0, ir.Constant(intp, r))
                rowp = builder.gep(wdata, [builder.add(builder.mul(row, stride0), col_bytes)])
                out = builder.bitcast(rowp, _V16F.as_pointer())
                v16i = ir.VectorType(_I32, 16)
                for h in range(2):
                    v = halves[h]
                    if bits > 4:
                        if bits == 5:  # vector h, byte 2 r + e, bit p
                            picks = [32 * h + 2 * r + (j % 2) for j in range(16)]
                            shifts, mask = [j // 2 for j in range(16)], 1
                        else:  # combo c = 8 h + p = 4 t + k: vector t, bits 2 k
                            cs = [8 * h + j // 2 for j in range(16)]
                            picks = [32 * (c // 4) + 2 * r + (j % 2) for j, c in enumerate(cs)]
                            shifts, mask = [2 * (c % 4) for c in cs], 3
                        hv = builder.shuffle_vector(high, ir.Constant(high_t, None), ir.Constant(v16i, picks))
                        b = builder.and_(builder.lshr(hv, ir.Constant(v16b, shifts)), splat8(mask))
                        v = builder.or_(v, builder.shl(b, splat8(4)))
                    a = builder.load(builder.gep(cfp, [ir.Constant(_I32, 16 * h + r)]))
                    b0 = builder.load(builder.gep(cfp, [ir.Constant(_I32, 16 * (2 + h) + r)]))
                    vals = builder.call(fma, [builder.uitofp(v, _V16F), _splatf(builder, a), _splatf(builder, b0)])
                    builder.store(vals, builder.gep(out, [ir.Constant(_I32, h)]), align=4)
            return context.get_dummy_value()

        return types.void(qs, qs_off, qh, qh_off, cf, w, row0, col), codegen

    typer.__name__ = f"sub_block_rows{bits}"
    return intrinsic(typer)


#: ``sub_block_rowsN(qs, qs_offset, qh, qh_offset, cf, w, row0, col)``: ``w[row0 + r, col + j]`` =
#: ``cf[h, r] * q_j(r) + cf[2 + h, r]`` (h = j // 16) for r < 16, j < 32: one N-bit sub-block of 16
#: interleaved rows (nibbles from byte ``qs_offset``, high bits from ``qh_offset``; module docstring)
#: dequantized into 16 rows of a C-contiguous float32 matrix, each row's bytes picked out by a constant
#: shuffle. ``cf``: C-contiguous float32 ``[4, 16]`` (``quant_subblock._coeffs``). No bounds checks.
sub_block_rows4 = _make_rows(4)
sub_block_rows5 = _make_rows(5)
sub_block_rows6 = _make_rows(6)
