"""A regional relay on an existing engine: nginx as an HTTP cache in front of a board.
One WAN transfer per region per object.

`stitch relay http --origin http://origin:8000 --port 8080 --dir DIR` runs nginx with
`nginx_config` (stitch_core.versions.relay_nginx: a caching reverse proxy: objects under
`versions/` cached whole after one upstream fetch, concurrent misses collapsed onto that one
fetch by `proxy_cache_lock`, `latest`, `spans.json` and every non-200 answer passed through and
never stored, a bad copy replaced on a rate-limited `X-Stitch-Refresh`). Followers are given
`STITCH_BOARD=http://relay:8080,http://origin:8000` (a FallbackBoard: the relay, else the
origin). For a NATS board, `region_config` + `mirror_board` make a region's nats-server a
leafnode of the origin's with JetStream mirrors of the board's object store and `latest` KV
(`STITCH_BOARD=nats://region:4222/stitch,nats://origin:4222/stitch`). Why these, the headers
that make any CDN safe, and the limits: docs/relays.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stitch_core.errors import StitchError
from stitch_core.settings import Settings, env_name
from stitch_core.versions.relay_nginx import (
    DEFAULT_MAX_CACHE,
    RelayConfigError,
    check_token,
    nginx_config,
)

ENV_NGINX = env_name("nginx")
__all__ = ["DEFAULT_MAX_CACHE", "NginxRelay", "RelayConfigError", "RelayError", "find_nginx",
           "hub_config", "mirror_board", "nginx_config", "region_config", "run_relay"]


class RelayError(StitchError, RuntimeError):
    """A relay's engine is missing, did not start, or died."""


