"""Stitch for vLLM: a running vLLM server follows a Stitch run in place.

See docs/engines.md.

Installing stitch-rl registers the `vllm.general_plugins` entry point `stitch =
stitch_vllm.plugin:register` (CPU set-up only); `python -m vllm.entrypoints.openai.api_server
<stitch pull dir> --worker-extension-cls stitch_vllm.worker.StitchWorkerExtension --middleware
stitch_vllm.server.StitchMiddleware` with STITCH_BOARD / STITCH_RUN / STITCH_NATS_URL set then
applies every version on every TP rank and serves the version protocol.
"""
