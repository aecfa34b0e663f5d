"""stitch_core.engine.postload: what a post-load step did to a layer decides what Stitch keeps."""

from __future__ import annotations

import torch

from stitch_core.engine import derived
from stitch_core.engine.layout import engine_params
from stitch_core.engine.postload import rebuild_dirty, wrap_post_load


class Rewrap:
    def process_weights_after_loading(self, layer):  # same storage, a plain Parameter
        layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)


class Pack:
    def process_weights_after_loading(self, layer):  # a reversed copy the kernel reads
        layer.weight = torch.nn.Parameter(layer.weight.data.flip(0).clone(), requires_grad=False)


def _layer() -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2), requires_grad=False)
    return m


def test_rewrapped_parameters_become_masters_without_a_copy():
    wrap_post_load(Rewrap, lambda m, layer: "test")
    layer = _layer()
    loaded = layer.weight
    Rewrap().process_weights_after_loading(layer)
    assert layer._stitch_masters == {"weight": loaded}
    assert layer.weight is not loaded and layer.weight.data_ptr() == loaded.data_ptr()
    assert derived.copies(layer) == []


def test_a_transformed_copy_is_rebuilt_from_the_patched_master():
    wrap_post_load(Pack, lambda m, layer: "test:Pack")
    model = torch.nn.Module()
    model.lin = _layer()
    master = model.lin.weight
    Pack().process_weights_after_loading(model.lin)
    assert engine_params(model)["lin.weight"] is master
    assert derived.kinds(model) == {"test:Pack": 1}
    master.data[0, 0] = 42.0  # a patch writes the master
    assert derived.stale(model) == ["lin (test:Pack)"]
    assert rebuild_dirty(model, ["lin.weight"]) == ["lin"]
    assert torch.equal(model.lin.weight, master.flip(0)) and derived.stale(model) == []
    assert model.lin._stitch_masters["weight"] is master  # kept across the rebuild
