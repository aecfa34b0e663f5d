"""stitch_core.engine.layout_load: the row/column-id loads learn the map the full index does, in
a rank's own memory; a loader the expanded views do not suit falls back to the full index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stitch_core.engine import layout as L
from stitch_core.engine import layout_load as LL

from .test_layout import SHAPES, Engine, same_map

E, I, H, V = 3, 8, 4, 64  # experts, expert rows, hidden, vocab
TP = 4


class Mixed(torch.nn.Module):
    """TP rank `rank` of TP: a row-sharded embedding with two zeroed padding rows,
    3-D stacked experts sharded on their middle dim and stored transposed (E, H, I/TP), a 0-D
    scale written into a slot of a 1-D param, an unsharded norm written twice."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.vpad = V // TP + 2  # this rank's rows, two of padding
        self.embed = torch.nn.Parameter(torch.zeros(self.vpad, H))
        self.experts_t = torch.nn.Parameter(torch.zeros(E, H, I // TP))
        self.scales = torch.nn.Parameter(torch.zeros(3))
        self.norm2 = torch.nn.Parameter(torch.zeros(2, H))

    def load_weights(self, weights):
        r, rows = self.rank, V // TP
        for name, w in weights:
            if name == "embed.weight":
                self.embed.data[:rows].copy_(w[r * rows:(r + 1) * rows])
                self.embed.data[rows:].fill_(0)
            elif name == "experts.weight":
                part = w.narrow(1, r * (I // TP), I // TP)
                self.experts_t.data.copy_(part.transpose(1, 2))
            elif name == "scale":
                self.scales.data[1] = w
            elif name == "norm.weight":
                self.norm2.data[0].copy_(w)
                self.norm2.data[1].copy_(w)
        return {"embed", "experts_t", "scales", "norm2"}


MIXED = {"embed.weight": (V, H), "experts.weight": (E, I, H), "scale": (), "norm.weight": (H,)}


def _mixed(rank: int, w: dict[str, torch.Tensor]) -> Mixed:
    m = Mixed(rank).to(torch.bfloat16)
    m.load_weights(w.items())
    return m


def _weights(shapes, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _places_every_element(lay: L.Layout, eng: torch.nn.Module, w: dict) -> None:
    params = dict(eng.named_parameters())
    for name, tm in lay.tensors.items():
        flat = w[name].reshape(-1)
        for seg in tm.segments:
            ok, where = seg.locate(torch.arange(flat.numel()))
            assert torch.equal(params[seg.param].data.reshape(-1)[where], flat[ok]), name


@pytest.mark.parametrize("rank", range(TP))
def test_split_and_full_index_learn_the_same_map(rank):
    w = _weights(MIXED)
    shapes = {n: (s, torch.bfloat16) for n, s in MIXED.items()}
    split = L.learn_layout(_mixed(rank, w), shapes, split_index=True)
    full = L.learn_layout(_mixed(rank, w), shapes, split_index=False)
    assert split.full_index_groups == [] and full.full_index_groups == ["rest"]
    same_map(split, full)
    eng = _mixed(rank, w)
    _places_every_element(split, eng, w)
    assert split.param_const["embed"] == (eng.vpad - V // TP) * H
    assert split.summary()["hf_mapped"] == {"embed.weight": V // TP * H,
                                            "experts.weight": E * I * H // TP,
                                            "scale": 1, "norm.weight": 2 * H}
    # by default a rank holding a shard learns split, in less memory than the full index
    auto = L.learn_layout(_mixed(rank, w), shapes)
    assert auto.full_index_groups == []
    assert auto.learn_bytes < full.learn_bytes
    shadow = sum(p.numel() for p in eng.parameters()) * 4  # int32
    assert auto.learn_bytes == 2 * shadow
    hf = sum(int(np.prod(s)) for s in MIXED.values()) * 4
    assert full.learn_bytes == shadow + hf


@pytest.mark.parametrize("rank", [0, 1])
def test_the_test_engines_learn_the_same_map_both_ways(rank):
    """The loaders of test_layout's engine (fused, sliced, duplicated, padded, transposed)."""
    w = _weights(SHAPES)
    shapes = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    eng = Engine(rank).to(torch.bfloat16)
    eng.load_weights(w.items())
    split = L.learn_layout(eng, shapes, split_index=True)
    same_map(split, L.learn_layout(eng, shapes, split_index=False))
    _places_every_element(split, eng, w)


def test_a_rank_holding_its_whole_group_learns_with_the_full_index():
    """TP=1: two shadows would hold as much as the full index and one shadow; one load is
    faster."""
    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.zeros(V, H))

        def load_weights(self, weights):
            for _, w in weights:
                self.embed.data.copy_(w)

    shapes = {"embed.weight": ((V, H), torch.bfloat16)}
    lay = L.learn_layout(Whole(), shapes)
    assert lay.full_index_groups == ["rest"] and lay.learn_bytes == 2 * V * H * 4
    same_map(lay, L.learn_layout(Whole(), shapes, split_index=True))


def test_a_loader_that_views_its_input_falls_back_to_the_full_index(caplog):
    class Viewing(Mixed):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "embed.weight":  # .view(-1) of an expanded view raises
                    flat = w.view(-1)
                    rows = V // TP
                    self.embed.data[:rows].view(-1).copy_(
                        flat[self.rank * rows * H:(self.rank + 1) * rows * H])
                    self.embed.data[rows:].fill_(0)
            return None

    w = _weights(MIXED)
    shapes = {"embed.weight": ((V, H), torch.bfloat16)}
    eng = Viewing(2).to(torch.bfloat16)
    eng.load_weights(w.items())
    with caplog.at_level("WARNING", logger="stitch.layout"):
        lay = L.learn_layout(eng, shapes)
    assert lay.full_index_groups == ["rest"]
    assert "split index load failed" in caplog.text
    same_map(lay, L.learn_layout(eng, shapes, split_index=False))
    _places_every_element(lay, eng, {"embed.weight": w["embed.weight"]})


def test_a_loader_that_loads_on_its_first_call_only_falls_back_to_the_full_index(caplog):
    """The second (column) load writes nothing: the two loads disagree on every element, so the
    group is learned from the full index, in one load, and the map is right."""
    class Once(Mixed):
        def __init__(self, rank: int):
            super().__init__(rank)
            self.calls = 0

        def load_weights(self, weights):
            self.calls += 1
            if self.calls == 2:  # the group's second (column) load: nothing written
                for _ in weights:
                    pass
                return None
            return super().load_weights(weights)

    w = _weights(MIXED)
    shapes = {n: (s, torch.bfloat16) for n, s in MIXED.items()}
    eng = _mixed(1, w)
    with caplog.at_level("WARNING", logger="stitch.layout"):
        lay = L.learn_layout(Once(1).to(torch.bfloat16), shapes)
    assert lay.full_index_groups == ["rest"]
    assert "row and column ids disagree" in caplog.text
    same_map(lay, L.learn_layout(eng, shapes, split_index=False))


@pytest.mark.parametrize("split", [True, False])
def test_a_loader_that_computes_with_the_values_is_refused_either_way(split):
    class Scaling(Mixed):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "embed.weight":
                    self.embed.data[:V // TP].copy_(w[:V // TP] * 1000)
            return None

    with pytest.raises(RuntimeError, match="hold values no index tensor"):
        L.learn_layout(Scaling(0), {"embed.weight": ((V, H), torch.bfloat16)},
                       split_index=split)


def test_combine_ids_marks_disagreeing_pairs_foreign():
    """Rows and columns naming different tensors, one side untouched or constant, ids past
    the group: foreign (bases[-1]); both untouched / both constant stay -1 / 0; a long run of one
    tensor (the block path) and a tensor boundary inside a block."""
    shapes = [(3, 50), (100,), (2, 40)]
    rc = [(3, 50), (1, 100), (2, 40)]
    row0 = LL.starts([r for r, _ in rc])
    col0 = LL.starts([c for _, c in rc])
    cols = np.array([c for _, c in rc], dtype=np.int64)
    bases = LL.starts([int(np.prod(s)) for s in shapes])
    a, b, want = [], [], []
    for t, (r, c) in enumerate(rc):  # every element of every tensor, in order
        for i in range(r):
            for j in range(c):
                a.append(row0[t] + i)
                b.append(col0[t] + j)
                want.append(bases[t] + i * c + j)
    foreign = int(bases[-1])
    odd = [(-1, -1, -1), (0, 0, 0), (-1, 0, foreign), (0, int(col0[0]), foreign),
           (int(row0[0]), int(col0[1]), foreign), (int(row0[-1]), int(col0[0]), foreign),
           (int(row0[0]), int(col0[-1]), foreign)]
    a += [x for x, _, _ in odd]
    b += [y for _, y, _ in odd]
    want += [z for _, _, z in odd]
    a32, b32 = np.array(a, np.int32), np.array(b, np.int32)
    out = a32.copy()
    n_foreign = LL.combine_ids(out, b32, row0, col0, cols, bases, out)
    assert out.tolist() == want
    assert n_foreign == sum(z == foreign for _, _, z in odd) == 5
