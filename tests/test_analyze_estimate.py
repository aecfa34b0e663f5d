"""The offset-aware estimate of `stitch analyze` (`expected_offsets`) against measured bf16
changes: masters on the grid (a bf16 checkpoint), masters placed uniformly (fp32), and masters
moved off the grid by a consistent drift (Adam after a bf16 start)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stitch_trainer.analyze.estimate import (
    crossing_probability,
    expected_offsets,
    offset_histogram,
    offsets,
    ulp,
)
from stitch_trainer.analyze.experiment import analyze_training

N = 200_000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _weights(g: torch.Generator) -> torch.Tensor:
    return torch.randn(N, generator=g) * 0.02


def _measure(old: torch.Tensor, new: torch.Tensor) -> tuple[int, float, float, float]:
    """(changed, uniform `expected`, offsets signed, offsets independent) for bf16."""
    s = old.to(torch.bfloat16)
    changed = int((new.to(torch.bfloat16).view(torch.int16) != s.view(torch.int16)).sum())
    u = ulp(s.float(), torch.bfloat16)
    uniform = float(((new - old).abs() / u).clamp(max=1).sum())
    return (changed, uniform, expected_offsets(old, new, s),
            expected_offsets(old, new, s, signed=False))


def _push(old: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """old moved by x ULPs of its served bf16 value."""
    return old + x * ulp(old.to(torch.bfloat16).float(), torch.bfloat16)


def test_histogram_and_crossing_probability():
    o = torch.tensor([0.0, 0.0, -0.25, 0.25])
    p0, cdf = offset_histogram(o)
    assert p0.tolist() == [0.5] and cdf[0, 0] == 0 and cdf[0, -1] == 1
    x = torch.tensor([0.0, 0.3, 0.6, -0.8, 1.0, -2.0])
    p = crossing_probability(x, (p0, cdf))
    # on the grid: a change iff |x| > 1/2; at +-1/4: iff the push passes the nearer boundary
    assert p.tolist() == pytest.approx([0.0, 0.25, 0.75, 1.0, 1.0, 1.0], abs=1e-6)
    # uniform offsets: P = min(1, |x|), the old `expected`
    u = torch.linspace(-0.5, 0.5, 100_001)
    p = crossing_probability(x, offset_histogram(u))
    assert p.tolist() == pytest.approx(x.abs().clamp(max=1).tolist(), abs=2e-3)
    # offsets of masters placed on the grid are exactly 0
    w = torch.randn(1000).to(torch.bfloat16)
    assert offsets(w.float(), w).abs().max() == 0


def test_masters_on_the_grid():
    """A bf16 checkpoint: every offset is 0, so only |x| > 1/2 changes; the uniform estimate
    counts min(1, |x|) and overcounts (here 1.8x); the offset-aware one is within 2%."""
    g = torch.Generator().manual_seed(0)
    old = _weights(g).to(torch.bfloat16).float()
    x = torch.rand(N, generator=g) * 0.6 * torch.sign(torch.randn(N, generator=g))
    changed, uniform, signed, indep = _measure(old, _push(old, x))
    assert changed == pytest.approx(N / 6, rel=0.03)
    assert uniform > 1.6 * changed
    assert signed == pytest.approx(changed, rel=0.02)
    assert indep == pytest.approx(changed, rel=0.02)


def test_masters_uniform_in_their_interval():
    """Unrounded fp32 masters sit uniformly in their intervals: both estimates agree with the
    measurement (within 2%)."""
    g = torch.Generator().manual_seed(1)
    old = _weights(g)
    x = torch.rand(N, generator=g) * 0.6 * torch.sign(torch.randn(N, generator=g))
    changed, uniform, signed, indep = _measure(old, _push(old, x))
    assert changed == pytest.approx(0.3 * N, rel=0.03)
    for est in (uniform, signed, indep):
        assert est == pytest.approx(changed, rel=0.02)


def test_drift_after_a_bf16_start():
    """Adam after a bf16 start: each master drifts the same way every step, so its offset
    after step 1 points along its next update. Pooling offsets signed along the update keeps
    that (within 3%); an independent pool undercounts, the uniform estimate overcounts."""
    g = torch.Generator().manual_seed(2)
    old = _weights(g).to(torch.bfloat16).float()
    d = torch.exp(torch.empty(N).uniform_(-5, 0, generator=g))  # |x| log-uniform up to 1
    d = d * torch.sign(torch.randn(N, generator=g))
    mid = _push(old, d)
    new = mid + (mid - old)  # the same step again
    changed, uniform, signed, indep = _measure(mid, new)
    assert signed == pytest.approx(changed, rel=0.03)
    assert indep < 0.9 * changed < uniform / 1.1


def test_analyze_training_reports_offsets(tmp_path: Path):
    """`stitch analyze` on a bf16 safetensors file (masters start on the grid): the new field
    is reported per step, per group and in the summary, and tracks the measurement better than
    the uniform `expected` on the first step."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    f = tmp_path / "w.safetensors"
    save_file({"model.layers.0.mlp.up_proj.weight":
               (torch.randn(128, 128, generator=g) * 0.02).to(torch.bfloat16)}, f)
    rep = analyze_training(f, steps=2, lr=1e-5)
    first = rep["steps"][0]
    assert 0 < first["changed_fraction"] < 1
    assert first["expected_offsets_fraction"] == pytest.approx(first["changed_fraction"],
                                                               rel=0.05)
    assert first["expected_fraction"] > 1.2 * first["changed_fraction"]
    assert "expected_offsets_fraction" in first["groups"]["mlp_up"]
    assert 0 < rep["summary"]["total"]["expected_offsets_fraction"] < 1
