"""Signed versions on a real SGLang server (TP=1, CPU) with STITCH_TRUST set: the engine starts
from a `stitch pull --trust` directory (proven against its signed manifest), follows signed
versions, refuses an unsigned version, one signed by an untrusted key, an edited manifest and a
consistent forgery while serving the last good version, then follows the real one."""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_core.versions.trust import SigningKey, TrustSet, new_key  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..trust_common import refuses_forgeries_then_follows_signed  # noqa: E402
from .engines import Server  # noqa: E402

RUN = "sg-trust"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, nats_server):
    root = tmp_path_factory.mktemp("sglang-trust")
    keys = {n: root / n for n in ("trainer", "attacker")}
    for k in keys.values():
        new_key(k)
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=2048)
    trainer = AdamWTrainer(model_dir, root / "board", nats_server.url, RUN,
                      signing_key=keys["trainer"])
    assert trainer.publish() == 0
    trust = TrustSet.parse([f"{keys['trainer']}.pub"])
    asyncio.run(pull(LocalBoard(root / "board"), RUN, 0, root / "v0", root / "cache",
                     quiet=True, trust=trust))
    server = Server(root / "v0", root / "server.log", board=str(root / "board"),
                    nats_url=nats_server.url, run=RUN, cache_dir=str(root / "engine-cache"),
                    reconcile_interval="1", trust=f"{keys['trainer']}.pub",
                    verify_cooldown="0")
    try:
        server.wait_version(0)
        yield {"root": root, "trainer": trainer, "server": server, "keys": keys}
    finally:
        server.stop()
        trainer.pub.close()


def test_engine_with_trust_set_follows_signed_versions(stack):
    server, trainer = stack["server"], stack["trainer"]
    st = server.status()
    kid = SigningKey.load(stack["keys"]["trainer"]).id
    assert st["follower"]["trusted_keys"] == [kid] and st["follower"]["refused"] is None
    log = server.tail(2000)
    assert f"accepting only versions of {RUN} signed by key(s) {kid}" in log, log[-3000:]
    assert "trusts the board" not in log  # it does not: it checks signatures
    v = trainer.publish()
    r = server.complete("Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
    assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v, r.text


def test_engine_refuses_unsigned_untrusted_edited_and_forged_versions(stack):
    root = stack["root"]
    refuses_forgeries_then_follows_signed(
        stack["server"], stack["trainer"], root / "board", RUN, stack["keys"]["trainer"],
        stack["keys"]["attacker"], root / "attacks")
