"""`stitch analyze`: how sparse are served-view patches, per step and per tensor group?

Two sources:

* **training** (``stitch analyze MODEL``): N real optimizer steps on fp32 masters (AdamW, or Muon
  for hidden 2-D matrices with AdamW for the rest). A Hugging Face directory trains on a causal-LM
  loss over a small corpus; a bare ``.safetensors`` file (no forward pass possible) trains on a
  synthetic loss, a fresh random projection of the weights each step (Gaussian gradients). After
  each step the masters are projected to the served view (fp8 scales pinned to the previous view),
  diffed against the previous view, and counted per group: changed elements, patch bytes, and the
  push-vs-floor prediction.
* **a board** (``stitch analyze --board B --run R``): the published versions' manifests, split by
  group from the patch headers when the patches are local (a local board, or the fetch cache).

The push-vs-floor rule is a heuristic: an element is predicted to change when its master update
is larger than half a ULP of its served value (in code units times the block scale for fp8).
It ignores where the master sits inside its rounding interval, so it misses the small updates that
happen to cross a nearby boundary; ``expected`` = mean(min(1, |update| / ULP)) is the fraction for
masters placed uniformly in their interval. The measured count is the truth: a served element
changes exactly when its master crossed a rounding boundary (or its fp8 scale moved).

Long on purpose (about 660 lines): an experiment driver (`stitch analyze`), training loop,
measurement and report together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from stitch_core.format.checkpoint import open_checkpoint
from stitch_core.format.patch import diff
from stitch_core.format.stp import PatchReader
from stitch_core.format.views import (
    FP8_DTYPE,
    FP8_MAX,
    View,
    _group_amax,
    expand_scale,
    parse_view,
    project,
    scale_name,
)
from stitch_core.versions.board import LocalBoard, open_board
from stitch_core.versions.manifest import version_dir
from stitch_core.versions.materialize import default_cache_dir

from .publisher import named_tensors

GROUPS = (
    "embed", "attn_q", "attn_k", "attn_v", "attn_o",
    "mlp_gate", "mlp_up", "mlp_down", "norm", "lm_head", "other",
)  # fmt: skip
_PATTERNS = (
    ("embed", ("embed", "wte", "wpe")),
    ("lm_head", ("lm_head",)),
    ("attn_q", ("q_proj",)),
    ("attn_k", ("k_proj",)),
    ("attn_v", ("v_proj",)),
    ("attn_o", ("o_proj", "out_proj")),
    ("mlp_gate", ("gate_proj",)),
    ("mlp_up", ("up_proj",)),
    ("mlp_down", ("down_proj",)),
    ("norm", ("norm", "ln_")),
)
FIELDS = ("total_elements", "changed_elements", "payload_bytes", "predicted", "expected")
RULE = "predicted: |update| > half a ULP of the served value (heuristic)"

CORPUS = """\
Weights change a little at every step of reinforcement learning. The optimizer moves each master
weight by an amount that depends on the learning rate, the gradient and its running moments, and
most of these moves are far smaller than the spacing between neighbouring values of the served
number format. A served weight only changes when its master crosses a rounding boundary.

The river ran low in late summer, and the stones of the old ford showed through the water. Children
crossed it barefoot, carrying their shoes, while the miller watched from the bank and counted the
sacks of grain that still waited for the wheel to turn again after the first autumn rains.

A library keeps its catalogue in many drawers. Each card names a book, its author, the shelf and
the year it arrived. When a book is lent, a slip goes into the card; when it returns, the slip is
removed. Most cards never change from one week to the next; the clerk copies only the few that do.

