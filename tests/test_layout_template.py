"""stitch_core.engine.layout_template: a decoder layer's map taken from a learned twin layer.

The engine is a stack of layers in the style of vLLM's models: each layer fuses q/k into one
parameter (rows sliced for its TP rank), keeps o_proj column-sliced and a norm written twice,
with a `weight_loader` per parameter; plus an embedding with zeroed padding rows outside the
layers. Templated maps must equal the maps learned through every loader, a layer that differs
in anything its placement could depend on must be learned, and a templated map that does not
prove at start-up must be learned again through every loader."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import save_file

from stitch_core.engine import layout as L
from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.replica import RankReplica

H, V, VPAD, LAYERS = 6, 10, 12, 4


def _copy_rows(param, w, lo):
    param.data[lo:lo + w.shape[0]].copy_(w)


class Layer(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        half = H // 2
        self.rank = rank
        self.qk = torch.nn.Parameter(torch.zeros(2 * half, H))
        self.o = torch.nn.Parameter(torch.zeros(H, half))
        self.norm2 = torch.nn.Parameter(torch.zeros(2 * H))
        for p in self.parameters():
            p.weight_loader = _copy_rows

    def load(self, part: str, w: torch.Tensor) -> None:
        half, r = H // 2, self.rank
        if part == "q":
            self.qk.weight_loader(self.qk, w[r * half:(r + 1) * half], 0)
        elif part == "k":
            self.qk.weight_loader(self.qk, w[r * half:(r + 1) * half], half)
        elif part == "o":
            self.o.data.copy_(w[:, r * half:(r + 1) * half])
        else:
            self.norm2.data[:H].copy_(w)
            self.norm2.data[H:].copy_(w)


class TransposedO(Layer):
    """Another module class: o_proj kept transposed (other places, same names and shapes)."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.o = torch.nn.Parameter(torch.zeros(H // 2, H))

    def load(self, part: str, w: torch.Tensor) -> None:
        if part == "o":
            r, half = self.rank, H // 2
            self.o.data.copy_(w[:, r * half:(r + 1) * half].t())
        else:
            super().load(part, w)


class ByIndex(Layer):
    """A loader that places by the layer's number (the one thing a signature leaves out): odd
    layers keep o_proj's rows reversed. Same class, names, shapes and loaders as the others."""

    def __init__(self, rank: int, index: int):
        super().__init__(rank)
        self.index = index

    def load(self, part: str, w: torch.Tensor) -> None:
        if part == "o" and self.index % 2:
            r, half = self.rank, H // 2
            self.o.data.copy_(w[:, r * half:(r + 1) * half].flip(0))
        else:
            super().load(part, w)


class Body(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


class Stack(torch.nn.Module):
    """Parameters `embed` and `model.layers.<i>.{qk,o,norm2}`."""

    def __init__(self, rank: int = 0, layers: list[torch.nn.Module] | None = None):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(VPAD, H))
        self.model = Body(layers or [Layer(rank) for _ in range(LAYERS)])

    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed.weight":
                self.embed.data[:V].copy_(w)
                self.embed.data[V:].fill_(0)
                continue
            _, _, i, part, _ = name.split(".")  # model.layers.<i>.<part>.weight
            self.model.layers[int(i)].load(part, w)


def _shapes() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {"embed.weight": ((V, H), torch.bfloat16)}
    for i in range(LAYERS):
        for part, s in (("q", (H, H)), ("k", (H, H)), ("o", (H, H)), ("norm", (H,))):
            out[f"model.layers.{i}.{part}.weight"] = (s, torch.bfloat16)
    return out


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, (s, _) in _shapes().items()}


def _loaded(model: Stack, w: dict[str, torch.Tensor]) -> Stack:
    model = model.to(torch.bfloat16)
    model.load_weights(w.items())
    return model


def _maps(layout: L.Layout) -> dict:
    return {n: [(s.param, s.hf_start.tolist(), s.eng_start.tolist(), s.length.tolist())
                for s in t.segments] for n, t in layout.tensors.items()}


def _learn_both(make) -> tuple[L.Layout, L.Layout]:
    w = _weights()
    return (L.learn_layout(_loaded(make(), w), _shapes(), templates=True),
            L.learn_layout(_loaded(make(), w), _shapes(), templates=False))


