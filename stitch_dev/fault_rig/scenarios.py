"""The fault suite's rows by key: ``scenarios(views)`` maps each row's key to
``f(work, Truth(views), args)`` -> ``Row``, with the bad bytes that need the trainer's views (a
foreign run's patch, a patch published ahead, a decompression bomb)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from stitch_core.versions.manifest import MAX_MANIFEST_BYTES
from stitch_trainer.publisher import Publisher

from .rig import Rig, Row
from .rows import bad_patch, board_outage, nats_restart, persistent_bad, rank_fault, trainer_killed
from .tamper import bomb_patch, corrupt, patch_key, truncate
from .truth import RUN


def scenarios(views: list[dict[str, torch.Tensor]]) -> dict[str, Callable[..., Awaitable[Row]]]:
    foreign: dict[int, bytes] = {}
    shadow: dict[int, bytes] = {}

    def from_shadow(run: str, store: dict[int, bytes], offset: int):
        """Patches of the same views published by a run named `run` (the foreign run, or this
        run published ahead: the trainer is deterministic)."""
        def make(rig: Rig, n: int) -> Callable[[bytes], bytes]:
            k = n + offset
            if k not in store:
                d = rig.dir / f"shadow-{run}"
                with Publisher(str(d), run, "bf16") as p:
                    for i in range(k + 1):
                        p.publish(i, views[i]).result()
                store.update({v: (d / patch_key(run, v)).read_bytes() for v in range(1, k + 1)})
            return lambda good: store[k]
        return make

    def bomb(rig: Rig, n: int) -> Callable[[bytes], bytes]:
        data = bomb_patch(views[n - 1], n)
        return lambda good: data

    return {
        "corrupt": lambda w, t, a: bad_patch(
            "corrupt patch", lambda r, n: corrupt, w, t, a,
            what="one bit flipped in a chunk payload, manifest hash of the bad bytes"),
        "repaired": lambda w, t, a: bad_patch(
            "corrupt patch, repaired on the board (no later snapshot)", lambda r, n: corrupt,
            w, t, a, repair=True,
            what="as above; no snapshot follows, the board is repaired"),
        "truncated": lambda w, t, a: bad_patch(
            "truncated patch", lambda r, n: truncate, w, t, a,
            what="patch cut at half its length, manifest hash of the cut bytes"),
        "foreign": lambda w, t, a: bad_patch(
            "foreign patch (another run)", from_shadow("other-run", foreign, 0), w, t, a,
            what="the same step's patch of run other-run"),
        "out-of-order": lambda w, t, a: bad_patch(
            "out-of-order patch", from_shadow(RUN, shadow, 1), w, t, a,
            what="vN's slot holds v(N+1)'s patch (base vN)"),
        "oversized": lambda w, t, a: bad_patch(
            "oversized manifest", None, w, t, a, pad=MAX_MANIFEST_BYTES + 1,
            what=f"manifest padded to {MAX_MANIFEST_BYTES + 1:,} bytes (limit "
                 f"MAX_MANIFEST_BYTES)"),
        "bomb": lambda w, t, a: bad_patch(
            "decompression bomb", bomb, w, t, a,
            what="a 32 MiB constant tensor coded in < 4 KB by an uncapped encoder"),
        "rank-raise": lambda w, t, a: rank_fault("TP=2 rank raises mid-write", "raise", w, t, a),
        "rank-hang": lambda w, t, a: rank_fault("TP=2 rank hangs mid-write", "hang", w, t, a),
        "rank-lost": lambda w, t, a: rank_fault(
            "TP=2 rank lost mid-write (undo unprovable)", "lost", w, t, a),
        "nats-restart": lambda w, t, a: nats_restart("NATS restart", w, t, a, down=1.0),
        "nats-down-start": lambda w, t, a: nats_restart(
            "NATS down at follower start", w, t, a, down=6.0, at_start=True),
        "nats-down-mid": lambda w, t, a: nats_restart("NATS down mid-run", w, t, a, down=6.0),
        "board-5xx": lambda w, t, a: board_outage("board HTTP 503", "5xx", w, t, a),
        "board-refused": lambda w, t, a: board_outage(
            "board connection refused", "refused", w, t, a),
        "board-slow": lambda w, t, a: board_outage("board slow", "slow", w, t, a),
        "persistent-bad": lambda w, t, a: persistent_bad(
            "persistently bad object + later snapshot", w, t, a),
        "trainer-killed": lambda w, t, a: trainer_killed(
            "trainer SIGKILLed mid-publish + restart", w, t, a),
    }
