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
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                           wraparound=False)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.declare_intrinsic(
                "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
            # (address, 0 = read, 3 = high locality, 1 = data cache)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return prefetch


prefetch = _prefetch_intrinsic()

__all__ = ["numba", "prefetch"]
