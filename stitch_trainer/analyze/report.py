"""An analyze report as text tables."""

from __future__ import annotations

import sys

from .estimate import RULE
from .groups import GROUPS


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.4f}"


def print_table(report: dict, out=None) -> None:
    """Print an analyze report as text tables to `out` (default stdout)."""
    out = out or sys.stdout
    train = report["mode"] == "train"
    if train:
        print(
            f"{report['model']}: {report['optimizer']} lr={report['lr']:g} "
            f"betas={tuple(report['betas'])} wd={report['weight_decay']:g}, view {report['view']}"
            f", {report['loss']} loss"
            + (f" ({report['tokens']} tokens)" if report["loss"] == "causal-lm" else ""),
            file=out,
        )
        if "note" in report:
            print(f"note: {report['note']}", file=out)
        print(
            f"{'step':>5} {'loss':>9} {'changed %':>10} {'predicted %':>12} {'expected %':>11}"
            f" {'offsets %':>10} {'patch bytes':>12}",
            file=out,
        )
        for r in report["steps"]:
            print(
                f"{r['step']:>5} {r['loss']:>9.4f} {_pct(r['changed_fraction']):>10} "
                f"{_pct(r['predicted_fraction']):>12} {_pct(r['expected_fraction']):>11} "
                f"{_pct(r.get('expected_offsets_fraction')):>10} {r['patch_bytes']:>12,}",
                file=out,
            )
    else:
        print(f"board {report['board']} run {report['run']}", file=out)
        print(
            f"{'version':>7} {'step':>6} {'kind':<8} {'changed %':>10} {'patch bytes':>12}",
            file=out,
        )
        for r in report["steps"]:
            step = "" if r["step"] is None else r["step"]
            print(
                f"{r['version']:>7} {step:>6} {r['kind']:<8} "
                f"{_pct(r.get('changed_fraction')):>10} {r['patch_bytes'] or '':>12}",
                file=out,
            )
    s = report["summary"]
    if not s:
        print(f"(no per-group split: {report.get('note', 'no patches')})", file=out)
        return
    n = sum(1 for r in report["steps"] if r.get("groups") is not None)
    print(f"\nper group, over {n} {'steps' if train else 'patches'}:", file=out)
    head = f"{'group':<9} {'elements':>10} {'changed %':>10}"
    print(
        head
        + (f" {'predicted %':>12} {'expected %':>11} {'offsets %':>10}" if train else "")
        + f" {'bytes/step':>11}",
        file=out,
    )
    for g in [*GROUPS, "total"]:
        if g not in s:
            continue
        c = s[g]
        line = f"{g:<9} {c['total_elements']:>10,} {_pct(c['changed_fraction']):>10}"
        if train:
            line += (f" {_pct(c['predicted_fraction']):>12} {_pct(c['expected_fraction']):>11}"
                     f" {_pct(c.get('expected_offsets_fraction')):>10}")
        print(line + f" {c['payload_bytes_per_step']:>11,.0f}", file=out)
    if train:
        print(
            f"\n{RULE}; expected: mean(min(1, |update|/ULP)) (masters uniform in their "
            "rounding interval); offsets: from the masters' measured offsets in their interval "
            "(per-tensor histogram, signed along the update); changed: measured (exact "
            "rounding-boundary crossings). bytes/step: chunk payload, without the header.",
            file=out,
        )
    if "note" in report:
        print(f"note: {report['note']}", file=out)
