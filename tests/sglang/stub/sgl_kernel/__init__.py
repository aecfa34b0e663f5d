"""Test-only stand-in for SGLang's kernel package ``sgl_kernel`` (package ``sglang-kernel``).

There is no CPU build of ``sglang-kernel`` on the registry (the wheel needs libcuda). SGLang's CPU
engine (``SGLANG_USE_CPU_ENGINE=1``) still imports ``sgl_kernel`` and a few of its submodules at
import time, but on dense models (Qwen2/Llama, ``--attention-backend torch_native``) calls none
of them. Put ``tests/sglang/stub`` first on PYTHONPATH so that this package shadows the real one.

Every attribute (``sgl_kernel.X`` and ``sgl_kernel.<any submodule>.X``) is a function that raises
``NotImplementedError`` naming itself when called, so an unexpected use fails loudly instead of
computing something wrong. Submodules are made on demand by a meta-path finder. Never ship this:
it is test scaffolding only.
"""

import importlib.abc as _abc
import importlib.machinery as _machinery
import sys as _sys
import types as _types

__version__ = "0.0.0+stitch-stub"
STITCH_STUB = True


def _stub_fn(qualname: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not available: sgl_kernel is a test stand-in "
                                  "(tests/sglang/stub); this code path needs the real kernel")

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    return stub


def _module_getattr(modname: str):
    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        fn = _stub_fn(f"{modname}.{name}")
        setattr(_sys.modules[modname], name, fn)
        return fn

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _StubLoader(_abc.Loader):
    def create_module(self, spec):
        mod = _types.ModuleType(spec.name)
        mod.__path__ = []  # a package too: deeper submodules resolve through the finder
        mod.__getattr__ = _module_getattr(spec.name)
        mod.STITCH_STUB = True
        return mod

    def exec_module(self, module):
        pass


# Submodules that SGLang imports inside ``try: ... except ImportError:`` with a fallback of its own
# (``sglang/srt/layers/quantization/utils.py::get_scalar_types`` uses ``scalar_types.uint4b8`` at
# import time): these stay missing so that the fallback is taken.
_MISSING = {"sgl_kernel.scalar_type"}


class _StubFinder(_abc.MetaPathFinder):
    """Makes any ``sgl_kernel.<sub>[.<sub>...]`` module on demand (but those in ``_MISSING``)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + ".") or fullname in _MISSING:
            return None
        return _machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


if not any(isinstance(f, _StubFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_StubFinder())
