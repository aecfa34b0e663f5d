"""The engine scenarios: one set of tests for vLLM and SGLang, run in the engine's own venv.

`engine` is the engine of this venv (stitch_dev.engines adapter): STITCH_ENGINE=vllm|sglang
(scripts/dev.py sets it), else the one engine this venv can import. Under STITCH_REQUIRE_VLLM=1 /
STITCH_REQUIRE_SGLANG=1 a missing engine is a failure, never a skip. Modules named
``*_vllm.py`` / ``*_sglang.py`` hold what only that engine has; the other engine's are not
collected.

Engine servers are session fixtures, each started once and reused by every module that needs
that configuration, and stopped after the last test that uses it (an idle engine would take the
cores of the next one's start-up):

* `follower`: TP=1, API key, the end-to-end follower (test_server*.py, test_version_spans_*.py;
  its modules run first, so that it is stopped before the other scenarios start); tests marked
  `follower_late(n)` run after its other users, in order of n (they take the trainer off the
  follower's line);
* `tp2`: TP=2 with failpoints (test_tp2_faults.py, then the shared case of test_tp_follow.py).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
from collections.abc import Callable

import pytest

from stitch_dev.engines import ADAPTERS, Engine, adapter


def _engine_name() -> str | None:
    name = os.environ.get("STITCH_ENGINE")
    if name:
        adapter(name)  # a typo fails here
        return name
    found = [e.name for e in ADAPTERS.values() if importlib.util.find_spec(e.module)]
    return found[0] if len(found) == 1 else None


ENGINE = _engine_name()


def pytest_ignore_collect(collection_path, config):
    """The other engine's own modules (and both, without an engine) are not collected."""
    stem = collection_path.stem
    return any(stem.endswith(f"_{n}") for n in ADAPTERS if n != ENGINE) or None


def pytest_report_header(config):
    return f"engine scenarios: {ENGINE or 'no engine in this venv'}"


@pytest.fixture(scope="session")
def engine() -> Engine:
    if ENGINE is None:
        if any(os.environ.get(f"STITCH_REQUIRE_{n.upper()}") == "1" for n in ADAPTERS):
            raise RuntimeError("STITCH_REQUIRE_* set but no engine: set STITCH_ENGINE")
        pytest.skip("no engine in this venv (STITCH_ENGINE=vllm|sglang in its venv)")
    eng = adapter(ENGINE)
    if os.environ.get(f"STITCH_REQUIRE_{eng.name.upper()}") == "1":
        importlib.import_module(eng.module)  # broken or missing: an error, not a skip
    else:
        pytest.importorskip(eng.module, reason=f"run in the {eng.label} venv")
    return eng


# ------------------------------------------------------------------ session engines, stopped early

_LAST_USER: dict[str, str] = {}  # fixture name -> nodeid of the last test that uses it
_STOPS: dict[str, Callable[[], None]] = {}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "follower_late(n): run after the follower's other tests, in order of n (it "
        "leaves the trainer off the follower's line: a forged version, another publisher)")


def _late(item) -> int:
    m = item.get_closest_marker("follower_late")
    return m.args[0] if m else 0


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(session, config, items):
    # the follower's modules first (stable): it is stopped after its last user, before the
    # scenarios that start engines of their own (an idle SGLang scheduler polls a whole core, which
    # their start-ups and trainers would wait behind; an idle vLLM holds its memory)
    mods = {_module(it) for it in items if "follower" in getattr(it, "fixturenames", ())}
    items[:] = ([it for it in items if _module(it) in mods]
                + [it for it in items if _module(it) not in mods])
    users = [i for i, it in enumerate(items) if "follower" in getattr(it, "fixturenames", ())]
    if users:  # the follower_late tests after its other users (of every module), in their order
        head = items[:users[-1] + 1]
        items[:users[-1] + 1] = ([it for it in head if not _late(it)]
                                 + sorted((it for it in head if _late(it)), key=_late))
    for item in items:
        for name in ("follower", "tp2"):
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