def find_nginx() -> str:
    """The nginx binary: $STITCH_NGINX, PATH, /usr/sbin/nginx."""
    for cand in (Settings.read("nginx"), shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise RelayError("nginx not found: install it (Debian/Ubuntu: apt-get install nginx-light; "
                     f"scripts/dev.py setup does) or set ${ENV_NGINX} to its path")


class NginxRelay:
    """An nginx HTTP relay child process (`nginx -g 'daemon off;'`); context manager."""

    def __init__(self, origin: str, port: int, directory: str | os.PathLike, *,
                 host: str = "127.0.0.1", max_cache: str = DEFAULT_MAX_CACHE,
                 upstream_rate: str | None = None, binary: str | None = None,
                 refresh_token: str | None = None):
        self.origin = origin.rstrip("/")
        self.refresh_token = check_token(refresh_token) if refresh_token else None
        self.port = port
        self.host = host
        self.dir = Path(directory).expanduser().resolve()
        self.max_cache = max_cache
        self.upstream_rate = upstream_rate
        self.binary = binary
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def conf(self) -> Path:
        return self.dir / "nginx.conf"

    @property
    def access_log(self) -> Path:
        return self.dir / "access.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "error.log").read_text(errors="replace")[-tail:]
        return ""

    def write_config(self) -> Path:
        for sub in ("cache", "tmp"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        text = nginx_config(self.origin, self.port, self.dir, host=self.host,
                            max_cache=self.max_cache, upstream_rate=self.upstream_rate,
                            refresh_token=self.refresh_token)
        tmp = self.conf.with_name("nginx.conf.tmp")
        tmp.write_text(text)
        tmp.replace(self.conf)
        return self.conf

    def start(self, timeout: float = 10.0) -> NginxRelay:
        if self.running:
            return self
        binary = self.binary or find_nginx()
        self.write_config()
        cmd = [binary, "-e", str(self.dir / "error.log"), "-p", str(self.dir), "-c",
               str(self.conf), "-g", "daemon off;"]
        with open(self.dir / "nginx.out", "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.dir / "nginx.out").read_text(errors="replace")[-2000:]
                self.proc = None
                raise RelayError(f"nginx exited before it was ready:\n{err}{self.output()}")
            if _accepts(self.host, self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RelayError(f"nginx did not listen on {self.url} within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # nginx: fast shutdown
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> NginxRelay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def upstream_fetches(self, until: Callable[[dict[str, int]], bool] | None = None,
                         timeout: float = 10.0) -> dict[str, int]:
        """Requests this relay answered, by cache status, from its access log (MISS: the
        object fetched for the cache; BYPASS/None: passed through, e.g. `latest`; HIT: served
        from the cache). nginx writes a request's line after it has sent the response, so a
        client that has just read its answer can be ahead of the log: with `until`, the log is
        read again (up to `timeout` s) until `until(counts)` holds, and returned as it is then."""
        deadline = time.monotonic() + timeout
        while True:
            out: dict[str, int] = {}
            with contextlib.suppress(OSError):
                for line in self.access_log.read_text().splitlines():
                    st = next((p[6:] for p in line.split() if p.startswith("cache=")), "-")
                    out[st] = out.get(st, 0) + 1
            if until is None or until(out) or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- NATS: leafnode + mirrors

def hub_config(leaf_port: int, *, domain: str = "hub") -> str:
    """Lines for the origin's nats-server config: a JetStream domain of its own (so regions can
    address its JetStream API as `$JS.<domain>.API`) and a port for region leafnodes."""
    return (f"jetstream {{\n  domain: {domain}\n  sync_interval: always\n}}\n"
            f"leafnodes {{\n  port: {leaf_port}\n}}\n")


def region_config(origin_leaf_url: str, *, domain: str, server_name: str | None = None) -> str:
    """A region's nats-server config: a leafnode of the origin (`nats-leaf://host:7422`) with
    a JetStream domain of its own, which holds the mirrors `mirror_board` makes."""
    u = origin_leaf_url if "://" in origin_leaf_url else f"nats-leaf://{origin_leaf_url}"
    return (f"server_name: {server_name or domain}\n"
            f"jetstream {{\n  domain: {domain}\n}}\n"
            f"leafnodes {{\n  reconnect: \"1s\"\n  remotes [ {{ url: \"{u}\" }} ]\n}}\n")


async def mirror_board(region_url: str, bucket: str = "stitch", *, origin_domain: str = "hub",
                       timeout: float = 30.0) -> list[str]:
    """Make the region's JetStream (the server at `region_url`) hold mirrors of a NATS board's
    two streams on the origin: `OBJ_<bucket>` (the objects) and `KV_<bucket>_latest`, under the
    same names, so a NatsBoard on the region server reads them as the board itself (nats-py's
    object store and KV read a mirror as they read the original: tests/test_relay.py). Each
    object crosses the leaf connection once, whatever the number of readers in the region. Waits
    up to `timeout` for the origin's streams to exist (a mirror of a missing stream does not
    catch up promptly), then until each mirror holds what the origin held when it looked; an
    existing mirror is left as it is. Returns the streams mirrored."""
    import nats
    from nats.js import api
    from nats.js.errors import NotFoundError

    nc = await nats.connect(region_url, connect_timeout=5)
    try:
        local, origin = nc.jetstream(), nc.jetstream(domain=origin_domain)
        done = []
        for name in (f"OBJ_{bucket}", f"KV_{bucket}_latest"):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    src = (await origin.stream_info(name)).config
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RelayError(f"stream {name} not found on the origin (JetStream "
                                         f"domain {origin_domain!r}) within {timeout:.0f} s; "
                                         f"publish once first") from None
                    await asyncio.sleep(0.2)
            try:
                await local.stream_info(name)
                done.append(name)
                continue
            except NotFoundError:
                pass
            cfg = api.StreamConfig(
                name=name, storage=api.StorageType.FILE,
                mirror=api.StreamSource(name=name, external=api.ExternalStream(
                    api=f"$JS.{origin_domain}.API")),
                # what the KV and object-store clients check of a stream they open
                max_msgs_per_subject=src.max_msgs_per_subject, allow_rollup_hdrs=True,
                allow_direct=bool(src.allow_direct), discard=src.discard,
                description=f"stitch relay: mirror of {name} (JetStream domain "
                            f"{origin_domain})")
            await local.add_stream(cfg)
            done.append(name)
        for name in done:  # caught up with what the origin held when we looked
            want = (await origin.stream_info(name)).state.last_seq
            deadline = time.monotonic() + timeout
            while (await local.stream_info(name)).state.last_seq < want:
                if time.monotonic() > deadline:
                    raise RelayError(f"mirror {name} did not catch up with the origin within "
                                     f"{timeout:.0f} s")
                await asyncio.sleep(0.05)
        return done
    finally:
        await nc.close()


def run_relay(server, what: str, after_start=None) -> int:
    """Run a relay (an NginxRelay or a NatsServer) until Ctrl-C/SIGTERM, calling
    `after_start(server)` once it is up; returns an exit status (1: the relay died)."""

    def _term(signum, frame):
        raise KeyboardInterrupt

    previous = None
    with contextlib.suppress(ValueError):
        previous = signal.signal(signal.SIGTERM, _term)
    try:
        server.start()
        print(f"{what}: {server.url}", flush=True)
        if after_start is not None:
            after_start(server)
        print("Ctrl-C to stop.", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"the relay exited unexpectedly:\n{server.output()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _mirror_in_background(bucket: str, origin_domain: str):
    """after_start for a region nats-server: make the board's mirrors once the origin has the
    board's streams (retried every few seconds until then), in a daemon thread."""
    import threading

    def start(server) -> None:
        def work() -> None:
            while server.running:
                try:
                    done = asyncio.run(mirror_board(server.url, bucket,
                                                    origin_domain=origin_domain, timeout=10))
                except Exception as e:  # noqa: BLE001 - the origin has no board yet, or is away
                    print(f"mirrors of {bucket!r} not made yet ({e}); retrying", flush=True)
                    time.sleep(5)
                    continue
                print(f"mirroring {', '.join(done)} from JetStream domain {origin_domain!r}",
                      flush=True)
                return

        threading.Thread(target=work, daemon=True, name="stitch-mirror").start()

    return start


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The relay verbs (`http`, `nats`, `hub-config`) under `sub`: `stitch relay ...` and
    `python -m stitch_core.versions.relay ...` are the same parser."""
    h = sub.add_parser("http", help="nginx caching the board's immutable objects: one upstream "
                                    "fetch per object for the whole region")
    h.add_argument("--origin", required=True, help="the board's URL, e.g. http://origin:8000")
    h.add_argument("--port", type=int, default=8080)
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--dir", default="./stitch-relay", help="cache, logs and nginx.conf")
    h.add_argument("--max-cache", default=DEFAULT_MAX_CACHE, help="proxy_cache max_size")
    h.add_argument("--refresh-token-file", metavar="FILE",
                   help="honour X-Stitch-Refresh only with this file's token as its value "
                        "(followers: $STITCH_RELAY_REFRESH_TOKEN); without it any follower may "
                        "refresh an object, at most once a minute per object")
    h.set_defaults(fn=_run_http)
    n = sub.add_parser("nats", help="a region's nats-server: leafnode of the origin's, holding "
                                    "JetStream mirrors of the board")
    n.add_argument("--leaf-of", required=True, help="the origin's leafnode URL, "
                                                    "e.g. nats-leaf://origin:7422")
    n.add_argument("--domain", required=True, help="this region's JetStream domain, e.g. eu")
    n.add_argument("--origin-domain", default="hub", help="the origin's JetStream domain")
    n.add_argument("--port", type=int, default=4222)
    n.add_argument("--host", default="127.0.0.1")
    n.add_argument("--dir", default="./stitch-relay-nats", help="JetStream store, config, log")
    n.add_argument("--mirror", metavar="BUCKET", default="stitch",
                   help="mirror this NATS board (OBJ_<bucket>, KV_<bucket>_latest); '' for none")
    n.set_defaults(fn=_run_nats)
    c = sub.add_parser("hub-config", help="print the origin nats-server's leafnode config lines")
    c.add_argument("--leaf-port", type=int, default=7422)
    c.add_argument("--domain", default="hub")
    c.set_defaults(fn=_hub_config)


def _hub_config(a: argparse.Namespace) -> int:
    print(hub_config(a.leaf_port, domain=a.domain), end="")
    return 0


def _run_nats(a: argparse.Namespace) -> int:
    from stitch_core.versions.natsserver import NatsServer

    d = Path(a.dir).expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "region.conf"
    conf.write_text(region_config(a.leaf_of, domain=a.domain))
    server = NatsServer(d, port=a.port, host=a.host, config=conf)
    after = _mirror_in_background(a.mirror, a.origin_domain) if a.mirror else None
    return run_relay(server, f"NATS relay (leafnode of {a.leaf_of}, JetStream domain "
                             f"{a.domain!r})", after)


def _run_http(a: argparse.Namespace) -> int:
    token = None
    if a.refresh_token_file:
        token = Path(a.refresh_token_file).expanduser().read_text().strip()
    relay = NginxRelay(a.origin, a.port, Path(a.dir), host=a.host, max_cache=a.max_cache,
                       refresh_token=token)
    return run_relay(relay, f"HTTP relay of {a.origin} (nginx, cache in {relay.dir})")


def main(argv: list[str] | None = None) -> int:
    """`python -m stitch_core.versions.relay http --origin URL [--port N] [--dir D]`,
    `... nats --leaf-of nats-leaf://origin:7422 --domain eu [--port N] [--dir D] [--mirror
    BUCKET]` (a region's nats-server, leafnode of the origin's, with the board's mirrors) and
    `... hub-config --leaf-port 7422` (the origin's config lines); the same as `stitch relay`."""
    ap = argparse.ArgumentParser(prog="python -m stitch_core.versions.relay",
                                 description="a region's relay of a board")
    add_parsers(ap.add_subparsers(dest="kind", required=True))
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
