"""`stitch gateway`: a fleet of engines behind one OpenAI-compatible endpoint
(stitch_core.serve.gateway; docs/gateway.md)."""

from __future__ import annotations

import argparse
import logging

from stitch_core.settings import MAX_WAIT, Settings


def cmd_gateway(a: argparse.Namespace) -> int:
    """`stitch gateway`: serve until interrupted; returns the exit status."""
    from stitch_core.serve.admission import UrlAllowList
    from stitch_core.serve.gateway import Gateway, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    url = a.url or f"http://{a.host}:{a.port}"
    try:
        allow = UrlAllowList.parse(a.engine_url_allow or [])
    except ValueError as e:
        raise SystemExit(f"stitch gateway: --engine-url-allow: {e}") from e
    gw = Gateway(a.run, a.nats, region=a.region, ttl=a.ttl, gateway_id=a.id, url=url,
                 max_wait=a.max_wait, upstream_timeout=a.upstream_timeout,
                 engine_url_allow=allow, max_engines=a.max_engines,
                 api_key=a.api_key or Settings.read("gateway_api_key"))
    serve(gw, a.host, a.port)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the `gateway` verb to `sub`."""
    g = sub.add_parser("gateway", help="one OpenAI-compatible endpoint in front of a run's "
                                       "engines (routes by version, least loaded first)")
    g.add_argument("--nats", required=True, help="NATS URL the engines' heartbeats are on")
    g.add_argument("--run", required=True)
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--region", default=Settings.read("region"),
                   help="try engines of this region first (default $STITCH_REGION)")
    g.add_argument("--ttl", type=float, default=10.0,
                   help="seconds an engine stays routable after its last heartbeat")
    g.add_argument("--max-wait", type=float, default=MAX_WAIT,
                   help="cap on X-Stitch-Wait (seconds)")
    g.add_argument("--id", help="gateway id in heartbeats (default gw-<host>-<pid>)")
    g.add_argument("--url", help="URL advertised in its heartbeat (default http://HOST:PORT)")
    # the defaults are serve.gateway.DEFAULT_UPSTREAM_TIMEOUT and serve.routing.
    # DEFAULT_MAX_ENGINES, written out so that building the parser imports no server code
    g.add_argument("--upstream-timeout", type=float, default=300.0,
                   help="seconds an engine has to send its response head (a non-streamed "
                        "completion sends it only when done) before the request goes to the "
                        "next engine or gets a 504; 0: no limit (default %(default)g)")
    g.add_argument("--engine-url-allow", action="append", metavar="PATTERNS",
                   help="hosts engine URLs may name: a host or address, '*.domain' or a CIDR "
                        "such as 10.0.0.0/8; repeatable or comma-separated (default: any)")
    g.add_argument("--max-engines", type=int, default=1024,
                   help="engines kept in the table; the least recently heard is evicted "
                        "(default %(default)d)")
    g.add_argument("--api-key", help="Bearer key for /stitch/gateway and /metrics (default "
                                     "$STITCH_GATEWAY_API_KEY; none: open)")
    g.set_defaults(fn=cmd_gateway)
