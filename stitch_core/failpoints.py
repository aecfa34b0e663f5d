"""Failpoints: one test and chaos facility, off unless STITCH_FAILPOINTS asks for it.

STITCH_FAILPOINTS (read through `stitch_core.settings`) is a comma-separated list:

* ``1``: failpoints may be *armed* in this process: an engine's ranks accept `rpc.Arm`
  (`stitch_core.engine.failpoints`: raise, hang or exit mid-write) and the engine's server adds
  ``POST /stitch/debug/arm``;
* a point name: this process SIGKILLs itself when it reaches that point (`kill_point`). The points
  of `versions.store.write_version`: ``publish:after-object`` (the first object stored, the others
  not), ``publish:after-objects``, ``publish:after-manifest`` and ``publish:after-latest``
  (tests/test_publish_crash.py kills a real publisher at each); of
  `versions.span_index.write_span_index`: ``squash:after-index-delete``
  (tests/test_squash_crash.py).

Unset, as in production, a point costs one environment lookup and nothing else, and no request
can make a process fail. One variable for both kinds, so a drill never sets one facility while
the code reads the other. Below every layer that has a failpoint (versions, engine, node).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

from stitch_core.settings import Settings, env_name

log = logging.getLogger("stitch.failpoints")

ENV = env_name("failpoints")
ARMABLE = "1"


def active(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The entries of STITCH_FAILPOINTS in `env` (default os.environ)."""
    value = Settings.read("failpoints", env) or ""
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether failpoints may be armed in this process (STITCH_FAILPOINTS holds `1`)."""
    return ARMABLE in active(env)


def kill_point(name: str) -> None:
    """SIGKILL this process if STITCH_FAILPOINTS names the point `name` (see the module doc)."""
    if name in active():
        log.warning("failpoint %s: killing this process (pid %d)", name, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
