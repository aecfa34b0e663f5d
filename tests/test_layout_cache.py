"""stitch_core.engine.layout_cache: a rank's learned layout kept on disk and reused on restart,
never trusted: damaged files are ignored, and a map that does not prove the weights is learned
again through the loaders by the coordinator's start-up proof.

The engine is tests/test_layout.py's rank of a TP-2 model whose loaders fuse, slice, pad,
duplicate and transpose (every element's place differs from the checkpoint's)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from stitch_core.engine import layout as L
from stitch_core.engine import replica as replica_mod
from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.layout_cache import LayoutCache
from stitch_core.engine.replica import RankReplica

from .test_layout import SHAPES, _engine, _hf_weights

HF = {n: (s, "BF16") for n, s in SHAPES.items()}
IDENT = {"engine": "toy", "version": "1", "rank": {"rank": 0}}


def _segments(layout):
    return {n: [(s.param, s.hf_start.tolist(), s.eng_start.tolist(), s.length.tolist())
                for s in t.segments] for n, t in layout.tensors.items()}


def _no_learning(monkeypatch):
    def learn(*a, **k):
        raise AssertionError("learned through the loaders")
    monkeypatch.setattr(replica_mod, "learn_layout", learn)


def test_a_restart_reads_the_layout_instead_of_learning_it(tmp_path, monkeypatch):
    w = _hf_weights()
    cache = LayoutCache(tmp_path / "layouts", IDENT)
    first = RankReplica(_engine(0, w), layout_cache=cache, rank_info={"rank": 0})
    r1 = first.setup(HF)
    assert r1.cached is False and len(list((tmp_path / "layouts").glob("*.safetensors"))) == 1
    _no_learning(monkeypatch)
    second = RankReplica(_engine(0, w), layout_cache=cache, rank_info={"rank": 0})
    r2 = second.setup(HF)
    assert r2.cached is True
    assert r2.sums == r1.sums and r2.mapped == r1.mapped  # the same proof through the same map
    assert _segments(second.layout) == _segments(first.layout)
    assert second.layout.param_const == first.layout.param_const
    assert second.layout.rank_info == {"rank": 0}
    with pytest.raises(AssertionError, match="learned"):  # use_cache=False learns again
        second.setup(HF, use_cache=False)


def test_the_key_covers_code_shapes_and_parameters(tmp_path):
    w = _hf_weights()
    eng = _engine(0, w)
    hf = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    base = LayoutCache(tmp_path, IDENT).key(eng, hf)
    assert LayoutCache(tmp_path, IDENT).key(_engine(0, _hf_weights(seed=5)), hf) == base  # values
    assert LayoutCache(tmp_path, {**IDENT, "version": "2"}).key(eng, hf) != base
    assert LayoutCache(tmp_path, {**IDENT, "rank": {"rank": 1}}).key(eng, hf) != base
    assert LayoutCache(tmp_path, IDENT).key(eng, {**hf, "extra": ((2,), torch.bfloat16)}) != base
    assert LayoutCache(tmp_path, IDENT).key(eng.to(torch.float32), hf) != base  # param dtypes


@pytest.mark.parametrize("damage", ["truncated", "other-key", "out-of-bounds", "garbage"])
def test_a_damaged_cache_file_is_ignored_and_removed(tmp_path, damage, caplog):
    w = _hf_weights()
    cache = LayoutCache(tmp_path, IDENT)
    rep = RankReplica(_engine(0, w), layout_cache=cache)
    want = rep.setup(HF).sums
    key = cache.key(rep.model, {n: (s, torch.bfloat16) for n, s in SHAPES.items()})
    path = tmp_path / f"{key}.safetensors"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "other-key":  # a valid file of another key, copied under this one
        other = LayoutCache(tmp_path, {**IDENT, "version": "2"})
        other.save(other.key(rep.model, {n: (s, torch.bfloat16) for n, s in SHAPES.items()}),
                   rep.layout)
        path.write_bytes(next(p for p in tmp_path.glob("*.safetensors") if p != path)
                         .read_bytes())
    elif damage == "out-of-bounds":
        seg = rep.layout.tensors["o.weight"].segments[0]
        seg.eng_start = seg.eng_start + 10_000
        cache.save(key, rep.layout)
    else:
        save_file({"x": torch.zeros(1)}, str(path), metadata={"stitch_layout": "{not json"})
    with caplog.at_level(logging.WARNING, logger="stitch.engine"):
        again = RankReplica(_engine(0, w), layout_cache=cache).setup(HF)
    assert again.cached is False and again.sums == want
    assert "ignoring the cached layout" in caplog.text
    assert path.exists()  # removed, then written again by the fresh learning




async def _start(model_dir, w, cache):
    replicas = [RankReplica(_engine(r, w), rank_info={"rank": r}, layout_cache=cache[r])
                for r in (0, 1)]
    coord = Coordinator(rpc_.in_process(replicas), run=None)
    await coord.start(model_dir)
    return coord, replicas


async def test_a_cached_map_that_does_not_prove_is_learned_again(tmp_path, caplog):
    w = _hf_weights()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(w, str(model_dir / "model.safetensors"))
    cache = [LayoutCache(tmp_path / "layouts", {**IDENT, "rank": {"rank": r}}) for r in (0, 1)]
    coord, _ = await _start(model_dir, w, cache)
    assert coord.layout_cached is False and coord.check["ok"] is True
    coord, reps = await _start(model_dir, w, cache)  # a restart: both ranks read their maps
    assert coord.layout_cached is True and coord.check["layout_cached"] is True
    assert coord.check["ok"] is True and not coord.fallback

    # rank 1's file now holds a wrong map under the right key (in bounds: two runs swapped), as
    # if loader code had changed without changing the key
    rep = reps[1]
    hf = {n: (s, torch.bfloat16) for n, s in SHAPES.items()}
    key = cache[1].key(rep.model, hf)
    seg = rep.layout.tensors["o.weight"].segments[0]
    assert len(seg.eng_start) > 1
    seg.eng_start = np.ascontiguousarray(seg.eng_start[::-1])
    cache[1].save(key, rep.layout)
    with caplog.at_level(logging.WARNING, logger="stitch"):
        coord, reps = await _start(model_dir, w, cache)
    assert "cached layout did not prove" in caplog.text
    assert coord.check["ok"] is True and not coord.fallback and coord.layout_cached is False
    fresh = L.learn_layout(_engine(1, w), hf)
    assert _segments(cache[1].load(key)) == _segments(fresh)  # the cache holds the right map
