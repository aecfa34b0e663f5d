"""The version headers are untrusted input: whatever bytes a client sends in them, parsing
answers a VersionRequest or a BadRequestError (a 400), never another exception (a 500)."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch_core.serve import protocol
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.gate import VersionGate

NAMES = [protocol.VERSION_HEADER, protocol.MIN_VERSION_HEADER, protocol.WAIT_HEADER]
values = st.one_of(
    st.binary(max_size=64),
    st.text(alphabet="0123456789 +-.eEinfa_x", max_size=40).map(str.encode),
    st.integers(min_value=0, max_value=6000).map(lambda n: b"9" * n),  # over-long numbers
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda n: str(n).encode()),
)
headers = st.lists(st.tuples(st.sampled_from([n.lower().encode() for n in NAMES]), values),
                   max_size=4)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(headers)
def test_parse_request_answers_a_request_or_a_bad_request(hs):
    try:
        req = protocol.parse_request(hs)
    except protocol.BadRequestError:
        return
    for v in (req.exact, req.minimum):
        assert v is None or 0 <= v < 2**63
    assert 0 <= req.wait <= protocol.DEFAULT_MAX_WAIT


def test_an_over_long_version_header_is_a_400_through_the_middleware():
    """Seen as a 500 before: a 5000-digit version made int() raise."""
    import asyncio

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the request must be refused before the app")

    async def go():
        gate = VersionGate("fz")
        gate.set_version(1)
        mw = StitchASGI(app, lambda: gate)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw),
                                     base_url="http://t") as c:
            for value in (b"9" * 5000, b"9" * 20, b"-1", b"1e3", b"\xb2"):
                r = await c.post("/v1/completions", json={"prompt": "x"},
                                 headers={protocol.VERSION_HEADER: value})
                assert r.status_code == 400, (value[:20], r.status_code, r.text[:200])
                assert len(r.text) < 1000  # the echoed value is cut short

    asyncio.run(go())
