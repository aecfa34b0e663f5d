"""The plugin's decisions without a server: when it follows, how SGLang's warm-up is held until a
version is proven (the warm-up kills the server on a 409), and what it registers."""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest

import stitch_core.node as engine
from stitch_core.node import Settings
from stitch_core.serve.gate import VersionGate
from stitch_sglang import plugin, server


def _need_sglang() -> None:
    if os.environ.get("STITCH_REQUIRE_SGLANG") == "1":
        importlib.import_module("sglang")  # fails, not skips, where SGLang is required
    else:
        pytest.importorskip("sglang")


def test_follows_only_with_stitch_settings_or_a_pulled_snapshot(tmp_path):
    assert not server.follows(str(tmp_path), env={})
    assert not server.follows(None, env={})
    assert server.follows(str(tmp_path), env={"STITCH_RUN": "r"})
    assert server.follows("org/some-hub-model", env={"STITCH_BOARD": "/boards/b"})
    (tmp_path / "stitch-manifest.json").write_text("{}")
    assert server.follows(str(tmp_path), env={})
    assert plugin.enabled({}) and plugin.enabled({"STITCH_SGLANG": "1"})
    assert not plugin.enabled({"STITCH_SGLANG": "0"})
    assert not plugin.enabled({"STITCH_SGLANG": "off"})


class FakeTokenizerManager:
    server_args = SimpleNamespace(model_path="/models/m")

    def __init__(self):
        self.versions: list[str] = []

    async def update_weight_version(self, obj) -> None:
        assert obj.abort_all_requests is False
        self.versions.append(obj.new_version)


@pytest.fixture
def hooks_state(monkeypatch):
    monkeypatch.setattr(server, "_ACTIVE", True)
    monkeypatch.setattr(server, "_WAKE", threading.Event())
    monkeypatch.setattr(engine, "_CURRENT", None)


def _warmup_thread() -> tuple[threading.Thread, threading.Event]:
    ran = threading.Event()
    t = threading.Thread(target=server.around_warmup, args=(ran.set,), daemon=True)
    t.start()
    return t, ran


async def test_warmup_runs_once_a_version_is_proven(hooks_state, monkeypatch):
    _need_sglang()
    tm = FakeTokenizerManager()
    ef = server.SglangFollower(tm, Settings(run="r"))
    assert ef.model_dir == "/models/m"
    ef.gate = VersionGate("r")
    monkeypatch.setattr(engine, "_CURRENT", ef)
    serving = asyncio.create_task(ef._when_serving())
    t, ran = _warmup_thread()
    await asyncio.sleep(0.3)  # an absence check: nothing may run before the proof
    assert not ran.is_set() and t.is_alive() and tm.versions == []
    ef.gate.set_version(7)  # what the coordinator does once the loaded weights are proven
    await asyncio.wait_for(serving, 10)
    await asyncio.to_thread(t.join, 10)
    assert ran.is_set() and not t.is_alive()
    assert tm.versions == ["7"] and ef.ready  # SGLang's weight_version follows


async def test_warmup_is_withheld_when_the_server_stops_first(hooks_state, monkeypatch):
    ef = server.SglangFollower(FakeTokenizerManager(), Settings(run="r"))
    ef.gate = VersionGate("r")
    monkeypatch.setattr(engine, "_CURRENT", ef)
    t, ran = _warmup_thread()
    await ef.stop()  # the lifespan joins the warm-up thread: it must end, without warming up
    monkeypatch.setattr(engine, "_CURRENT", None)
    await asyncio.to_thread(t.join, 10)
    assert not t.is_alive() and not ran.is_set()


def test_warmup_untouched_when_not_following(monkeypatch):
    monkeypatch.setattr(server, "_ACTIVE", False)
    assert server.around_warmup(lambda x: x + 1, 41) == 42


def test_register_hooks(monkeypatch):
    _need_sglang()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    plugin.register()
    kinds = {t: [k for k, _, _ in hs] for t, hs in HookRegistry._hooks.items()}
    assert kinds == {plugin.SCHEDULER_HOOK: [HookType.AFTER], plugin.HTTP_HOOK: [HookType.BEFORE],
                     plugin.WARMUP_HOOK: [HookType.AROUND]}
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setenv("STITCH_SGLANG", "0")
    plugin.register()
    assert dict(HookRegistry._hooks) == {}


def test_native_batch_salts_each_prompt():
    """SGLang's /generate takes one cache_salt per prompt of a batch: each is salted."""
    import json

    from stitch_core.serve.asgi import salt_body

    out = json.loads(salt_body(b'{"text": ["a", "b"], "cache_salt": ["u", ""]}', "r", 2))
    assert out["cache_salt"] == ["u|stitch:r:v2", "stitch:r:v2"]
    assert json.loads(salt_body(b'{"text": ["a", "b"]}', "r", 2))["cache_salt"] == "stitch:r:v2"
    assert salt_body(b'{"cache_salt": ["u", 5]}', "r", 2) is None  # SGLang rejects it


async def test_a_reply_given_up_on_is_never_taken_for_the_next_call():
    """The coordinator gives up on a call (STITCH_RPC_TIMEOUT) while a rank hangs; its reply
    arrives during the next call (the Undo): it is dropped, and each call gets its own reply."""
    sent: list = []
    calls = server.Calls(sent.append, fan_out=1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(calls(SimpleNamespace(call_id="write")), 0.05)
    undo = asyncio.create_task(calls(SimpleNamespace(call_id="undo")))
    await asyncio.sleep(0)
    calls.handle_recv(SimpleNamespace(call_id="write", replies=["late"]))  # the hung rank ends
    await asyncio.sleep(0)
    assert not undo.done() and calls.dropped == 1
    calls.handle_recv(SimpleNamespace(call_id="undo", replies=["done"]))
    assert [o.replies for o in await undo] == [["done"]]
    assert [r.call_id for r in sent] == ["write", "undo"] and calls._waiting == {}
