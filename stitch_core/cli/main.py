"""The `stitch` command line: the parser and `main`.

The parser is built without importing any verb's implementation: the patch verbs (diff, apply,
inspect) run from `stitch_core.cli.patches`, imported when one of them is called; version verbs
are in `stitch_core.cli.versions` (and `keys`, `squash`, `gateway`); verbs of other packages
arrive through the ``stitch.cli`` entry-point group (`add_plugin_verbs`). `main` builds only the
chosen verb's group of parsers (a `stitch diff` imports neither the board stack nor a plugin);
any parse error or unknown verb falls back to the full parser, so usage, help and errors are
the full parser's. Every StitchError becomes exit 1 and one line on stderr."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from stitch_core.distribution import PRODUCER
from stitch_core.errors import StitchError

# `stitch --help`'s description (the text this module's docstring had before the verbs moved out)
DESCRIPTION = (
    "The `stitch` command line: the parser, the patch verbs (diff, apply, inspect) and `main`."
    """

Version verbs are in `stitch_core.cli.versions`; verbs of other packages arrive through the
``stitch.cli`` entry-point group (`add_plugin_verbs`). Every StitchError becomes exit 1 and one
line on stderr."""
)


class CliError(StitchError, RuntimeError):
    """Raised for a command-line request that cannot be carried out."""


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A verb's `fn` that imports `stitch_core.cli.<module>` only when the verb runs."""

    def fn(a: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"stitch_core.cli.{module}"), name)(a)

    fn.__name__ = fn.__qualname__ = name
    return fn


# ---------------------------------------------------------------- the verbs' parsers


def _add_patch_verbs(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diff", help="write the patch that turns BASE into NEW")
    d.add_argument("base", help=".safetensors file or HF directory")
    d.add_argument("new", help=".safetensors file or HF directory")
    d.add_argument("-o", "--output", required=True, help="patch file to write (.stp)")
    d.add_argument("--run", help="run name recorded in the patch")
    d.add_argument("--base-version", type=int)
    d.add_argument("--target-version", type=int)
    d.add_argument("--view", help="served view recorded in the patch (e.g. bf16)")
    d.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(fn=_lazy("patches", "cmd_diff"))

    ap = sub.add_parser("apply", help="reconstruct the target version from BASE and PATCH")
    ap.add_argument("base")
    ap.add_argument("patch")
    ap.add_argument("-o", "--output", required=True, help="written in the same form as BASE")
    ap.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.set_defaults(fn=_lazy("patches", "cmd_apply"))

    i = sub.add_parser("inspect", help="describe a patch")
    i.add_argument("patch")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--all", action="store_true", help="list unchanged tensors too")
    i.set_defaults(fn=_lazy("patches", "cmd_inspect"))


def _add_version_verbs(sub: argparse._SubParsersAction) -> None:
    from stitch_core.cli import versions

    versions.add_parsers(sub)


def _add_keys(sub: argparse._SubParsersAction) -> None:
    from stitch_core.cli import keys

    keys.add_parsers(sub)


def _add_squash(sub: argparse._SubParsersAction) -> None:
    from stitch_core.cli import squash

    squash.add_parsers(sub)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    from stitch_core.cli import gateway

    gateway.add_parsers(sub)


def _add_warm(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("warm", help="compile Stitch's kernels into numba's on-disk cache (run "
                       "once per image or persistent NUMBA_CACHE_DIR, before a first start)")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(fn=_lazy("warm", "cmd_warm"))


# the core's verbs by group, in the full parser's order (then the plugin verbs); a group's adder
# adds exactly these verbs (tests/test_cli_lazy.py checks it)
GROUPS: tuple[tuple[tuple[str, ...], Callable[[argparse._SubParsersAction], None]], ...] = (
    (("diff", "apply", "inspect"), _add_patch_verbs),
    (("up", "pull", "versions", "gc", "status", "board", "relay"), _add_version_verbs),
    (("keys",), _add_keys),
    (("plan", "squash"), _add_squash),
    (("gateway",), _add_gateway),
    (("warm",), _add_warm),
)


def _parser(adders, parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser):
    p = parser_class(prog="stitch", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=PRODUCER)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in adders:
        add(sub)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `stitch` argument parser: patch verbs, version verbs and plugin verbs."""
    return _parser([add for _, add in GROUPS] + [add_plugin_verbs])


class _OneGroupParseError(StitchError, ValueError):
    """A one-group parser met an error: the full parser parses again (and reports it)."""


class _OneGroupParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ARG002 - the full parser words the error
        raise _OneGroupParseError


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """A parser for `argv` holding only its verb's group (a core group, else the plugin verbs),
    each of its parsers reporting an error by raising `_OneGroupParseError`; the full parser for
    an argv with no verb first (``--help``, ``--version``, nothing)."""
    verb = argv[0] if argv and not argv[0].startswith("-") else None
    if verb is None:
        return build_parser()
    adders = [add for verbs, add in GROUPS if verb in verbs] or [add_plugin_verbs]
    return _parser(adders, _OneGroupParser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`argv` (default: the process's) parsed as the full parser would, building only the chosen
    verb's parsers where that can give no other result."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return parser_for(argv).parse_args(argv)
    except _OneGroupParseError:
        return build_parser().parse_args(argv)


def add_plugin_verbs(sub: argparse._SubParsersAction) -> None:
    """Verbs other packages add through the ``stitch.cli`` entry-point group (each entry point is a
    function taking the subparsers): `stitch_trainer` adds ``publish`` and ``analyze``."""
    for ep in sorted(entry_points(group="stitch.cli"), key=lambda e: e.name):
        ep.load()(sub)


def main(argv: list[str] | None = None) -> int:
    """Run the `stitch` command line on `argv`; returns the exit status."""
    args = parse_args(argv)
    try:
        return args.fn(args)
    except (StitchError, FileExistsError, ValueError) as e:  # every Stitch error is a StitchError
        print(f"stitch: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"stitch: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
