"""Training mode of `stitch analyze`: N optimizer steps on fp32 masters, each step's served-view
patch measured per tensor group (changed elements, patch bytes) next to the push-vs-floor estimate.

A Hugging Face directory trains on a causal-LM loss over a small corpus; a bare ``.safetensors``
file (no forward pass possible) trains on a synthetic loss, a fresh random projection of the
weights each step (Gaussian gradients). AdamW, or Muon for hidden 2-D matrices with AdamW for the
rest. After each step the masters are projected to the served view (fp8 scales pinned to the
previous view) and diffed against the previous view.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from stitch_core.format.checkpoint import open_checkpoint
from stitch_core.format.patch import diff
from stitch_core.format.views import parse_view, project

from ..publisher import named_tensors
from .estimate import RULE, predict, predict_offsets
from .groups import FIELDS, empty_counts, fractions, group_fractions, group_of, summary

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
            guess_o: dict[str, float] = {}
            for n, t in new.items():
                if t.is_floating_point():
                    guess.update(predict(n, old[n], t, prev_view, v))
                    guess_o.update(predict_offsets(n, old[n], t, prev_view, v))
        patch = diff(_cpu(prev_view), _cpu(view_new), view=v.name)
        groups: dict[str, dict[str, float]] = {}
        offs: dict[str, float] = {}
        for e in patch.header.tensors:
            c = groups.setdefault(group_of(e.name), empty_counts())
            offs[group_of(e.name)] = offs.get(group_of(e.name), 0.0) + guess_o.get(e.name, 0.0)
            p, x = guess.get(e.name, (0, 0.0))
            for k, val in zip(FIELDS, (e.numel, e.changed, e.nbytes, p, x), strict=True):
                c[k] += val
        total = empty_counts()
        for c in groups.values():
            for k in FIELDS:
                total[k] += c[k]
        rows.append(
            {
                "step": step,
                "loss": round(loss.item(), 5),
                "patch_bytes": len(patch.data),
                **_offsets(fractions(total), sum(offs.values())),
                "groups": {g: _offsets(f, offs[g]) for g, f in group_fractions(groups).items()},
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
        "summary": _summary_offsets(rows, summary(rows)),
    }


def _offsets(row: dict, count: float) -> dict:
    """A report row with the offset-aware estimate (`estimate.predict_offsets`) added."""
    row["expected_offsets"] = round(count, 3)
    row["expected_offsets_fraction"] = count / max(row["total_elements"], 1)
    return row


def _summary_offsets(rows: list[dict], summ: dict) -> dict:
    """`groups.summary` plus each group's `expected_offsets_fraction` over all steps."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        for g, c in r["groups"].items():
            for name in (g, "total"):
                a = acc.setdefault(name, [0.0, 0])
                a[0] += c["expected_offsets"]
                a[1] += c["total_elements"]
    for g, (count, n) in acc.items():
        summ[g]["expected_offsets_fraction"] = count / max(n, 1)
    return summ
