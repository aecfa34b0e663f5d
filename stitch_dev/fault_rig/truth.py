"""The trainer's versions of the fault rig: the toy model's views after k AdamW steps, and
``Truth``, what each published version must be (from those views, never from the board)."""

from __future__ import annotations

import torch

from stitch_core.format import fingerprint as fpr

from ..toy_engine import HFToy, ToyEngine, served_view, train

RUN = "faults"
N_VIEWS = 48


def make_views(n: int) -> list[dict[str, torch.Tensor]]:
    """The toy model's bf16 served view before training and after each of n - 1 AdamW steps."""
    torch.manual_seed(0)
    model = HFToy()
    views = [served_view(model)]
    for m in train(model, n - 1):
        views.append(served_view(m))
    return views


def engines_for(view: dict[str, torch.Tensor]) -> list[ToyEngine]:
    engines = [ToyEngine(r, 2) for r in range(2)]
    for e in engines:
        e.load_weights(iter(view.items()))
    return engines


def same_bits(a: list[ToyEngine], b: list[ToyEngine]) -> bool:
    for x, y in zip(a, b, strict=True):
        px, py = dict(x.named_parameters()), dict(y.named_parameters())
        if px.keys() != py.keys() or not all(
                torch.equal(px[k].data.view(torch.uint8), py[k].data.view(torch.uint8))
                for k in px):
            return False
    return True


class Truth:
    """What each published version must be, from the trainer's views (never from the board)."""

    def __init__(self, views: list[dict[str, torch.Tensor]]):
        self.views = views
        self.view_of: dict[int, int] = {}  # version -> index into views
        self._fps: dict[int, dict[str, int]] = {}
        self._engines: dict[int, list[ToyEngine]] = {}

    def published(self, version: int, index: int) -> None:
        self.view_of[version] = index

    def fps(self, v: int) -> dict[str, int] | None:
        if v not in self.view_of:
            return None
        if v not in self._fps:
            self._fps[v] = fpr.state_fingerprints(self.views[self.view_of[v]])
        return self._fps[v]

    def engines(self, v: int) -> list[ToyEngine]:
        if v not in self._engines:
            self._engines[v] = engines_for(self.views[self.view_of[v]])
        return self._engines[v]
