"""Failpoints in a rank's write path: a test and chaos facility, off unless asked for.

A `RankReplica` consults its `Failpoints` at two points of `write` (`rpc.Write`):

* ``"write"``: mid-write, once the rank has written `after` + 1 tensors of the request (all of
  them if it has fewer): the rank holds part of the new version;
* ``"written"``: after the write completed and was read back (the rank holds all of its part
  of the new version and its undo record), before the reply goes out.

and does what it was armed with:

* ``"raise"``: raise `FailpointError`, as any failing write does. Mid-write the rank's own
  restore runs first (a Python exception inside `write` always restores what it wrote), so the
  coordinator must undo the *other* ranks; at ``"written"`` nothing restores it, so the
  coordinator's `Undo` must;
* ``"hang"``: sleep `seconds` (beyond the coordinator's STITCH_RPC_TIMEOUT), then carry on: a
  stuck or very slow rank whose late write lands after the coordinator gave up;
* ``"exit"``: `os._exit` at once: the rank process is gone mid-write (no restore, no reply).

Arming (`rpc.Arm`, sent to every rank; the one named by `rank`, or all for None, takes it) is
refused unless the rank's process has ``STITCH_FAILPOINTS=1`` in its environment
(`stitch_core.failpoints`, the one failpoint facility, also holds the publisher's kill points),
so a production engine can never be made to fail by a request. Each armed point fires `times` times,
then disarms itself; ``action="off"`` disarms every point of the rank.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from stitch_core.engine import rpc
from stitch_core.errors import StitchError
from stitch_core.failpoints import ENV, enabled

log = logging.getLogger("stitch.engine")

POINTS = ("write", "written")
ACTIONS = ("raise", "hang", "exit", "off")
EXIT_CODE = 70


class FailpointError(StitchError, RuntimeError):
    """Raised by an armed failpoint (and for an arming that is refused or malformed)."""


@dataclass
class _Armed:
    point: str
    action: str
    seconds: float
    after: int
    times: int


def rank_of(info: dict[str, Any]) -> int | None:
    """The TP rank in a replica's rank info (engines publish `tp_rank`, else `rank`)."""
    r = info.get("tp_rank", info.get("rank"))
    return int(r) if r is not None else None


class Failpoints:
    """The failpoints armed on one rank (see the module doc)."""

    def __init__(self) -> None:
        self.armed: list[_Armed] = []

    def arm(self, req: rpc.Arm, rank_info: dict[str, Any]) -> rpc.ArmReply:
        if not enabled():
            raise FailpointError(f"failpoints are off on this rank (set {ENV}=1 in the engine's "
                                 "environment: a test and chaos facility, never for production)")
        if req.point not in POINTS or req.action not in ACTIONS:
            raise FailpointError(f"failpoint {req.point}:{req.action}: points are {POINTS}, "
                                 f"actions {ACTIONS}")
        if req.rank is None or req.rank == rank_of(rank_info):
            if req.action == "off":
                self.armed.clear()
            elif req.times > 0:
                self.armed.append(_Armed(req.point, req.action, float(req.seconds),
                                         max(0, int(req.after)), int(req.times)))
                log.warning("stitch: failpoint armed on rank %s: %s %s x%d", rank_info,
                            req.point, req.action, req.times)
        return rpc.ArmReply(dict(rank_info), [asdict(a) for a in self.armed])

    def hit(self, point: str, written: int = 0, total: int = 0) -> None:
        """Called by the rank at `point`; mid-write (`point` "write") with the tensors written so
        far and the request's count. Fires the first armed point due there."""
        for a in self.armed:
            if a.point != point:
                continue
            if point == "write" and written < min(a.after + 1, max(total, 1)):
                continue
            a.times -= 1
            if a.times <= 0:
                self.armed.remove(a)
            self._fire(a)
            return

    @staticmethod
    def _fire(a: _Armed) -> None:
        log.warning("stitch: failpoint %s: %s", a.point, a.action)
        if a.action == "exit":
            os._exit(EXIT_CODE)
        if a.action == "hang":
            time.sleep(a.seconds)
            return
        raise FailpointError(f"failpoint {a.point}: injected failure")