def pytest_runtest_teardown(item, nextitem):
    for name, last in _LAST_USER.items():
        if item.nodeid == last and name in _STOPS:
            _STOPS.pop(name)()


def _session_engine(name: str, stop: Callable[[], None]) -> None:
    """Register `stop` to run after the last test using fixture `name` (or at session end)."""
    done = {"yes": False}

    def once() -> None:
        if not done["yes"]:
            done["yes"] = True
            stop()

    _STOPS[name] = once
    return once


def published_v0(root, trainer_kw: dict, nats_url: str, run: str, model_kw: dict, trust=None):
    """A tiny model trained by a fresh AdamWTrainer, v0 published and pulled into root/v0."""
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_dev.tinymodel import build_tiny_model
    from stitch_dev.trainer import AdamWTrainer

    model_dir = build_tiny_model(root / "model", **model_kw)
    trainer = AdamWTrainer(model_dir, root / "board", nats_url, run, **trainer_kw)
    assert trainer.publish() == 0
    asyncio.run(pull(LocalBoard(root / "board"), run, 0, root / "v0", root / "cache",
                     quiet=True, **({"trust": trust} if trust is not None else {})))
    return trainer


@pytest.fixture(scope="session")
def follower(engine, tmp_path_factory, nats_server):
    """The end-to-end follower: TP=1, an API key (Stitch admits past the engine's key check),
    the engine's extra routes and metrics; verifies not rate-limited (test_routes checks the
    limit). {"root", "trainer", "server", "run"}."""
    run = f"{engine.prefix}-e2e"
    root = tmp_path_factory.mktemp(f"{engine.name}-e2e")
    trainer = published_v0(root, {}, nats_server.url, run,
                           {"arch": "qwen2", "max_position_embeddings": 2048})
    server = engine.start(root / "v0", root / "server.log", extra=list(engine.follower_extra),
                          api_key=f"{run}-key", board=str(root / "board"),
                          nats_url=nats_server.url, run=run,
                          cache_dir=str(root / "engine-cache"), reconcile_interval="1",
                          verify_cooldown="0", **engine.follower_kw)

    def stop():
        server.stop()
        trainer.pub.close()

    once = _session_engine("follower", stop)
    try:
        engine.ready(server)
        yield {"root": root, "trainer": trainer, "server": server, "run": run}
    finally:
        once()


@pytest.fixture(scope="session")
def tp2(engine, tmp_path_factory, nats_server):
    """The TP=2 follower with failpoints (stitch_dev.engine_faults.FAULT_ENV), one for the
    session: the fault scenarios, then a follow-and-compare case. `start(n)` starts a
    replacement (the SIGKILL scenario); "server" is the one running."""
    from stitch_dev.engine_faults import FAULT_ENV

    run = f"{engine.prefix}-tp2"
    root = tmp_path_factory.mktemp(f"{engine.name}-tp2")
    trainer = published_v0(root, {}, nats_server.url, run, {"arch": engine.tp2_arch})

    def start(n: int, wait: bool = True):
        s = engine.start(root / "v0", root / f"server-{n}.log", tp=2, board=str(root / "board"),
                         nats_url=nats_server.url, run=run,
                         cache_dir=str(root / "engine-cache"), **FAULT_ENV)
        if wait:
            # SGLang's own warm-up request kills the server on a non-200: let it pass before a
            # fault can make it a 409
            engine.ready(s, timeout=600)
        return s

    st = {"root": root, "trainer": trainer, "start": start, "run": run, "arch": engine.tp2_arch}

    def stop():
        if "server" in st:
            st["server"].stop()
        trainer.pub.close()

    once = _session_engine("tp2", stop)
    try:
        st["server"] = start(0)
        # the start-up check (before any fault): at TP=2 each rank holds a shard of every
        # group, all learned from row and column ids through the engine's own loaders, none
        # from the full HF-shaped index (`layout_load`)
        check = st["server"].wait_version(0, timeout=600)["fingerprint_check"]
        assert check["layout_full_index"] == [] and check["layout_bytes"] > 0, check
        yield st
    finally:
        once()
