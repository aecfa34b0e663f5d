"""Which engine heartbeats the gateway believes (stitch_core.serve.gateway feeds them in).

A heartbeat tells the gateway where to send clients' requests (prompts and `Authorization`
headers included), so it is checked before it reaches the routing table:

* it arrived on its own subject: ``stitch.<run>.engines.<engine_token(id)>``
  (`announce.speaks_for`). NATS binds a publisher to subjects, not to what its messages say;
  with this check an engine allowed to publish on its own subject only can speak only for
  itself, and the table holds at most one engine per subject;
* it is at most `MAX_HEARTBEAT_BYTES`, parses, and is of the gateway's run;
* its `time` is not more than `max_skew` seconds ahead of the clock that received it (a sender
  cannot make its heartbeat look newer than it is; the table orders heartbeats by arrival and
  stream sequence, never by this claim);
* its URL, if any, is a plain base URL (`engine_url`): ``http`` or ``https``, a host, a port in
  range, no user info, query or fragment; and, with an allow-list (``--engine-url-allow``), its
  host is listed.

Anything else raises `HeartbeatRejectedError` with the reason (the gateway logs it and keeps the
engine's previous state). No I/O here.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from stitch_core.errors import StitchError
from stitch_core.versions.announce import MAX_HEARTBEAT_BYTES, speaks_for
from stitch_core.versions.manifest import Heartbeat

MAX_CLOCK_SKEW = 30.0  # seconds a heartbeat's claimed time may be ahead of the receiver's clock
_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


class HeartbeatRejectedError(StitchError, ValueError):
    """A heartbeat the gateway does not believe (the message says why)."""


@dataclass(frozen=True)
class UrlAllowList:
    """Hosts engine URLs may name: exact host names or addresses (``127.0.0.1``,
    ``eng-1.internal``), ``*.suffix`` patterns (``*.engines.internal``: any name under it, not
    the suffix itself) and networks (``10.0.0.0/8``, ``fd00::/8``). Names are compared as
    written (case-insensitive), not resolved: a name pattern trusts whoever controls that DNS."""

    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[_Net, ...] = ()

    @classmethod
    def parse(cls, patterns: Iterable[str]) -> UrlAllowList:
        """From flag values, each one pattern or several comma-separated; ValueError if one is
        neither a host, a ``*.`` pattern nor a network."""
        hosts, suffixes, nets = set(), [], []
        for item in patterns:
            for p in (x.strip().lower() for x in item.split(",")):
                if not p:
                    continue
                if p.startswith("*."):
                    if len(p) < 3 or "*" in p[2:]:
                        raise ValueError(f"engine URL pattern {p!r}: '*.' then a domain")
                    suffixes.append(p[1:])  # ".engines.internal"
                elif "/" in p:
                    try:
                        nets.append(ipaddress.ip_network(p, strict=False))
                    except ValueError as e:
                        raise ValueError(f"engine URL pattern {p!r}: {e}") from e
                elif "*" in p or not p.strip("[]"):
                    raise ValueError(f"engine URL pattern {p!r}: a host, '*.domain' or a CIDR")
                else:
                    hosts.add(_address(p.strip("[]")) or p)
        return cls(frozenset(hosts), tuple(suffixes), tuple(nets))

    def __bool__(self) -> bool:
        return bool(self.hosts or self.suffixes or self.networks)

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        addr = _address(host)
        if addr is not None:
            ip = ipaddress.ip_address(addr)
            return addr in self.hosts or any(ip in n for n in self.networks)
        return host in self.hosts or any(host.endswith(s) for s in self.suffixes)


def _address(host: str) -> str | None:
    """`host` in canonical form if it is an IP address, else None."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def engine_url(url: str, allow: UrlAllowList | None = None) -> httpx.URL:
    """`url` parsed as an engine's base URL, or HeartbeatRejectedError. Requests go to its scheme,
    host, port and path prefix with the client's path and query appended (never by joining
    strings), so anything else in it is refused."""
    try:
        u = httpx.URL(url)
        port = u.port
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise HeartbeatRejectedError(f"engine URL {url!r} is malformed: {e}") from e
    if u.scheme not in ("http", "https"):
        raise HeartbeatRejectedError(f"engine URL {url!r}: not http or https")
    if not u.host:
        raise HeartbeatRejectedError(f"engine URL {url!r}: no host")
    if u.userinfo:
        raise HeartbeatRejectedError(f"engine URL {url!r}: user info is not allowed")
    if u.query or u.fragment:
        raise HeartbeatRejectedError(f"engine URL {url!r}: a query or fragment is not allowed")
    if port is not None and not 0 < port < 65536:
        raise HeartbeatRejectedError(f"engine URL {url!r}: port out of range")
    if allow and not allow.allows(u.host):
        raise HeartbeatRejectedError(f"engine URL {url!r}: host {u.host} is not in the allow-list "
                                "(--engine-url-allow)")
    return u


def parse_heartbeat(data: bytes) -> Heartbeat:
    """A heartbeat message's body, or HeartbeatRejectedError (oversized, malformed)."""
    if len(data) > MAX_HEARTBEAT_BYTES:
        raise HeartbeatRejectedError(f"{len(data)} bytes (limit {MAX_HEARTBEAT_BYTES})")
    try:
        return Heartbeat.model_validate_json(data)
    except ValueError as e:
        raise HeartbeatRejectedError(f"malformed: {str(e).splitlines()[0]}") from e


@dataclass(frozen=True)
class Admitted:
    """A heartbeat the gateway believes: `key` is its subject's last token (one table entry per
    subject), `base` its parsed URL (None: the engine names none, so it is not routable)."""

    hb: Heartbeat
    key: str
    base: httpx.URL | None


@dataclass
class Admission:
    """The checks of the module doc for one run's heartbeats."""

    run: str
    allow: UrlAllowList = field(default_factory=UrlAllowList)
    max_skew: float = MAX_CLOCK_SKEW

    def admit(self, subject: str, hb: Heartbeat, now: float | None = None) -> Admitted:
        """`hb` as it arrived on `subject` at `now` (epoch seconds; for a stored heartbeat the
        time the server stored it), or HeartbeatRejectedError."""
        if hb.run != self.run:
            raise HeartbeatRejectedError(f"of run {hb.run!r}, not {self.run!r}")
        if not speaks_for(self.run, subject, hb.id):
            raise HeartbeatRejectedError(f"claims id {hb.id!r}, which is not the id of its subject "
                                    "(a heartbeat speaks only for its own subject)")
        now = time.time() if now is None else now
        if hb.time > now + self.max_skew:
            raise HeartbeatRejectedError(f"claims a time {hb.time - now:.0f} s in the future (more "
                                    f"than the {self.max_skew:g} s clock skew allowed)")
        base = engine_url(hb.url, self.allow) if hb.url is not None else None
        return Admitted(hb, subject.rsplit(".", 1)[-1], base)
