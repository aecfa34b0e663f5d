"""The serve layer: the version protocol an engine's HTTP server speaks.

Headers and bodies (`protocol`, pure), the per-request version gate (`gate`), the ASGI middleware
that applies it to an OpenAI-compatible server (`asgi`) and the Prometheus metrics (`metrics`).
Uses the versions layer for the served state; knows nothing of ranks or layouts (the engine layer):
the composition root `stitch_core.node` joins the two.
"""
