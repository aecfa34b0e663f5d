"""Signed versions on a real engine server (TP=1, CPU) with STITCH_TRUST set: the engine starts
from a `stitch pull --trust` directory (proven against its signed manifest), follows signed
versions, refuses an unsigned version, one signed by an untrusted key, an edited manifest and a
consistent forgery while serving the last good version, then follows the real one."""

from __future__ import annotations

import pytest

from stitch_core.versions.trust import SigningKey, TrustSet, new_key

from ..trust_common import refuses_forgeries_then_follows_signed
from .conftest import published_v0


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory, nats_server):
    run = f"{engine.prefix}-trust"
    root = tmp_path_factory.mktemp(f"{engine.name}-trust")
    keys = {n: root / n for n in ("trainer", "attacker")}
    for k in keys.values():
        new_key(k)
    trust = TrustSet.parse([f"{keys['trainer']}.pub"])
    trainer = published_v0(root, {"signing_key": keys["trainer"]}, nats_server.url, run,
                           {"arch": "qwen2", "max_position_embeddings": 2048}, trust=trust)
    server = engine.start(root / "v0", root / "server.log", board=str(root / "board"),
                          nats_url=nats_server.url, run=run,
                          cache_dir=str(root / "engine-cache"), reconcile_interval="1",
                          trust=f"{keys['trainer']}.pub", verify_cooldown="0")
    try:
        server.wait_version(0)
        yield {"root": root, "trainer": trainer, "server": server, "keys": keys, "run": run}
    finally:
        server.stop()
        trainer.pub.close()


def test_engine_with_trust_set_follows_signed_versions(stack):
    server, trainer, run = stack["server"], stack["trainer"], stack["run"]
    st = server.status()
    kid = SigningKey.load(stack["keys"]["trainer"]).id
    assert st["follower"]["trusted_keys"] == [kid] and st["follower"]["refused"] is None
    log = server.tail(2000)  # Stitch's own lines are in the engine's log, in its format
    assert f"accepting only versions of {run} signed by key(s) {kid}" in log, log[-3000:]
    assert "trusts the board" not in log  # it does not: it checks signatures
    v = trainer.publish()
    r = server.complete("Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
    assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v, r.text


def test_engine_refuses_unsigned_untrusted_edited_and_forged_versions(stack):
    root = stack["root"]
    refuses_forgeries_then_follows_signed(
        stack["server"], stack["trainer"], root / "board", stack["run"],
        stack["keys"]["trainer"], stack["keys"]["attacker"], root / "attacks")
