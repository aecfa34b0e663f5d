"""`stitch analyze`: the verb's parser and command (the ``stitch.cli`` entry point)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .board import analyze_board
from .experiment import analyze_training
from .plots import plot
from .report import print_table


def _betas(s: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"betas must be 'b1,b2', got {s!r}") from None
    return b1, b2


def cmd_analyze(a: argparse.Namespace) -> int:
    """`stitch analyze`: patch sparsity from training steps or a board; returns the exit status."""
    if (a.model is None) == (a.board is None):
        raise ValueError("give either MODEL or --board BOARD --run R")
    if a.board is not None:
        if not a.run:
            raise ValueError("--board needs --run")
        cache = Path(a.cache_dir) if a.cache_dir else None
        report = analyze_board(a.board, a.run, cache=cache, fetch=a.fetch)
    else:
        corpus = Path(a.corpus).read_text() if a.corpus else None
        report = analyze_training(
            a.model,
            optimizer=a.optimizer,
            lr=a.lr,
            betas=a.betas,
            weight_decay=a.weight_decay,
            view=a.view,
            steps=a.steps,
            corpus=corpus,
            seq_len=a.seq_len,
            batch=a.batch,
            seed=a.seed,
            muon_adjust_lr=a.muon_adjust_lr,
            device=a.device,
        )
    if a.plot:
        plot(report, a.plot)
    if a.json:
        print(json.dumps(report))
    else:
        print_table(report)
        if a.plot:
            print(f"wrote {a.plot}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `stitch analyze` to the CLI's subparsers."""
    p = sub.add_parser(
        "analyze",
        help="measure served-view patch sparsity per step and tensor group",
        description="Train N steps on a model (or read a board's versions) and report, per step "
        "and tensor group, the fraction of served elements that changed, the patch bytes, and "
        "the push-vs-floor prediction (|update| > half a ULP of the served value).",
    )
    p.add_argument("model", nargs="?", help="HF directory or .safetensors file (fp32 masters)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: Muon on hidden 2-D matrices (momentum=beta1), AdamW on the rest",
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--betas", type=_betas, default=(0.9, 0.999), help="b1,b2 (default 0.9,0.999)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--muon-adjust-lr",
        choices=("match_rms_adamw", "original"),
        default="match_rms_adamw",
        help="Muon lr scaling (torch.optim.Muon)",
    )
    p.add_argument("--view", default="bf16",
                   help="bf16 | fp16 | fp8-e4m3-{tensor,channel,block} | mxfp4 | nvfp4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--corpus", help="text file (default: a few built-in paragraphs)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to train (e.g. cuda); diffs run on CPU")
    p.add_argument("--board", help="read published versions from this board instead")
    p.add_argument("--run", help="run name on the board")
    p.add_argument("--cache-dir", help="fetch cache holding patches of a remote board")
    p.add_argument("--fetch", action="store_true", help="download missing patches to the cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="plot changed %% per step by group")
    p.set_defaults(fn=cmd_analyze)
