"""The tree is the architecture: no import cycles, the public API pinned, no shims.

The allowed import directions themselves are import-linter contracts in pyproject.toml
(`lint-imports` in the test command); this module adds what import-linter does not check.
"""

from __future__ import annotations

import importlib

import grimp
import pytest

PACKAGES = ("stitch_core", "stitch_trainer", "stitch_vllm", "stitch_sglang")


def test_no_import_cycles():
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    cycles = []
    for mod in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(mod)):
            if imported.startswith(f"{mod}.") or mod.startswith(f"{imported}."):
                continue  # a package and its own submodules
            back = graph.find_shortest_chain(importer=imported, imported=mod)
            if back:
                cycles.append(" -> ".join([mod, *back]))
    assert cycles == []


# Every documented import path and the names it must keep exporting. A name may be added freely;
# removing or renaming one is a breaking change and must fail here first.
PUBLIC = {
    "stitch_core": ["Patch", "PatchError", "StitchError", "apply", "diff", "__version__"],
    "stitch_core.errors": ["StitchError"],
    "stitch_core.format.patch": ["Patch", "PatchBuilder", "PatchSet", "apply", "apply_entry",
                                 "diff"],
    "stitch_core.format.views": ["project"],
    "stitch_core.format.fingerprint": ["fingerprint", "state_fingerprints", "digest"],
    "stitch_core.format.stp": ["PatchError", "PatchReader", "PatchWriter"],
    "stitch_core.versions.store": ["Step", "VersionError", "fetch_patch", "list_manifests",
                                   "plan", "read_manifest", "write_version"],
    "stitch_core.versions.board": ["Board", "BoardError", "LatestConflictError", "LocalBoard",
                                   "NotFoundError", "ReadOnlyBoardError", "open_board"],
    "stitch_core.versions.manifest": ["Latest", "Manifest", "ObjectRef", "PULLED_MANIFEST",
                                      "Heartbeat", "GatewayHeartbeat"],
    "stitch_core.versions.materialize": ["apply_patches", "pull"],
    "stitch_core.versions.follower": ["Follower"],
    "stitch_core.versions.memory_replica": ["MemoryReplica"],
    "stitch_core.versions.natsserver": ["NatsServer"],
    "stitch_core.engine.coordinator": ["Coordinator"],
    "stitch_core.engine.proof": ["HeldState", "EngineStateError", "read_pulled_manifest"],
    "stitch_core.engine.replica": ["RankReplica", "ReplicaError", "register_handler"],
    "stitch_core.engine.rpc": ["Setup", "SetupReply", "Sums", "SumsReply", "Gather", "GatherReply",
                               "Held", "Write", "WriteReply", "Undo", "Commit", "Done", "Load",
                               "LoadFiles", "LoadReply", "Request", "Reply", "encode", "decode"],
    "stitch_core.engine.layout": ["Layout", "engine_params", "learn_layout"],
    "stitch_core.engine.derived": ["DerivedCopy", "register", "rebuild_from", "stale",
                                   "unmanaged"],
    "stitch_core.serve.gate": ["VersionGate"],
    "stitch_core.serve.asgi": ["StitchASGI"],
    "stitch_core.serve.gateway": ["Gateway", "ENGINE_HEADER"],
    "stitch_core.serve.routing": ["EngineTable", "EngineRow", "GatewayStatus"],
    "stitch_core.versions.announce": ["fleet", "gateways", "announce", "publish_heartbeat",
                                      "subscribe_versions", "speaks_for"],
    "stitch_core.versions.nats_conn": ["connect", "NatsConfigError", "NatsConnectionError",
                                       "NatsPermissionError"],
    "stitch_core.versions.streams": ["ensure_streams", "ensure_gateways_stream"],
    "stitch_core.serve.protocol": ["VERSION_HEADER", "MIN_VERSION_HEADER", "WAIT_HEADER",
                                   "engine_state", "lag", "parse_request"],
    "stitch_core.node": ["EngineFollower", "FollowerMiddleware", "Settings", "current"],
    "stitch_core.cli": ["main", "build_parser"],
    "stitch_trainer": ["Publisher"],
    "stitch_trainer.hf": ["StitchCallback"],
    "stitch_trainer.fsdp": ["FSDPPublisher"],
    "stitch_trainer.cli": ["add_publish"],
    "stitch_trainer.base": ["PublisherBase", "SIDE_FILES", "Row"],
    "stitch_trainer.analyze": ["add_parser"],
    "stitch_trainer.analyze.cli": ["add_parser", "cmd_analyze"],
    "stitch_trainer.analyze.groups": ["GROUPS", "FIELDS", "group_of", "summary"],
    "stitch_trainer.analyze.estimate": ["RULE", "ulp", "predict"],
    "stitch_trainer.analyze.experiment": ["CORPUS", "analyze_training", "make_optimizer"],
    "stitch_trainer.analyze.board": ["analyze_board"],
    "stitch_trainer.analyze.report": ["print_table"],
    "stitch_trainer.analyze.plots": ["plot"],
    "stitch_trainer.megatron.tables": ["Rule", "rule", "register_arch", "ARCHS", "MODEL_TYPES",
                                       "LLAMA", "QWEN2", "QWEN3", "KINDS", "LAYER"],
    "stitch_trainer.megatron.placement": ["Placement"],
    "stitch_trainer.megatron.layout": ["MegatronLayout", "IGNORED_SUFFIXES"],
    "stitch_trainer.megatron.shards": ["ShardPart", "shard_parts", "add_part", "merge_scattered"],
    "stitch_trainer.megatron.convert": ["assemble_hf", "split_hf", "local_from_hf", "hf_names_of"],
    "stitch_trainer.megatron_publisher": ["MegatronPublisher"],
}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_api(path):
    mod = importlib.import_module(path)
    missing = [n for n in PUBLIC[path] if not hasattr(mod, n)]
    assert missing == []