def test_twin_layers_take_the_learned_layers_map():
    for rank in (0, 1):
        templ, full = _learn_both(lambda rank=rank: Stack(rank))
        assert templ.templated == LAYERS - 1 and full.templated == 0
        assert _maps(templ) == _maps(full)
        assert templ.param_const == full.param_const
        assert templ.param_unwritten == full.param_unwritten
        assert templ.param_const["embed"] == (VPAD - V) * H


def test_a_layer_of_another_class_is_learned():
    templ, full = _learn_both(lambda: Stack(0, [Layer(0), TransposedO(0), Layer(0), Layer(0)]))
    assert templ.templated == LAYERS - 2  # layer 1 learned, layers 2 and 3 from layer 0
    assert _maps(templ) == _maps(full)
    # the transposed o_proj is one element per run: not layer 0's map renamed
    assert len(full.tensors["model.layers.1.o.weight"].segments[0].length) == H * H // 2


def test_a_layer_with_another_weight_loader_is_learned():
    def make():
        s = Stack(0)
        s.model.layers[2].qk.weight_loader = lambda p, w, lo: _copy_rows(p, w, lo)
        return s
    templ, full = _learn_both(make)
    assert templ.templated == LAYERS - 2
    assert _maps(templ) == _maps(full)


async def test_a_templated_map_that_does_not_prove_is_learned_again(tmp_path, caplog):
    """Layers that place by their number are twins by every check a signature makes: layer 1's
    map is then layer 0's renamed, wrong, and the start-up proof sees it (random weights, no two
    rows of o_proj equal) and has the rank learn every layer through the loaders."""
    w = _weights()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(w, str(model_dir / "model.safetensors"))

    def make(rank):
        return _loaded(Stack(rank, [ByIndex(rank, i) for i in range(LAYERS)]), w)

    wrong = L.learn_layout(make(1), _shapes())
    full = L.learn_layout(make(1), _shapes(), templates=False)
    assert wrong.templated == LAYERS - 1 and _maps(wrong) != _maps(full)

    reps = [RankReplica(make(r), rank_info={"rank": r}) for r in (0, 1)]  # TP 2
    coord = Coordinator(rpc_.in_process(reps), run=None)
    with caplog.at_level(logging.WARNING, logger="stitch"):
        await coord.start(model_dir)
    assert "templated layout did not prove" in caplog.text
    assert coord.check["ok"] is True and not coord.fallback
    assert reps[1].layout.templated == 0 and _maps(reps[1].layout) == _maps(full)
    assert coord.check["layout_templated"] == 0  # what the proof passed on: all learned


async def test_templates_off_learns_every_layer(tmp_path):
    w = _weights()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(w, str(model_dir / "model.safetensors"))
    reps = [RankReplica(_loaded(Stack(r), w), rank_info={"rank": r}, layout_templates=False)
            for r in (0, 1)]
    coord = Coordinator(rpc_.in_process(reps), run=None)
    await coord.start(model_dir)
    assert coord.check["ok"] is True and all(r.layout.templated == 0 for r in reps)
    assert coord.check["layout_templated"] == 0
    # how it was learned, in the status: each layer a TP shard, learned from row and column
    # ids; the embedding (held whole, padded) from the full index
    assert coord.check["layout_bytes"] == max(r.layout.learn_bytes for r in reps) > 0
    assert coord.check["layout_full_index"] == ["rest"]
    assert all(r.layout.full_index_groups == ["rest"] for r in reps)


async def test_templated_maps_prove_at_start(tmp_path, caplog):
    w = _weights()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(w, str(model_dir / "model.safetensors"))
    reps = [RankReplica(_loaded(Stack(r), w), rank_info={"rank": r}) for r in (0, 1)]
    coord = Coordinator(rpc_.in_process(reps), run=None)
    with caplog.at_level(logging.WARNING, logger="stitch"):
        await coord.start(model_dir)
    assert coord.check["ok"] is True and not coord.fallback and "did not prove" not in caplog.text
    assert all(r.layout.templated == LAYERS - 1 for r in reps)
    assert coord.check["layout_templated"] == 2 * (LAYERS - 1)