In the workshop the clock maker opened the case, cleaned each wheel with a soft brush and a drop of
oil, and set the pendulum swinging. The escapement ticked, the hands moved one small step at a time,
and by evening the clock agreed with the bells of the church across the square.
"""


def group_of(name: str) -> str:
    """Tensor group of an HF tensor name (fp8 scales fall into their weight's group)."""
    for group, keys in _PATTERNS:
        if any(k in name for k in keys):
            return group
    return "other"


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each value (float32): eps * 2^(e-1) for |x| in [2^(e-1), 2^e)."""
    fi = torch.finfo(dtype)
    emin = round(math.log2(fi.tiny)) + 1
    _, e = torch.frexp(values.abs())
    e = torch.where(values == 0, emin, e).clamp_min(emin)
    return torch.ldexp(torch.full(values.shape, fi.eps, device=values.device), e - 1)


def predict(
    name: str, old: torch.Tensor, new: torch.Tensor, prev_view: dict[str, torch.Tensor], v: View
) -> dict[str, tuple[int, float]]:
    """Push-vs-floor per served tensor of one master: (predicted count, expected count)."""
    served = prev_view[name]
    delta = (new.float() - old.float()).abs()
    out: dict[str, tuple[int, float]] = {}
    if served.dtype == FP8_DTYPE:
        sname = scale_name(name, v.granularity)
        scale = prev_view[sname]
        delta = delta / expand_scale(scale, served.shape, v)
        amax = _group_amax(new.float().abs(), v)  # a scale moves only when its group would clip
        moved = ~((scale > 0) & scale.isfinite() & (amax / scale <= FP8_MAX))
        out[sname] = (int(moved.sum()), float(moved.sum()))
    u = ulp(served.float(), served.dtype)
    out[name] = (int((delta > u / 2).sum()), float((delta / u).clamp(max=1).sum()))
    return out


def _empty() -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0)


def _fractions(c: dict[str, float]) -> dict[str, float]:
    n = max(c["total_elements"], 1)
    out = {k: (int(v) if k != "expected" else round(v, 3)) for k, v in c.items()}
    out["changed_fraction"] = c["changed_elements"] / n
    if "predicted" in c:
        out["predicted_fraction"] = c["predicted"] / n
        out["expected_fraction"] = c["expected"] / n
    return out


def _finish(groups: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {g: _fractions(groups[g]) for g in GROUPS if g in groups}


# ---------------------------------------------------------------- optimizers


class _Chain:
    """Several optimizers stepped together (Muon for matrices, AdamW for the rest)."""

    def __init__(self, opts: list[torch.optim.Optimizer]):
        self.opts = opts

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def make_optimizer(
    params: dict[str, torch.nn.Parameter],
    kind: str,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    muon_adjust_lr: str = "match_rms_adamw",
) -> _Chain:
    """AdamW on everything, or Muon (momentum = beta1) on hidden 2-D matrices + AdamW elsewhere."""
    adamw = dict(lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adamw":
        return _Chain([torch.optim.AdamW(list(params.values()), **adamw)])
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r} (adamw or muon)")
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"Muon not available in this torch ({torch.__version__})")
    hidden = [
        p for n, p in params.items() if p.dim() == 2 and group_of(n) not in ("embed", "lm_head")
    ]
    ids = {id(p) for p in hidden}
    rest = [p for p in params.values() if id(p) not in ids]
    opts: list[torch.optim.Optimizer] = []
    if hidden:
        opts.append(
            torch.optim.Muon(
                hidden,
                lr=lr,
                momentum=betas[0],
                weight_decay=weight_decay,
                adjust_lr_fn=muon_adjust_lr,
            )
        )
    if rest:
        opts.append(torch.optim.AdamW(rest, **adamw))
    return _Chain(opts)


# ---------------------------------------------------------------- model + loss


def _load(
    path: Path, corpus: str, seq_len: int, batch: int, gen: torch.Generator, device: str
) -> tuple[Callable[[], dict[str, torch.Tensor]], dict, Callable[[], torch.Tensor], dict]:
    """(masters(), trainable params, loss(), description) for an HF dir or a safetensors file."""
    if path.is_dir() and (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)  # masters: fp32 copies
        model.to(device=device, dtype=torch.float32).train()
        vocab = model.config.get_text_config().vocab_size
        ids, tokens = _tokenize(path, corpus, vocab)
        if ids.numel() <= seq_len:
            ids = ids.repeat(seq_len // max(ids.numel(), 1) + 2)

        def loss() -> torch.Tensor:
            starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=gen)
            x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()]).to(device)
            return model(input_ids=x, labels=x).loss

        params = dict(model.named_parameters())
        desc = {"loss": "causal-lm", "tokens": tokens, "corpus_tokens": ids.numel()}
        return lambda: named_tensors(model), params, loss, desc
    ck = open_checkpoint(path)
    tensors = {n: ck.load(n) for n in ck.names()}
    params = {
        n: torch.nn.Parameter(t.to(device, torch.float32))
        for n, t in tensors.items()
        if t.is_floating_point()
    }

    def synthetic() -> torch.Tensor:
        return sum(
            (p * torch.randn(p.shape, generator=gen).to(device)).sum() / math.sqrt(p.numel())
            for p in params.values()
        )

    def masters() -> dict[str, torch.Tensor]:
        return {n: params[n].detach() if n in params else t for n, t in tensors.items()}

    desc = {
        "loss": "synthetic",
        "note": "no forward pass for a bare safetensors file: synthetic "
        "loss = a fresh random projection of the weights per step (Gaussian gradients)",
    }
    return masters, params, synthetic, desc


def _tokenize(path: Path, corpus: str, vocab: int) -> tuple[torch.Tensor, str]:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if any((path / n).is_file() for n in names):
        try:
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(path)(corpus)["input_ids"]
            return torch.tensor(ids, dtype=torch.long) % vocab, "tokenizer"
        except Exception as e:  # a broken or exotic tokenizer: fall back to bytes
            print(f"stitch analyze: tokenizer unusable ({e}); using bytes", file=sys.stderr)
    return torch.tensor(list(corpus.encode()), dtype=torch.long) % vocab, "bytes mod vocab_size"


# ---------------------------------------------------------------- training mode


def _cpu(view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in view.items()}


def analyze_training(
    model: str | Path,
    *,
    optimizer: str = "adamw",
    lr: float = 1e-6,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    view: str = "bf16",
    steps: int = 10,
    corpus: str | None = None,
    seq_len: int = 64,
    batch: int = 4,
    seed: int = 0,
    device: str = "cpu",
    muon_adjust_lr: str = "match_rms_adamw",
    on_step: Callable[[int, dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None,
) -> dict:
    """Run `steps` optimizer steps and measure each step's served-view patch.

    `on_step(step, old_masters, new_masters)` sees fp32 copies of the masters around each step.
    """
    v = parse_view(view)
    if min(steps, seq_len, batch) < 1:
        raise ValueError("--steps, --seq-len and --batch must be at least 1")
    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):  # before loading the model
        raise ValueError(f"Muon not available in this torch ({torch.__version__})")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    masters, params, loss_fn, desc = _load(
        Path(model), corpus or CORPUS, seq_len, batch, gen, device
    )
    opt = make_optimizer(params, optimizer, lr, betas, weight_decay, muon_adjust_lr)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in masters().items()}

    old = snapshot()
    prev_view = project(old, v)
    rows = []
    for step in range(1, steps + 1):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = snapshot()
        with torch.no_grad():
            view_new = project(new, v, previous=prev_view)
            guess: dict[str, tuple[int, float]] = {}
            for n, t in new.items():
                if t.is_floating_point():
                    guess.update(predict(n, old[n], t, prev_view, v))
        patch = diff(_cpu(prev_view), _cpu(view_new), view=v.name)
        groups: dict[str, dict[str, float]] = {}
        for e in patch.header.tensors:
            c = groups.setdefault(group_of(e.name), _empty())
            p, x = guess.get(e.name, (0, 0.0))
            for k, val in zip(FIELDS, (e.numel, e.changed, e.nbytes, p, x), strict=True):
                c[k] += val
        total = _empty()
        for c in groups.values():
            for k in FIELDS:
                total[k] += c[k]
        rows.append(
            {
                "step": step,
                "loss": round(loss.item(), 5),
                "patch_bytes": len(patch.data),
                **_fractions(total),
                "groups": _finish(groups),
            }
        )
        if on_step is not None:
            on_step(step, old, new)
        old, prev_view = new, view_new
    return {
        "mode": "train",
        "model": str(model),
        "optimizer": optimizer,
        "lr": lr,
        "betas": list(betas),
        "weight_decay": weight_decay,
        **({"muon_adjust_lr": muon_adjust_lr} if optimizer == "muon" else {}),
        "view": v.name,
        "seq_len": seq_len,
        "batch": batch,
        "seed": seed,
        "device": device,
        **desc,
        "rule": RULE,
        "steps": rows,
        "summary": _summary(rows),
    }


def _summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per group (and `total`), fractions over all measured steps together."""
    acc: dict[str, dict[str, float]] = {}
    for r in rows:
        for g, c in (r.get("groups") or {}).items():
            for name in (g, "total"):
                a = acc.setdefault(name, {k: 0 for k in FIELDS if k in c})
                for k in a:
                    a[k] += c[k]
    n = sum(1 for r in rows if r.get("groups") is not None)
    out = {}
    for g, a in acc.items():
        f = _fractions(a)
        f["payload_bytes_per_step"] = a["payload_bytes"] / max(n, 1)
        f["total_elements"] = a["total_elements"] // max(n, 1)
        out[g] = f
    return out


# ---------------------------------------------------------------- board mode


async def _board_rows(url: str, run: str, cache: Path, fetch: bool) -> list[dict]:
    from stitch_core.versions.store import fetch_patch, list_manifests

    rows = []
    async with open_board(url) as board:
        for m in await list_manifests(board, run):
            row = {
                "version": m.version,
                "step": m.step,
                "kind": m.kind,
                "parent": m.parent,
                "changed_elements": m.changed_elements,
                "total_elements": m.total_elements,
                "patch_bytes": m.patch_bytes or None,
                "groups": None,
            }
            if m.changed_elements is not None:
                row["changed_fraction"] = m.changed_elements / max(m.total_elements, 1)
            if m.patches:
                if isinstance(board, LocalBoard):
                    paths = [board.root / version_dir(run, m.version) / r.path for r in m.patches]
                else:
                    paths = [cache / run / f"{m.version:06d}" / r.path for r in m.patches]
                if fetch and not all(p.is_file() for p in paths):
                    paths = await fetch_patch(board, m, cache)
                if all(p.is_file() for p in paths):
                    row["groups"] = _patch_groups(m, paths)
            rows.append(row)
    return rows


def _patch_groups(m, paths: list[Path]) -> dict[str, dict[str, float]]:
    groups: dict[str, dict[str, float]] = {}
    for t in m.tensors:
        c = groups.setdefault(
            group_of(t.name), {"total_elements": 0, "changed_elements": 0, "payload_bytes": 0}
        )
        c["total_elements"] += math.prod(t.shape)
    for p in paths:  # parts of a sharded patch each hold their slices' changes
        with PatchReader(p) as r:
            for e in r.header.tensors:
                c = groups[group_of(e.name)]
                c["changed_elements"] += e.changed
                c["payload_bytes"] += e.nbytes
    return _finish(groups)


def analyze_board(url: str, run: str, *, cache: Path | None = None, fetch: bool = False) -> dict:
    """Per published version: manifest totals, plus a per-group split where patches are local."""

    cache = cache or default_cache_dir()
    rows = asyncio.run(_board_rows(url, run, cache, fetch))
    note = None
    if any(r["groups"] is None and r["patch_bytes"] for r in rows):
        note = "some patches are not local: totals only for those (--fetch downloads them)"
    return {
        "mode": "board",
        "board": url,
        "run": run,
        "steps": rows,
        "summary": _summary(rows),
        **({"note": note} if note else {}),
    }


# ---------------------------------------------------------------- output


def plot(report: dict, path: str | Path) -> None:
    """PNG of the changed fraction (%) per step (versions on a board) by tensor group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xkey = "step" if report["mode"] == "train" else "version"
    rows = [r for r in report["steps"] if r.get("changed_fraction") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g in GROUPS:
        pts = [
            (r[xkey], 100 * r["groups"][g]["changed_fraction"])
            for r in rows
            if r.get("groups") and g in r["groups"]
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=g)
    ax.plot(
        [r[xkey] for r in rows],
        [100 * r["changed_fraction"] for r in rows],
        "k-",
        linewidth=2.5,
        label="total",
    )
    if report["mode"] == "train":
        ax.plot(
            [r[xkey] for r in rows],
            [100 * r["predicted_fraction"] for r in rows],
            "k--",
            label="total predicted",
        )
        title = (
            f"{report['optimizer']} lr={report['lr']:g}, view {report['view']}, "
            f"{report['loss']} loss"
        )
    else:
        title = f"board run {report['run']}"
    ax.set(xlabel=xkey, ylabel="served elements changed (%)", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            f" {'patch bytes':>12}",
            file=out,
        )
        for r in report["steps"]:
            print(
                f"{r['step']:>5} {r['loss']:>9.4f} {_pct(r['changed_fraction']):>10} "
                f"{_pct(r['predicted_fraction']):>12} {_pct(r['expected_fraction']):>11} "
                f"{r['patch_bytes']:>12,}",
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
        + (f" {'predicted %':>12} {'expected %':>11}" if train else "")
        + f" {'bytes/step':>11}",
        file=out,
    )
    for g in [*GROUPS, "total"]:
        if g not in s:
            continue
        c = s[g]
        line = f"{g:<9} {c['total_elements']:>10,} {_pct(c['changed_fraction']):>10}"
        if train:
            line += f" {_pct(c['predicted_fraction']):>12} {_pct(c['expected_fraction']):>11}"
        print(line + f" {c['payload_bytes_per_step']:>11,.0f}", file=out)
    if train:
        print(
            f"\n{RULE}; expected: mean(min(1, |update|/ULP)); changed: measured (exact "
            "rounding-boundary crossings). bytes/step: chunk payload, without the header.",
            file=out,
        )
    if "note" in report:
        print(f"note: {report['note']}", file=out)


# ---------------------------------------------------------------- CLI


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
    p.add_argument("--view", default="bf16", help="bf16 | fp16 | fp8-e4m3-{tensor,channel,block}")
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
