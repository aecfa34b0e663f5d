"""`stitch warm` fills numba's on-disk cache with what later processes use (real processes, an
empty NUMBA_CACHE_DIR of their own)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from stitch_core.engine import warm

ROOT = Path(__file__).resolve().parents[1]

# a later process's own work, unlike warm's: other shapes, the public API, a layout learned on
# another module, and the fingerprints of a whole state; prints numba's (hits, misses)
LATER = r"""
import torch
import stitch_core
from stitch_core.engine.layout import learn_layout
from stitch_core.engine.warm import cache_counts
from stitch_core.format import fingerprint as fpr

g = torch.Generator().manual_seed(1)
for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
    a = {"w": (torch.randn(300, 517, generator=g) * 0.05).to(dtype)}
    for frac in (0.003, 0.5, 1.0):
        bits = a["w"].view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[a["w"].element_size()])
        b = bits.clone().reshape(-1)
        n = b.numel()
        pos = torch.randperm(n, generator=g)[: max(1, int(n * frac))]
        b[pos] += 1
        new = {"w": b.view(a["w"].shape).view(dtype)}
        fps = fpr.state_fingerprints(a)
        got = stitch_core.apply(a, stitch_core.diff(a, new, base_fingerprints=fps),
                                base_fingerprints=fps)
        assert torch.equal(got["w"].view(torch.uint8), new["w"].view(torch.uint8))

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(10, 30, dtype=torch.bfloat16), requires_grad=False)
    def load_weights(self, weights):
        for _, w in weights:
            self.p.data.copy_(w)
learn_layout(M(), {"p": ((10, 30), torch.bfloat16)})
print(cache_counts())
"""


def _env(cache: Path) -> dict[str, str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    env.pop("NUMBA_DISABLE_JIT", None)
    return env


def _stitch_warm(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "stitch_core.cli", "warm", "--json"], env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout)


def test_every_module_with_cached_kernels_is_warmed():
    found = set()
    for f in (ROOT / "stitch_core").rglob("*.py"):
        if "numba.njit(cache=True" in f.read_text():
            found.add(".".join(f.relative_to(ROOT).with_suffix("").parts))
    assert found == set(warm.KERNEL_MODULES)
    assert len(warm.kernels()) >= len(found)


def test_warm_fills_the_cache_a_later_process_uses(tmp_path):
    env = _env(tmp_path / "numba")
    first = _stitch_warm(env)
    assert first["compiled"] > 10 and first["loaded"] == 0, first
    assert str(tmp_path / "numba") in first["cache_dir"]
    # a later process doing its own work compiles nothing
    out = subprocess.run([sys.executable, "-c", LATER], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    hits, misses = map(int, re.findall(r"\d+", out.stdout.strip().splitlines()[-1]))
    assert misses == 0 and hits > 0, out.stdout
    # and warming again compiles nothing (kernels called only from other kernels come with
    # their callers' cached code, so fewer signatures are read than were compiled)
    again = _stitch_warm(env)
    assert again["compiled"] == 0 and 0 < again["loaded"] <= first["compiled"], again
