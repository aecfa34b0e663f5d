"""numba for the codec and fingerprint kernels, imported once, made safe beside vLLM.

llvmlite's shared-library wrapper (`llvmlite.binding.ffi.lib`) answers *any* attribute name with
a wrapped C symbol, dunder names included: `lib.__dict__` is not a dict. vLLM 0.32 walks every
loaded module's namespace at engine start-up (`vllm/triton_utils/dispatcher.py`, reading
`vars(value).get("kernel")`) and crashes on it, so an engine could not start in a process that had
imported numba. Dunder names are never C symbols: the wrapper now raises AttributeError for them,
as ctypes' own CDLL does.
"""

from __future__ import annotations

import numba


def _harden_llvmlite() -> None:
    try:
        from llvmlite.binding import ffi
    except Exception:  # pragma: no cover - layout differs in another llvmlite
        return
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_stitch_no_dunders", False):
        return
    orig = cls.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return orig(self, name)

    cls.__getattr__ = __getattr__
    cls._stitch_no_dunders = True


_harden_llvmlite()


def _prefetch_intrinsic():
    """`prefetch(arr, i)` in numba kernels: LLVM's prefetch of &arr[i] (read, keep in all cache
    levels). A hint only: it never faults and changes no value. The codec's apply kernel issues
    it when it decodes a position, some iterations before it loads the element there."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, idx):
        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(
                context, builder, aryty, ary, [args[1]], wraparound=False
            )
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.declare_intrinsic(
                "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            )
            # (address, 0 = read, 3 = high locality, 1 = data cache)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return prefetch


prefetch = _prefetch_intrinsic()

# the fingerprint's 32-bit mixer (format.fingerprint.mix32), x ^= x>>16; x *= M; twice; x ^= x>>16
MIX_MUL = 0x45D9F3B
SUM32_BLOCK = 1 << 16  # most elements per `sum32_block` call: its 16-bit half-sums stay in 32 bits


def _emit_mix32(builder, v):
    from llvmlite import ir

    mul, shift = ir.IntType(32)(MIX_MUL), ir.IntType(32)(16)
    v = builder.xor(v, builder.lshr(v, shift))
    v = builder.mul(v, mul)
    v = builder.xor(v, builder.lshr(v, shift))
    v = builder.mul(v, mul)
    return builder.xor(v, builder.lshr(v, shift))


def _as_i32(builder, v):
    from llvmlite import ir

    i32 = ir.IntType(32)
    w = v.type.width
    return builder.trunc(v, i32) if w > 32 else builder.zext(v, i32) if w < 32 else v


def _sum32_block_intrinsic():
    """`sum32_block(bits, start, count, pos0, seed, mask)` in numba kernels: the fingerprint's
    sum of h over `count` <= SUM32_BLOCK contiguous elements of a 1-D C-contiguous integer array
    of at most 4-byte items, from index `start`, whose flat positions are `pos0 .. pos0+count-1`,
    all below 2^32:

        sum over j of mix32(mix32((pos0 + j) ^ seed) ^ (bits[start + j] & mask))

    as an int64 in [0, 2^48). Written as LLVM IR because numba types every integer operation
    at 64 bits: the same loop in numba code multiplies and accumulates 64-bit lanes, so the
    vectorizer gets 4 lanes per 256-bit register. Here every operation is 32-bit (position,
    mixer, and two accumulators for the low and high 16-bit halves of each hash, which cannot
    overflow in SUM32_BLOCK steps), so it gets 8 or 16. Checked against the torch reference in
    tests/test_fingerprint.py. numba's on-disk cache of a caller is keyed on the caller's own
    source file: a change to this code generation alone does not invalidate it (touch the
    caller, format/fingerprint.py, or clear NUMBA_CACHE_DIR)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def sum32_block(typingctx, bits, start, count, pos0, seed, mask):
        if not (
            isinstance(bits, types.Array)
            and bits.ndim == 1
            and bits.layout == "C"
            and isinstance(bits.dtype, types.Integer)
        ):
            return None

        def codegen(context, builder, signature, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            data = builder.gep(ary.data, [args[1]])
            n = _as_i32(builder, args[2])
            p0, sd, mk = (_as_i32(builder, a) for a in args[3:6])
            lo = cgutils.alloca_once_value(builder, i32(0))
            hi = cgutils.alloca_once_value(builder, i32(0))
            with cgutils.for_range(builder, n) as loop:
                j = loop.index
                b = _as_i32(builder, builder.load(builder.gep(data, [j])))
                a = _emit_mix32(builder, builder.xor(builder.add(p0, j), sd))
                h = _emit_mix32(builder, builder.xor(a, builder.and_(b, mk)))
                builder.store(builder.add(builder.load(lo), builder.and_(h, i32(0xFFFF))), lo)
                builder.store(builder.add(builder.load(hi), builder.lshr(h, i32(16))), hi)
            low = builder.zext(builder.load(lo), i64)
            high = builder.shl(builder.zext(builder.load(hi), i64), i64(16))
            return builder.add(low, high)

        return types.int64(bits, start, count, pos0, seed, mask), codegen

    return sum32_block


sum32_block = _sum32_block_intrinsic()

__all__ = ["MIX_MUL", "SUM32_BLOCK", "numba", "prefetch", "sum32_block"]
