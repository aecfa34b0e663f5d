"""Old module paths of `stitch_core`, kept importable for one release.

Before the layered tree (format / versions / engine / serve / node / cli), every module sat flat
in `stitch_core` (`stitch_core.patch`, `stitch_core.coordinator`, `stitch_core.board.local`, ...).
A meta-path finder maps each old name to the module's new home and returns *that module object*
(so `stitch_core.patch is stitch_core.format.patch`: one module, one set of globals, monkeypatching
works as before), with a DeprecationWarning naming the new path. `stitch_core.versions` and
`stitch_core.engine` are packages now and re-export their old names themselves.

Written by hand (a dozen lines over importlib's finder protocol) because the standard library has
no module-alias mechanism and a shim file per old module would clutter the tree this replaces.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old module (relative to stitch_core) -> new module
MOVED: dict[str, str] = {
    **{m: f"format.{m}" for m in ("dtypes", "fingerprint", "entropy", "codec", "header", "stp",
                                  "patch", "views", "checkpoint")},
    **{m: f"versions.{m}" for m in ("manifest", "materialize", "announce", "natsserver",
                                    "follower")},
    "board": "versions.board",
    **{m: f"engine.{m}" for m in ("layout", "derived", "replica", "coordinator")},
    **{m: f"serve.{m}" for m in ("protocol", "gate", "asgi", "metrics")},
    "cli_versions": "cli.versions",
}
_PREFIX = "stitch_core."


def new_name(fullname: str) -> str | None:
    """The new module name for an old `stitch_core.*` name (None if it did not move)."""
    if not fullname.startswith(_PREFIX):
        return None
    head, _, rest = fullname[len(_PREFIX):].partition(".")
    if head not in MOVED:
        return None
    return _PREFIX + MOVED[head] + (f".{rest}" if rest else "")


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # already executed under its new name
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the old-path finder first on `sys.meta_path` (once: later calls do nothing)."""
    # first: a submodule of an old package path (`stitch_core.board.local`) would otherwise be
    # found through the aliased package's __path__ and loaded a second time under the old name
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
