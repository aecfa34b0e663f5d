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

__all__ = ["numba"]
