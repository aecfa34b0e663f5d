"""The tree is the architecture: no import cycles, the public API pinned, old paths still working.

The allowed import directions themselves are import-linter contracts in pyproject.toml
(`lint-imports` in the test command); this module adds what import-linter does not check.
"""

from __future__ import annotations

import importlib
import warnings

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
    "stitch_core.versions": ["Step", "VersionError", "fetch_patch", "list_manifests", "plan",
                             "read_manifest", "write_version"],
    "stitch_core.versions.board": ["Board", "BoardError", "LatestConflict", "LocalBoard",
                                   "NotFound", "ReadOnlyBoard", "open_board"],
    "stitch_core.versions.manifest": ["Latest", "Manifest", "ObjectRef", "PULLED_MANIFEST"],
    "stitch_core.versions.materialize": ["apply_patches", "pull"],
    "stitch_core.versions.follower": ["Follower", "MemoryReplica"],
    "stitch_core.versions.natsserver": ["NatsServer"],
    "stitch_core.engine.coordinator": ["Coordinator", "EngineStateError"],
    "stitch_core.engine.replica": ["RankReplica", "ReplicaError"],
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
    "stitch_core.versions.announce": ["fleet", "gateways", "GatewayHeartbeat"],
    "stitch_core.serve.protocol": ["VERSION_HEADER", "MIN_VERSION_HEADER", "WAIT_HEADER",
                                   "engine_state", "lag", "parse_request"],
    "stitch_core.node": ["EngineFollower", "FollowerMiddleware", "Settings", "current"],
    "stitch_core.cli": ["main", "build_parser"],
    "stitch_trainer": ["Publisher"],
    "stitch_trainer.hf": ["StitchCallback"],
    "stitch_trainer.fsdp": ["FSDPPublisher"],
    "stitch_trainer.cli": ["add_publish"],
    "stitch_trainer.base": ["PublisherBase", "SIDE_FILES", "Row"],
}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_api(path):
    mod = importlib.import_module(path)
    missing = [n for n in PUBLIC[path] if not hasattr(mod, n)]
    assert missing == []


# Paths of the flat layout of earlier releases: still importable for one release, as the very
# same module objects, with a DeprecationWarning naming the new path.
OLD_PATHS = {
    "stitch_core.patch": "stitch_core.format.patch",
    "stitch_core.dtypes": "stitch_core.format.dtypes",
    "stitch_core.fingerprint": "stitch_core.format.fingerprint",
    "stitch_core.views": "stitch_core.format.views",
    "stitch_core.stp": "stitch_core.format.stp",
    "stitch_core.board": "stitch_core.versions.board",
    "stitch_core.board.local": "stitch_core.versions.board.local",
    "stitch_core.manifest": "stitch_core.versions.manifest",
    "stitch_core.follower": "stitch_core.versions.follower",
    "stitch_core.natsserver": "stitch_core.versions.natsserver",
    "stitch_core.coordinator": "stitch_core.engine.coordinator",
    "stitch_core.replica": "stitch_core.engine.replica",
    "stitch_core.layout": "stitch_core.engine.layout",
    "stitch_core.gate": "stitch_core.serve.gate",
    "stitch_core.protocol": "stitch_core.serve.protocol",
    "stitch_core.cli_versions": "stitch_core.cli.versions",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_module_paths_alias_the_new_modules(old):
    with pytest.warns(DeprecationWarning, match="moved to"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(OLD_PATHS[old])


def test_old_names_of_the_former_modules():
    from stitch_core.cli.versions import list_manifests, pull  # the CLI module's old exports
    from stitch_core.versions import read_manifest  # stitch_core.versions was the store module
    from stitch_core.versions.materialize import pull as pull_new
    from stitch_core.versions.store import list_manifests as lm_new
    from stitch_core.versions.store import read_manifest as rm_new

    assert (pull, list_manifests, read_manifest) == (pull_new, lm_new, rm_new)
    from stitch_core import node

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning, match="stitch_core.node.EngineFollower"):
            from stitch_core.engine import EngineFollower  # noqa: F401
    with pytest.warns(DeprecationWarning):
        from stitch_core.engine import EngineFollower
    assert EngineFollower is node.EngineFollower


def test_every_error_is_a_stitch_error_and_keeps_its_builtin_base():
    from stitch_core import StitchError
    from stitch_core.engine.coordinator import EngineStateError
    from stitch_core.format.codec import CodecError
    from stitch_core.format.stp import PatchError
    from stitch_core.versions.board import BoardError, NotFound
    from stitch_core.versions.store import VersionError

    for cls, builtin in [(PatchError, ValueError), (CodecError, ValueError),
                         (BoardError, RuntimeError), (NotFound, RuntimeError),
                         (VersionError, RuntimeError), (EngineStateError, RuntimeError)]:
        assert issubclass(cls, StitchError) and issubclass(cls, builtin), cls


def test_cli_verbs_from_the_trainer_come_through_entry_points():
    from stitch_core.cli import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert {"diff", "apply", "inspect", "up", "pull", "versions", "status", "board",
            "publish", "analyze"} <= set(verbs)
