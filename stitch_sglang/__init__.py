"""Stitch for SGLang: a running SGLang server follows a Stitch run in place.

See docs/engines-sglang.md.

Installing stitch-rl registers the `sglang.srt.plugins` entry point `stitch =
stitch_sglang.plugin:register`; `python -m sglang.launch_server --model-path <stitch pull dir>`
with STITCH_BOARD / STITCH_RUN / STITCH_NATS_URL set then serves the version protocol.
"""
