"""Run a function on a module as soon as it is imported (or now, if it already is).

Engine adapters wrap engine methods (post-load steps, kernel lists) that live in modules which
are expensive to import and which most engines never import (an FP8 module for a bf16 model).
`after_import` runs each hook on its module the moment the import finishes, through a meta-path
finder that delegates the finding to the other finders and only wraps the loader's
``exec_module``; modules already imported get their hook at once. Engine-agnostic.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType

__all__ = ["after_import"]

Hook = Callable[[ModuleType], object]
_HOOKS: dict[str, list[Hook]] = {}
_LOCK = threading.Lock()


def after_import(hooks: dict[str, Hook]) -> int:
    """Run ``hooks[name](module)`` once module `name` is imported: now for those already in
    ``sys.modules``, at the end of their import for the others. Returns how many ran now.
    A hook must be idempotent (a module imported twice, e.g. after a reload, runs it again)."""
    now = 0
    with _LOCK:
        for name, hook in hooks.items():
            mod = sys.modules.get(name)
            if mod is not None:
                hook(mod)
                now += 1
            elif hook not in (pending := _HOOKS.setdefault(name, [])):
                pending.append(hook)
        if _HOOKS and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
    return now


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the hooked modules through the other finders and runs their hooks once loaded."""

    def find_spec(self, name, path, target=None):
        hooks = _HOOKS.get(name)
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            for hook in list(_HOOKS.get(name, ())):
                hook(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
