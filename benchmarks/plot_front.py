"""The README's figure: bytes per version, Stitch vs a full checkpoint and the usual deltas.

Reads the numbers that `benchmarks/codec.py` measured and recorded in
benchmarks/results/codec.md (the "Patch size" table: a 22.48M-parameter Llama-shaped model,
AdamW, 20 measured steps per learning rate) and plots, for the bf16 served view, the mean bytes
per version (each column's total over the run / the number of steps):

* full checkpoint: every served element, 2 bytes each in bf16 (the parameter count times 2);
* Stitch: the whole `.stp` file, header included ("ours total");
* XOR+zstd and COO+zstd, the baselines of the same run.

Nothing is measured here: re-run codec.py to change the numbers, then this script.

    /work/main/.venv/bin/python benchmarks/plot_front.py   # writes docs/img/bytes_per_version.png
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "results" / "codec.md"
OUT = ROOT / "docs" / "img" / "bytes_per_version.png"
BYTES_PER_ELEMENT = {"bf16": 2}


def read_codec(path: Path) -> tuple[float, int, list[dict[str, str]]]:
    """(parameters, measured steps per lr, rows of the patch-size table) from codec.md."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r"Model: ([\d.]+)M params", text)
    s = re.search(r"then (\d+) measured steps per lr", text)
    if not m or not s:
        raise SystemExit(f"{path}: no 'Model: ...M params' / '... measured steps per lr' line")
    table: list[str] = []
    for ln in text.split("### Patch size", 1)[1].splitlines()[1:]:
        if ln.startswith("|"):
            table.append(ln)
        elif table:  # the first table under the heading ends here
            break
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
            for ln in table[2:]]
    return float(m.group(1)) * 1e6, int(s.group(1)), rows


def mb(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"MB": 1.0, "kB": 1e-3}[unit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--view", default="bf16", choices=sorted(BYTES_PER_ELEMENT))
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params, steps, rows = read_codec(args.source)
    rows = [r for r in rows if r["view"] == args.view]
    full = params * BYTES_PER_ELEMENT[args.view] / 1e6
    series = [(f"full {args.view} checkpoint", None, "#9e9e9e"),
              ("COO+zstd", "COO+zstd", "#e0a458"), ("XOR+zstd", "XOR+zstd", "#c97b63"),
              ("Stitch", "ours total", "#2a6fdb")]
    lrs = [r["lr"] for r in rows]
    width = 0.2
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    for i, (label, col, color) in enumerate(series):
        ys = [full if col is None else mb(r[col]) / steps for r in rows]
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, ys, width, label=label, color=color)
        for x, y in zip(xs, ys, strict=True):
            text = f"{y:.1f}" if y >= 10 else f"{y:.2f}"
            if col == "ours total":
                text += f"\n({100 * y / full:.1f}%)"
            ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(0.1, full * 4)
    ax.set_xticks(range(len(rows)), [f"AdamW lr {lr}" for lr in lrs])
    ax.set_ylabel("MB per version (log)")
    ax.set_title(f"Bytes per version, {args.view} served view, {params / 1e6:.2f}M params "
                 f"(mean of {steps} steps)", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper left", frameon=False)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.text(0.01, 0.01, f"data: {args.source.relative_to(ROOT)} (benchmarks/codec.py)",
             fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
