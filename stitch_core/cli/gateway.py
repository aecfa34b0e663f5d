"""`stitch gateway`: a fleet of engines behind one OpenAI-compatible endpoint
(stitch_core.serve.gateway; docs/gateway.md)."""

from __future__ import annotations

import argparse
import logging
import os


def cmd_gateway(a: argparse.Namespace) -> int:
    """`stitch gateway`: serve until interrupted; returns the exit status."""
    from stitch_core.serve.gateway import Gateway, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    url = a.url or f"http://{a.host}:{a.port}"
    gw = Gateway(a.run, a.nats, region=a.region, ttl=a.ttl, gateway_id=a.id, url=url,
                 max_wait=a.max_wait)
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
    g.add_argument("--region", default=os.environ.get("STITCH_REGION") or None,
                   help="try engines of this region first (default $STITCH_REGION)")
    g.add_argument("--ttl", type=float, default=10.0,
                   help="seconds an engine stays routable after its last heartbeat")
    g.add_argument("--max-wait", type=float, default=600.0,
                   help="cap on X-Stitch-Wait (seconds)")
    g.add_argument("--id", help="gateway id in heartbeats (default gw-<host>-<pid>)")
    g.add_argument("--url", help="URL advertised in its heartbeat (default http://HOST:PORT)")
    g.set_defaults(fn=cmd_gateway)
