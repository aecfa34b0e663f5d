"""The served version has one owner (`versions.served.ServedVersion`) that the follower, the
coordinator and the gate ask; none keeps a copy."""

from __future__ import annotations

import pytest

from stitch_core.engine.coordinator import Coordinator
from stitch_core.serve.gate import NotReadyError, VersionGate
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.served import REFUSED_KEPT, ServedVersion

from .test_apply_faults import _start, published  # noqa: F401 - the fixture
from .test_engine_apply import RUN


def test_set_clear_latest_and_the_generation():
    s = ServedVersion()
    seen: list[tuple] = []
    s.listen(lambda: seen.append((s.version, s.latest, s.gen)))
    assert (s.version, s.latest, s.gen) == (None, None, 0)
    s.set(3)
    assert (s.version, s.latest, s.gen) == (3, 3, 1)
    assert s.saw_latest(5) and not s.saw_latest(4)  # latest only moves forward
    s.set(3)  # the same version again: no move
    s.clear()  # nothing proven: not a move either (the next set is)
    assert (s.version, s.latest, s.gen) == (None, 5, 1)
    s.set(3)
    assert s.gen == 2
    assert seen == [(3, 3, 1), (3, 5, 1), (3, 5, 1), (None, 5, 1), (3, 5, 2)]
    assert ServedVersion(7).latest == 7


def test_refusals_are_kept_newest_first_and_told_once():
    s = ServedVersion()
    told: list[int] = []
    s.listen(lambda: told.append(len(s.refused)))
    assert s.refuse(4, "unsigned") and not s.refuse(4, "unsigned")
    assert s.last_refusal() == {"version": 4, "reason": "unsigned"} and told == [1]
    for v in range(10, 10 + REFUSED_KEPT):
        s.refuse(v, "x")
    assert len(s.refused) == REFUSED_KEPT and 4 not in s.refused  # the oldest dropped
    assert s.accept(10) and not s.accept(10) and 10 not in s.refused
    with pytest.raises(TypeError):
        s.refused[99] = "no"  # read-only: the owner records, others ask  # type: ignore[index]


async def test_a_bare_served_version_is_the_apply_transaction():
    s = ServedVersion(1)
    async with s.applying(2) as h:
        assert s.version == 1 and s.latest == 2  # published, not served yet
    assert s.version == 1  # not committed: nothing moved
    async with s.applying(2) as h:
        h.commit(10)
    assert s.version == 2 and s.gen == 1
    assert Coordinator(lambda req: None, run=RUN).gate.served is not None  # no stand-in gate


async def test_the_gate_reads_what_others_record():
    served = ServedVersion()
    gate = VersionGate(RUN, served=served)
    with pytest.raises(NotReadyError) as e:
        await gate.admit()
    assert e.value.reason == "not_ready"
    served.set(3)
    assert gate.version == 3 and gate.status()["version"] == 3
    assert (await gate.admit(3, None, 0)).start == 3
    served.refuse(4, "v4 is unsigned")
    with pytest.raises(NotReadyError) as e:  # it would wait 5 s for v4: refused at once
        await gate.admit(None, 4, 5)
    assert e.value.reason == "refused" and "v4 is unsigned" in e.value.body["error"]["message"]
    served.accept(4)
    with pytest.raises(NotReadyError) as e:
        await gate.admit(None, 4, 0)
    assert e.value.reason == "behind"


async def test_an_apply_moves_the_one_served_version_for_gate_and_follower(published,  # noqa: F811
                                                                          tmp_path):
    """The coordinator records what the ranks hold in the gate's ServedVersion; a follower
    built with it reads the same (and does not record steps of its own)."""
    root, views = published
    _, _, coord, gate = await _start(root, views, {})
    f = Follower(LocalBoard(root / "board"), RUN, coord, served=gate.served,
                 cache_dir=tmp_path / "cache")
    assert coord.served is gate.served is f.served
    assert coord.version == gate.version == f.version == 0
    await f.catch_up(2)
    assert coord.version == gate.version == f.version == 2 and gate.applies == 2
    coord.stop_serving("a test")
    assert gate.version is None and f.version is None and gate.state == "not_ready"
    with pytest.raises(ValueError):  # one owner: a shared ServedVersion, or a start version
        Follower(LocalBoard(root / "board"), RUN, MemoryReplica(), served=gate.served, version=1)
