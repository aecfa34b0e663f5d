"""Development helpers for this repository's tests, demo and benchmarks: not part of the
`stitch-rl` distribution (the wheel ships stitch_core, stitch_trainer, stitch_vllm and
stitch_sglang only). Import it from a checkout: pytest puts the repository root on ``sys.path``;
scripts and benchmarks add it themselves."""
