"""Development helpers for this repository's tests, demo and benchmarks: not part of the
`stitch-rl` distribution (the wheel ships stitch_core, stitch_trainer, stitch_vllm and
stitch_sglang only). Import it from a checkout: pytest puts the repository root on ``sys.path``;
scripts and benchmarks add it themselves.

* ``ports``: ``free_port``, ``wait_port`` (standard library)
* ``procs``: stopping a server's process group, vLLM / SGLang server command lines and
  environments (standard library: tests/sglang/smoke.py runs on its own)
* ``server``: ``ServerProcess`` (an engine's HTTP server as a subprocess) and its status helpers
  (httpx)
* ``engines``: the engine suites' servers (``VllmServer``, ``SglangServer``), fresh reference
  engines, and the engine adapters (``VLLM``, ``SGLANG``) the scenarios of tests/engines run on
* ``trainer``: ``AdamWTrainer``, the synthetic trainer of the engine suites
* ``tinymodel``: tiny HF checkpoints; ``toy_engine``: the TP toy engine; ``ranks``: one process
  per rank
* ``engine_faults``: the real-engine fault rig; ``fault_rig``: the follower fault rig (rows of
  benchmarks/faults.py)
"""
