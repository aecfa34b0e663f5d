"""The GPU check (stitch_dev/gpu_check.py, `dev.py gpu-check`) runs here on the CPU at a tiny size:
every section runs checks and passes, the timings come out, and a bit flipped on the device side
of any section makes it fail with a non-zero exit status (a check that cannot fail proves
nothing). On a GPU the same code runs with --device cuda; that is never run here."""

from __future__ import annotations

import json

import pytest
import torch

from stitch_dev import gpu_check

TINY = ["--device", "cpu", "--numel", "4096", "--changed", "256", "--repeat", "2",
        "--side", "131"]


def _run(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"report{len(list(tmp_path.iterdir()))}.json"
    rc = gpu_check.main([*TINY, "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_every_section_runs_and_passes_on_the_cpu(tmp_path, capsys):
    rc, report = _run(tmp_path, "--json")
    assert rc == 0, [r for r in report["checks"] if not r["ok"]]
    assert report["ok"] and report["device"] == "cpu"
    for section in gpu_check.SECTIONS:
        assert report["sections"][section]["checks"] > 0, section
        assert report["sections"][section]["failed"] == 0, section
    names = [f"{r['section']}: {r['check']}" for r in report["checks"]]
    for expected in ("projection: fp8-e4m3-block pinned", "projection: bf16 fresh",
                     "fingerprint: fp8-e4m3-block update", "diff: fp8-e4m3-block",
                     "apply: bf16: device patch", "replica: undo-1: write", "replica: commit-1",
                     "follower: v3: ranks equal fresh engines", "follower: verify",
                     "apply: timing size", "replica: timing size"):
        assert any(n.startswith(expected) for n in names), expected
    ops = {r["op"]: r for r in report["timings"]}
    assert {"bare torch.nonzero(a != b)", "bare index_put_", "stitch diff (one tensor, base fp "
            "known)", "stitch diff, coding stubbed (device part)",
            "stitch apply in place (format.apply)",
            "RankReplica gather + write + read-back"} <= ops.keys()
    assert all(r["ms"] > 0 and r["ms_per_1M"] > 0 for r in report["timings"])
    assert ops["stitch diff (one tensor, base fp known)"]["x_bare"] > 0
    out = capsys.readouterr().out
    assert "gpu-check: ok" in out and "ms / 1M" in out
    assert json.loads(out.strip().splitlines()[-1])["ok"] is True  # --json: the last line


def test_a_flipped_bit_in_any_section_fails_the_check(tmp_path):
    args = [a for s in gpu_check.SECTIONS for a in ("--corrupt", s)]
    rc, report = _run(tmp_path, *args)
    assert rc == 1 and report["ok"] is False
    for section in gpu_check.SECTIONS:
        assert report["sections"][section]["failed"] > 0, f"{section} did not see its flip"
    # nothing failed for another reason: each section fails only where its bit was flipped
    assert not any(r["check"] == "ran to the end" for r in report["checks"])


def test_a_wrong_device_fingerprint_path_is_caught(tmp_path, monkeypatch):
    """The torch path is what CUDA tensors hash with: a bug there must fail the check here."""
    from stitch_core.format import fingerprint as fpr

    real = fpr.fingerprint_torch
    monkeypatch.setattr(fpr, "fingerprint_torch",
                        lambda *a, **k: (real(*a, **k) + 1) & fpr.MASK64)
    rc, report = _run(tmp_path)
    assert rc == 1 and report["sections"]["fingerprint"]["failed"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_device_is_an_error_not_a_pass(capsys):
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_fsdp_check_passes_on_the_cpu(tmp_path):
    """The FSDP2 trainer-side check (stitch_dev.fsdp_check, gloo here, NCCL on a GPU) in its own
    process (it owns a process group): every check passes and every version changed."""
    import subprocess
    import sys

    out = tmp_path / "fsdp.json"
    r = subprocess.run([sys.executable, "-m", "stitch_dev.fsdp_check", "--device", "cpu",
                        "--hidden", "64", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["backend"] == "gloo"
    assert len(report["checks"]) == 1 + 3 + 2 + 1  # manifests, fingerprints, changed, pull
    assert all(c["ok"] for c in report["checks"]) and all(n > 0 for n in report["changed"])
