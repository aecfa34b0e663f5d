"""benchmarks/scale.py, rank_write.py and decode_threads.py on a tiny shape: behaviour, not
timings."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_threads  # noqa: E402
import rank_write  # noqa: E402
import scale  # noqa: E402


@pytest.fixture(autouse=True)
def keep_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_scale_smoke_run_reports_every_stage(tmp_path):
    md, js, png = tmp_path / "s.md", tmp_path / "s.json", tmp_path / "s.png"
    assert scale.main(["--sizes", "smoke", "--lrs", "1e-5", "--warm", "1", "--md", str(md),
                       "--json", str(js), "--png", str(png)]) == 0
    (row,) = json.loads(js.read_text())
    shape = scale.SHAPES["smoke"]
    assert row["params"] == shape.n_params
    assert 0 < row["changed"] < row["params"] and row["bytes"] > 0
    for key in ("project", "compare", "diff", "apply", "index_put", "write", "gather"):
        assert row[key] > 0, key
    assert row["first"][3] is False and row["restart"][3] is True  # the restart read the cache
    text = md.read_text()
    assert "## Engine side" in text and "| smoke | 1e-05 |" in text
    assert png.stat().st_size > 10_000
    # the 1T arithmetic, and a re-render from the JSON alone gives the same tables
    assert "## Carried to 1T parameters" in text
    again = tmp_path / "again.md"
    assert scale.main(["--from-json", str(js), "--md", str(again)]) == 0
    tables = lambda t: [ln for ln in t.splitlines() if ln.startswith("|")]  # noqa: E731
    assert tables(again.read_text()) == tables(text)


def test_rank_write_smoke_run_checks_the_write_against_the_view(tmp_path):
    # rank_write exits with an error if a write's fingerprint deltas differ from the view's
    md = tmp_path / "r.md"
    assert rank_write.main(["--sizes", "smoke", "--fractions", "0.01,0.2", "--reps", "1",
                            "--md", str(md)]) == 0
    rows = [ln for ln in md.read_text().splitlines() if ln.startswith("| smoke")]
    assert len(rows) == 2


def test_decode_threads_smoke_run_follows_every_version_on_both_thread_counts(tmp_path):
    # the run asserts the engine reached every version and verifies at the end; a small apply
    # memory makes every patch several batches (decoded inside the pause)
    md = tmp_path / "d.md"
    assert decode_threads.main(["--size", "smoke", "--pairs", "1", "--threads", "2",
                                "--apply-memory", "256KiB", "--md", str(md)]) == 0
    text = md.read_text()
    assert "--size smoke" in text
    summary = [ln.split("|") for ln in text.split("Per version:")[0].splitlines()
               if ln[:3] in ("| 1", "| 2")]
    assert [int(r[1]) for r in summary] == [1, min(2, os.cpu_count() or 1)]
    assert all(int(r[2]) == 1 and int(r[4]) >= 2 for r in summary)  # 1 version each, batches
