"""stitch_core.engine.layout on a small engine-style module whose loaders fuse, slice, pad,
duplicate and
transpose: the learned map must send every HF element exactly where the loaders put it."""

from __future__ import annotations

import pytest
import torch

from stitch_core.engine import layout as L
from stitch_core.engine import model_state as MS

H, V, VPAD = 6, 10, 12  # hidden, vocab, padded vocab rows


class Engine(torch.nn.Module):
    """TP rank `rank` of 2: q/k fused into one param (rows sliced per rank), o_proj column-sliced
    (one run per row), a norm written twice into one param (replicated halves), an embedding with
    zeroed padding rows, and an lm_head stored transposed (one element per run)."""

    def __init__(self, rank: int = 0):
        super().__init__()
        self.rank = rank
        self.qk = torch.nn.Parameter(torch.zeros(2 * H // 2, H))  # q rows of this rank + k rows
        self.o = torch.nn.Parameter(torch.zeros(H, H // 2))
        self.norm2 = torch.nn.Parameter(torch.zeros(2 * H))
        self.embed = torch.nn.Parameter(torch.zeros(VPAD, H))
        self.head_t = torch.nn.Parameter(torch.zeros(H, V))

    def load_weights(self, weights):
        half = H // 2
        r = self.rank
        for name, w in weights:
            if name == "q.weight":
                self.qk.data[:half].copy_(w[r * half:(r + 1) * half])
            elif name == "k.weight":
                self.qk.data[half:].copy_(w[r * half:(r + 1) * half])
            elif name == "o.weight":
                self.o.data.copy_(w[:, r * half:(r + 1) * half])
            elif name == "norm.weight":
                self.norm2.data[:H].copy_(w)
                self.norm2.data[H:].copy_(w)
            elif name == "embed.weight":
                self.embed.data[:V].copy_(w)
                self.embed.data[V:].fill_(0)
            elif name == "head.weight":
                self.head_t.data.copy_(w.t())
        return None


SHAPES = {"q.weight": (H, H), "k.weight": (H, H), "o.weight": (H, H), "norm.weight": (H,),
          "embed.weight": (V, H), "head.weight": (V, H)}


def _hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def _engine(rank: int, w: dict[str, torch.Tensor]) -> Engine:
    e = Engine(rank).to(torch.bfloat16)
    e.load_weights(w.items())
    return e


def same_map(a: L.Layout, b: L.Layout) -> None:
    """Two layouts are the same map: counts, summary and every run of every segment."""
    assert a.param_const == b.param_const and a.param_unwritten == b.param_unwritten
    assert a.summary() == b.summary()
    for name, tm in a.tensors.items():
        other = b.tensors[name].segments
        assert len(tm.segments) == len(other), name
        for x, y in zip(tm.segments, other, strict=True):
            assert x.param == y.param
            for f in ("hf_start", "eng_start", "length"):
                assert (getattr(x, f) == getattr(y, f)).all(), (name, f)


@pytest.mark.parametrize("rank", [0, 1])
def test_learned_map_places_every_element_where_the_loaders_do(rank):
    w = _hf_weights()
    eng = _engine(rank, w)
    lay = L.learn_layout(eng, {n: (s, torch.bfloat16) for n, s in SHAPES.items()})
    params = dict(eng.named_parameters())
    for name, tm in lay.tensors.items():
        flat = w[name].reshape(-1)
        for seg in tm.segments:
            pos = torch.arange(flat.numel())
            ok, where = seg.locate(pos)
            assert torch.equal(params[seg.param].data.reshape(-1)[where], flat[ok]), name
            # segments hold disjoint, sorted HF ranges
            assert (seg.hf_start[1:] >= seg.hf_start[:-1] + seg.length[:-1]).all()
    mapped = lay.summary()["hf_mapped"]
    half = H * H // 2
    assert mapped == {"q.weight": half, "k.weight": half, "o.weight": half,
                      "norm.weight": 2 * H, "embed.weight": V * H, "head.weight": V * H}
    assert [len(s.length) for s in lay.tensors["o.weight"].segments] == [H]  # a run per row
    assert len(lay.tensors["norm.weight"].segments) == 2  # one Segment per copy
    assert lay.param_const["embed"] == (VPAD - V) * H
    assert all(n == 0 for n in lay.param_unwritten.values())
    # the engine's own weights are back after learning
    assert torch.equal(eng.embed.data[:V], w["embed.weight"])


def test_int64_indices_learn_the_same_map(monkeypatch):
    """Groups whose indices pass 2^31 learn with int64 shadows: same map as the int32 path."""
    w = _hf_weights()
    shapes = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    narrow = L.learn_layout(_engine(1, w), shapes)
    monkeypatch.setattr(L, "INT32_INDEX_MAX", 0)
    same_map(narrow, L.learn_layout(_engine(1, w), shapes))


def test_apply_through_the_map_equals_loading_the_new_weights():
    """Writes through the map (the replica's one write path) equal loading the new weights."""
    from stitch_core.engine.replica import RankReplica

    w = _hf_weights(0)
    eng = _engine(1, w)
    rep = RankReplica(eng)
    rep.setup({n: (s, "BF16") for n, s in SHAPES.items()})
    new = {n: t.clone() for n, t in w.items()}
    values = {}
    g = torch.Generator().manual_seed(1)
    for n, t in new.items():
        pos = torch.unique(torch.randint(0, t.numel(), (7,), generator=g))
        t.view(-1)[pos] = (t.view(-1)[pos].float() * 2 + 1).to(torch.bfloat16)
        values[n] = (pos, t.view(-1)[pos])
    out = rep.put(values)
    assert out["written"] > 0  # (a TP shard: only the positions this rank holds)
    want = _engine(1, new)
    for (n, p), (_, q) in zip(eng.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(p.data.view(torch.int16), q.data.view(torch.int16)), n


def test_a_loader_that_computes_with_the_values_is_refused():
    class Scaling(Engine):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "embed.weight":
                    self.embed.data[:V].copy_(w * 3)  # values no index tensor carries
            return None

    with pytest.raises(RuntimeError, match="hold values no index tensor"):
        L.learn_layout(Scaling(), {"embed.weight": ((V, H), torch.bfloat16)})


@pytest.mark.parametrize("how", ["rebind", "in_place", "raise"])
def test_a_loader_that_derives_state_from_the_values_is_refused(how):
    """A post-load step run inside load_weights (SGLang's MLA models compute their absorbed
    matrices there) would now derive state from index tensors: refused by name."""
    class Deriving(Engine):
        def __init__(self):
            super().__init__()
            self.register_buffer("norm_sum", torch.zeros(()))
            self.head_cache = torch.zeros(V, H)  # a plain tensor attribute

        def load_weights(self, weights):
            weights = list(weights)
            super().load_weights(weights)
            for name, w in weights:
                if name == "head.weight" and how == "rebind":
                    self.head_cache = w.float() * 2
                elif name == "norm.weight" and how in ("in_place", "raise"):
                    self.norm_sum.add_(w.float().sum())
            if how == "raise":  # a post-load step that fails on integer tensors
                raise TypeError("not for integers")
            return None

    eng = Deriving().to(torch.bfloat16)
    eng.head_cache = torch.full((V, H), 3.0)
    eng.norm_sum.fill_(5.0)
    cache, norm_sum = eng.head_cache, eng.norm_sum
    which = "head_cache" if how == "rebind" else "norm_sum"
    match = ("not for integers" if how == "raise" else
             f"changed 1 buffers or tensor attributes.*{which}")
    with pytest.raises((RuntimeError, TypeError), match=match):
        L.learn_layout(eng, {n: (s, torch.bfloat16) for n, s in SHAPES.items()})
    # and put back: the engine keeps what it had
    assert eng.head_cache is cache and bool((cache == 3.0).all())
    assert eng.norm_sum is norm_sum and float(norm_sum) == 5.0
    # a loader that leaves them alone learns as before
    assert L.learn_layout(Engine(), {n: (s, torch.bfloat16) for n, s in SHAPES.items()})


@pytest.mark.parametrize("how", ["untouched", "rebind", "in_place"])
def test_large_state_is_kept_as_a_digest(monkeypatch, how):
    """CPU state over COPY_LIMIT is kept as a digest, not a copy: left alone it is not named,
    rebound it is put back and named, written in place it is named as not restored."""
    monkeypatch.setattr(MS, "COPY_LIMIT", 64)  # bytes: the V x H cache below is over it

    class Caching(Engine):
        def __init__(self):
            super().__init__()
            self.big = torch.full((V, H), 3.0)

        def load_weights(self, weights):
            weights = list(weights)
            super().load_weights(weights)
            if how == "rebind":
                self.big = torch.zeros(V, H)
            elif how == "in_place":
                self.big[0, 0] = 7.0
            return None

    eng = Caching().to(torch.bfloat16)
    big = eng.big
    state = MS.TensorState(eng)
    assert isinstance(state.kept["big"][-1], bytes)  # a digest, no copy
    shapes = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    if how == "untouched":
        assert L.learn_layout(eng, shapes)
        return
    match = (r"big \(written in place, not restored\); 1 not put back: reload the engine"
             if how == "in_place" else r"changed 1 buffers.*\(big; put back\)")
    with pytest.raises(RuntimeError, match=match):
        L.learn_layout(eng, shapes)
    assert eng.big is big  # rebinding is always put back
    assert float(big[0, 0]) == (7.0 if how == "in_place" else 3.0)


def test_not_state_is_not_kept():
    """An attribute the engine adapter names as not model state (vLLM's per-layer kv_cache) is
    not copied, and a write to it is not taken for derived state."""
    class WithCache(Engine):
        def __init__(self):
            super().__init__()
            self.kv_cache = torch.zeros(4, V, H)

        def load_weights(self, weights):
            super().load_weights(weights)
            self.kv_cache.fill_(1.0)  # (no loader does this: here only to show it is not kept)
            return None

    eng = WithCache()
    assert "kv_cache" in MS.TensorState(eng).kept
    assert "kv_cache" not in MS.TensorState(eng, not_state=("kv_cache",)).kept
    shapes = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    with pytest.raises(RuntimeError, match="kv_cache"):
        L.learn_layout(WithCache(), shapes)
    assert L.learn_layout(WithCache(), shapes, not_state=("kv_cache",))


def test_params_no_loader_writes_are_reported_as_derived():
    class Absorbed(Engine):
        def __init__(self):
            super().__init__()
            self.absorbed = torch.nn.Parameter(torch.zeros(H, H))  # computed after loading

    lay = L.learn_layout(Absorbed(), {n: (s, torch.bfloat16) for n, s in SHAPES.items()})
    assert lay.derived() == ["absorbed"]
    assert L.learn_layout(Engine(), {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
                          ).derived() == []


@pytest.mark.parametrize("sort", [True, False])
def test_locate_matches_a_vectorised_reference(sort):
    """Segment.locate (one numba pass) against the searchsorted formulation, on random runs with
    gaps and random positions (sorted, as patches carry them, or not)."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20, 300)
    gaps = rng.integers(0, 5, 300)
    hf_start = np.cumsum(gaps + np.r_[0, lengths[:-1]]).astype(np.int64)
    eng_start = rng.permutation(300).astype(np.int64) * 100
    seg = L.Segment("p", hf_start, eng_start, lengths.astype(np.int64))
    pos = torch.from_numpy(rng.integers(-3, int(hf_start[-1] + lengths[-1] + 5), 5000))
    if sort:
        pos = pos.sort().values
    ok, eng = seg.locate(pos)
    hs = torch.from_numpy(hf_start)
    idx = torch.searchsorted(hs, pos, right=True) - 1
    want_ok = (idx >= 0) & (pos < hs[idx.clamp_min(0)] + torch.from_numpy(seg.length)[
        idx.clamp_min(0)])
    want_eng = (torch.from_numpy(eng_start)[idx.clamp_min(0)] + pos - hs[idx.clamp_min(0)])
    assert torch.equal(ok, want_ok) and torch.equal(eng, want_eng[want_ok])
    assert 0 < int(ok.sum()) < len(pos)