def test_no_shims_and_one_owner_for_the_version():
    """No import hooks and no aliases of old module paths; the version is the distribution's."""
    import importlib.metadata
    import sys

    import stitch_core
    from stitch_core import engine

    assert not [f for f in sys.meta_path if type(f).__module__.startswith("stitch")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("stitch_core.patch")  # a flat path of the pre-layered tree
    assert not hasattr(engine, "__getattr__")
    assert stitch_core.__version__ == importlib.metadata.version("stitch-rl")


def _shipped_modules() -> list:
    """Every module of the four packages, less the engine plugins' modules that need the engine
    itself (vllm / sglang) where it is not installed, and ``__main__`` entry points."""
    import pkgutil

    mods = []
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        for name in [pkg, *(m.name for m in pkgutil.walk_packages(root.__path__, f"{pkg}."))]:
            if name.endswith(".__main__"):
                continue
            try:
                mods.append(importlib.import_module(name))
            except ImportError:
                if not name.startswith(("stitch_vllm.", "stitch_sglang.")):
                    raise
    return mods


def test_every_error_is_a_stitch_error_and_keeps_its_builtin_base():
    """Every exception class defined in the shipped packages is a StitchError, is named
    ``...Error`` (or ``...Warning``) and keeps a builtin base of its own (stitch_core/errors.py)."""
    import builtins
    import inspect

    from stitch_core import StitchError
    from stitch_core.engine.proof import EngineStateError
    from stitch_core.format.codec import CodecError
    from stitch_core.format.stp import PatchError
    from stitch_core.versions.board import BoardError, NotFoundError
    from stitch_core.versions.store import VersionError

    for cls, builtin in [(PatchError, ValueError), (CodecError, ValueError),
                         (BoardError, RuntimeError), (NotFoundError, RuntimeError),
                         (VersionError, RuntimeError), (EngineStateError, RuntimeError)]:
        assert issubclass(cls, StitchError) and issubclass(cls, builtin), cls

    found, bad = set(), []
    for mod in _shipped_modules():
        for cls in vars(mod).values():
            if not (inspect.isclass(cls) and issubclass(cls, BaseException)
                    and cls.__module__ == mod.__name__) or cls is StitchError:
                continue
            found.add(cls)
            where = f"{cls.__module__}.{cls.__qualname__}"
            if not issubclass(cls, StitchError):
                bad.append(f"{where}: not a StitchError")
            if not cls.__name__.endswith(("Error", "Warning")):
                bad.append(f"{where}: not named ...Error")
            own = [b for b in cls.__mro__ if getattr(builtins, b.__name__, None) is b
                   and b not in StitchError.__mro__]
            if not own:
                bad.append(f"{where}: no builtin base besides StitchError")
    assert not bad, bad
    assert len(found) >= 30, sorted(c.__name__ for c in found)  # the walk did find them


def test_cli_verbs_from_the_trainer_come_through_entry_points():
    from stitch_core.cli import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert {"diff", "apply", "inspect", "up", "pull", "versions", "status", "board",
            "publish", "analyze"} <= set(verbs)


def test_no_private_name_is_imported_from_another_module():
    """A `_name` is its module's own business: no shipped module imports one from another."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    found = []
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stitch"):
                    found += [f"{f.relative_to(root)}: {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")]
    assert found == []


def test_modules_stay_small_or_say_why():
    """One job per module, about 400 lines as the norm: none over 600, and one over 400 says why
    in a ``Size:`` paragraph of its module docstring (the dev-only harness, stitch_dev, too)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    too_long, unexplained = [], []
    for pkg in (*PACKAGES, "stitch_dev"):
        for f in sorted((root / pkg).rglob("*.py")):
            text = f.read_text()
            lines = len(text.splitlines())
            where = f"{f.relative_to(root)}: {lines} lines"
            if lines > 600:
                too_long.append(where)
            elif lines > 400 and "Size:" not in (ast.get_docstring(ast.parse(text)) or ""):
                unexplained.append(where)
    assert too_long == []
    assert unexplained == []
