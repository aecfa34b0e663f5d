"""The serve layer: the version protocol an engine's HTTP server speaks, and the fleet's front.

One job per module. The engine's side: headers and bodies (`protocol`, pure), the per-request
version gate (`gate`), which of the engine's HTTP routes are version-controlled (`route_table`),
the ASGI middleware that admits each request through the gate (`asgi`), the stamping of its
answer with the versions that produced it (`stamping`: JSON bodies, SSE and NDJSON streams) and
the Prometheus metrics (`metrics`); `asgi_types` holds the ASGI types and helpers these share with
the gateway. The gateway's side (`stitch gateway`): heartbeats admitted (`admission`), the table
of engines and the order to try them in (`routing`), the HTTP proxy rules (`proxy`) and the app
(`gateway`). Uses the versions layer for the served state; knows nothing of ranks or layouts (the
engine layer): the composition root `stitch_core.node` joins the two.
"""
