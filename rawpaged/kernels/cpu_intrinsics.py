"""Scalar operations for Numba kernels, written as LLVM IR so that they keep their natural width.

Numba types integer arithmetic on small integers at 64 bits (``uint8 & 15`` is an int64), which halves or
quarters the width of the vectors LLVM builds from a loop. These helpers emit the operation on the
value's own width (``and i8``, ``lshr i8``, ``sitofp i8``) so that a loop over bytes vectorizes over
bytes. Each is an ordinary scalar function to the caller: LLVM vectorizes the loops around it.

- ``half_to_float(bits)``: the float32 value of an IEEE fp16 bit pattern (uint16), exact for every finite
  fp16 (normals and subnormals; ggml stores its block scales as fp16). Integer ops and one multiply,
  portable to every LLVM target (the ``fpext half`` instruction needs F16C on x86 or a runtime library
  call, which Numba's JIT does not link).
- ``low_nibble(q)`` / ``high_nibble(q)``: ``q & 15`` and ``q >> 4`` of a uint8, as float32.
- ``signed_byte(q)``: a uint8 read as int8 (two's complement), as float32 (``Q8_0``'s quants).
- ``prefetch(array, byte_offset)``: a read prefetch of the cache line at ``array``'s data + offset, into
  every cache level (``llvm.prefetch``; a no-op where the target has no prefetch instruction).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


@intrinsic
def half_to_float(typingctx, bits):
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        h = builder.zext(args[0], _I32)
        sign = builder.shl(builder.and_(h, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
        # exponent and mantissa moved to float32's fields: the value times 2^-112 (a subnormal fp16
        # becomes a float32 subnormal); the multiply restores the scale exactly.
        magnitude = builder.shl(builder.and_(h, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13))
        scaled = builder.fmul(builder.bitcast(magnitude, _F32), ir.Constant(_F32, 2.0**112))
        return builder.bitcast(builder.or_(builder.bitcast(scaled, _I32), sign), _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def low_nibble(typingctx, q):
    if q != types.uint8:
        return None

    def codegen(context, builder, sig, args):
        return builder.uitofp(builder.and_(args[0], ir.Constant(_I8, 15)), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def high_nibble(typingctx, q):
    if q != types.uint8:
        return None

    def codegen(context, builder, sig, args):
        return builder.uitofp(builder.lshr(args[0], ir.Constant(_I8, 4)), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def signed_byte(typingctx, q):
    if q != types.uint8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def prefetch(typingctx, array, byte_offset):
    if not isinstance(array, types.Array) or not isinstance(byte_offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p = _I8.as_pointer()
        offset = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.gep(builder.bitcast(data, i8p), [offset])
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # read (0), keep in all levels (3), data cache (1)
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(array, byte_offset), codegen
