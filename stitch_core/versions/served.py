"""ServedVersion: the one owner of what a replica serves, that everything else asks.

Three facts live here and nowhere else: the version the replica holds, proven (`version`; None:
nothing proven, requests are refused), the newest published version seen (`latest`, never below
`version`), and the versions refused (`refused`: version -> why, e.g. an untrusted signature; the
newest REFUSED_KEPT). An engine node builds one and hands the same instance to its three parts:

* the follower (`versions.follower.Follower`) records what it reads on the board: `saw_latest`,
  `refuse`, `accept`;
* the coordinator (`engine.coordinator.Coordinator`) records what the ranks are proven to hold:
  `set`, `clear` (through the gate's apply transaction, `applying`);
* the gate (`serve.gate.VersionGate`) reads all three to admit requests; it registers a listener
  at its construction (`listen`) that wakes waiting requests and updates the metrics.

A follower without an engine (`stitch follow`, a `MemoryReplica`) builds its own and sets it after
each step. With no gate, a ServedVersion is itself the apply transaction (`applying`: the version
becomes the target iff the apply commits), so a coordinator never needs a stand-in.

Pure and synchronous: listeners are called in the caller's thread (the gate hops to its loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType

REFUSED_KEPT = 16  # refused versions remembered (the newest)

Listener = Callable[[], None]


class Commit:
    """The handle of one apply to `target`: call `commit()` once the target is in place
    (`patch_bytes`, if given, feeds the metrics)."""

    def __init__(self, target: int):
        self.target = target
        self.committed = False
        self.patch_bytes = 0

    def commit(self, patch_bytes: int | None = None) -> None:
        self.committed = True
        if patch_bytes:
            self.patch_bytes = int(patch_bytes)


class ServedVersion:
    """The served version, the newest published one and the refused ones (see the module doc)."""

    def __init__(self, version: int | None = None):
        self._version = None if version is None else int(version)
        self._latest = self._version
        self._refused: dict[int, str] = {}
        self._gen = 0  # bumped by every `set` to another version
        self._listeners: list[Listener] = []

    @property
    def version(self) -> int | None:
        """The version held, proven (None: nothing is)."""
        return self._version

    @property
    def latest(self) -> int | None:
        """The newest published version seen (at least `version`)."""
        return self._latest

    @property
    def gen(self) -> int:
        """How many times `version` moved to another version (a clear is not a move: nothing
        is served meanwhile; the next `set` is)."""
        return self._gen

    @property
    def refused(self) -> Mapping[int, str]:
        """Refused versions -> why (read-only; the newest REFUSED_KEPT)."""
        return MappingProxyType(self._refused)

    @property
    def served(self) -> ServedVersion:
        """Itself: a ServedVersion is the apply gate of an engine with no requests to gate
        (`engine.ports.ApplyGate`)."""
        return self

    def listen(self, listener: Listener) -> None:
        """Call `listener()` after every change."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def set(self, version: int) -> None:
        """`version` is held, proven (an initial load, an apply, a reload)."""
        v = int(version)
        if v != self._version:
            self._version = v
            self._gen += 1
        if self._latest is None or self._latest < v:
            self._latest = v
        self._changed()

    def clear(self) -> None:
        """Nothing is held that can be proven (a failed check or undo): requests are refused
        until the next `set`."""
        self._version = None
        self._changed()

    def saw_latest(self, version: int) -> bool:
        """`version` is published: raise `latest` to it. True if it moved."""
        v = int(version)
        if self._latest is not None and v <= self._latest:
            return False
        self._latest = v
        self._changed()
        return True

    def refuse(self, version: int, reason: str) -> bool:
        """`version` is refused (e.g. not signed by a trusted key): requests wanting it are told
        `reason` at once. False if it was already refused for that reason."""
        v = int(version)
        if self._refused.get(v) == reason:
            return False
        self._refused[v] = reason
        while len(self._refused) > REFUSED_KEPT:
            del self._refused[min(self._refused)]
        self._changed()
        return True

    def accept(self, version: int) -> bool:
        """`version` is accepted after all (replaced on the board by a good one). True if it
        had been refused."""
        if self._refused.pop(int(version), None) is None:
            return False
        self._changed()
        return True

    def last_refusal(self) -> dict | None:
        """The newest refusal, as ``{"version", "reason"}`` (None: none)."""
        if not self._refused:
            return None
        v = max(self._refused)
        return {"version": v, "reason": self._refused[v]}

    @contextlib.asynccontextmanager
    async def applying(self, target: int) -> AsyncIterator[Commit]:
        """The apply transaction with no requests to account for: the version becomes `target`
        iff `commit()` was called (`serve.gate.VersionGate.applying` adds the requests' side)."""
        h = Commit(int(target))
        self.saw_latest(h.target)  # it is published, since it is being applied
        try:
            yield h
        finally:
            if h.committed:
                self.set(h.target)
