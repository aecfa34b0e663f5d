"""Manifests, `latest` pointers, announcements and heartbeats are untrusted input (a board or NATS
anyone may write): whatever bytes arrive, parsing answers a model or a clear error
(pydantic's ValidationError, a ValueError; VersionError/RefusedVersionError through
`read_manifest`), never another exception, and signature checks never crash on what parsed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import (
    MAX_VERSION,
    Announcement,
    Heartbeat,
    Latest,
    Manifest,
    manifest_key,
)
from stitch_core.versions.store import VersionError, read_latest, read_manifest
from stitch_core.versions.trust import PublicKey, TrustSet, UntrustedVersionError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RUN = "fz"
GOOD = {
    "run": RUN, "version": 3, "parent": 2, "kind": "patch", "view": "bf16", "step": 3,
    "created": "2026-12-01T00:00:00.000+00:00", "producer": "test", "digest": "0" * 16,
    "tensors": [{"name": "w", "dtype": "bfloat16", "shape": [4, 4], "fingerprint": "1" * 16}],
    "objects": [{"path": "patch.stp", "size": 10, "sha256": "a" * 64, "role": "patch"}],
    "total_elements": 16, "signed_by": "2" * 16, "signature": "A" * 88,
}
TRUST = TrustSet.parse([PublicKey(b"\x07" * 32).text])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=True), st.text(max_size=30),
                    st.just("../../etc/passwd"), st.just("9" * 400))
json_values = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12)


@st.composite
def mutated_manifest(draw) -> bytes:
    """The good manifest with fields replaced, deleted or added, or its bytes cut or flipped."""
    obj = json.loads(json.dumps(GOOD))
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from([*GOOD, "extra"]))
        action = draw(st.sampled_from(["set", "del", "nested"]))
        if action == "del":
            obj.pop(key, None)
        elif action == "nested" and key in ("tensors", "objects") and \
                isinstance(obj.get(key), list) and obj[key] and isinstance(obj[key][0], dict) \
                and obj[key][0]:  # an earlier "set" may have left [{}]: nothing to replace
            item = dict(obj[key][0])
            item[draw(st.sampled_from(sorted(item)))] = draw(json_values)
            obj[key] = [item]
        else:
            obj[key] = draw(json_values)
    raw = json.dumps(obj).encode()
    cut = draw(st.sampled_from(["none", "truncate", "flip"]))
    if cut == "truncate" and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif cut == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    return raw


@FUZZ
@given(st.one_of(mutated_manifest(), st.binary(max_size=300)))
def test_manifest_bytes_parse_or_fail_cleanly(raw):
    try:
        m = Manifest.model_validate_json(raw)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return
    assert 0 <= m.version <= MAX_VERSION
    assert all(".." not in o.path and "/" not in o.path for o in m.objects)
    with contextlib.suppress(UntrustedVersionError):
        TRUST.check(m, "manifest", "fuzz")


@FUZZ
@given(st.one_of(mutated_manifest(), st.binary(max_size=200)),
       st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps(
           {"run": RUN, "version": v, "kind": "patch", "updated": "x"}).encode(),
           st.integers(-(2**70), 2**70))))
def test_read_manifest_and_latest_from_a_board_fail_cleanly(raw, latest):
    with tempfile.TemporaryDirectory() as d:
        key = Path(d) / manifest_key(RUN, 3)
        key.parent.mkdir(parents=True)
        key.write_bytes(raw)
        (Path(d) / RUN / "latest").write_bytes(latest)
        board = LocalBoard(d)

        async def go():
            for trust in (None, TRUST):
                with contextlib.suppress(VersionError):
                    await read_manifest(board, RUN, 3, trust)
                with contextlib.suppress(VersionError):
                    await read_latest(board, RUN, trust)

        asyncio.run(go())


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["run", "version", "parent", "kind", "board",
                                                  "manifest", "patch_bytes", "id", "state",
                                                  "time", "updated"]), json_values)
                 .map(lambda v: json.dumps(v).encode())))
def test_announcements_heartbeats_and_latest_parse_or_fail_cleanly(raw):
    for model in (Announcement, Heartbeat, Latest):
        try:
            obj = model.model_validate_json(raw)
        except ValueError:
            continue
        v = getattr(obj, "version", None)
        if model is not Heartbeat:
            assert v is not None and 0 <= v <= MAX_VERSION
