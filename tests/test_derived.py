"""stitch_core.engine.derived: kernels' private copies of weights kept in step with in-place
patches.

A small tied model whose "kernels" read packed copies (clones held in closures), as vLLM's CPU
backend does: the embedding and the tied lm_head each pack their own copy of one parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stitch_core.engine import derived, rpc
from stitch_core.engine.layout import engine_params
from stitch_core.engine.replica import RankReplica, ReplicaError

V, D = 40, 8


def _pack(layer: nn.Module, source: torch.Tensor) -> None:
    packed = source.detach().clone()  # a private copy, as a packed kernel keeps
    layer.cpu_linear = lambda x: x @ packed.t()


class Tied(nn.Module):
    """embed_tokens and lm_head share one parameter; each 'packs' its own copy of it."""

    def __init__(self, register: bool = True):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, D)
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight
        self.model.proj = nn.Linear(D, D, bias=False)
        for mod in (self.model.embed_tokens, self.lm_head, self.model.proj):
            w = mod.weight
            _pack(mod, w)
            if register:
                derived.register(mod, "toy", {"weight": w},
                                 lambda mod=mod, w=w: _pack(mod, w), holders=("cpu_linear",))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        h = self.model.proj.cpu_linear(h)
        return self.lm_head.cpu_linear(h)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return set(params)


def _shapes(model: nn.Module) -> dict:
    return {"model.embed_tokens.weight": ((V, D), "F32"),
            "model.proj.weight": ((D, D), "F32")}


def test_tied_weight_rebuilds_every_copy_by_storage():
    m = Tied()
    assert derived.kinds(m) == {"toy": 3}
    assert derived.stale(m) == [] and derived.unmanaged(m) == []
    w = m.model.embed_tokens.weight
    with torch.no_grad():
        w[3, 1] += 1.0
    # both copies built from the shared parameter are stale, the other one is not
    assert derived.stale(m) == ["lm_head (toy)", "model.embed_tokens (toy)"]
    assert derived.stale(m, [m.model.proj.weight]) == []
    done = derived.rebuild_from(m, [engine_params(m)["model.embed_tokens.weight"]])
    assert done == ["lm_head", "model.embed_tokens"]  # the alias too, though it has no name
    assert derived.stale(m) == []
    ids = torch.tensor([[1, 3, 5]])
    fresh = Tied()  # built and packed from the changed bytes
    fresh.load_weights((n, p.detach()) for n, p in m.named_parameters())
    for mod in (fresh.model.embed_tokens, fresh.lm_head, fresh.model.proj):
        _pack(mod, mod.weight)
    assert torch.equal(m(ids), fresh(ids))


def test_unregistered_closure_over_a_copy_is_named():
    m = Tied(register=False)
    assert derived.unmanaged(m) == ["lm_head.cpu_linear", "model.embed_tokens.cpu_linear",
                                    "model.proj.cpu_linear"]
    m2 = nn.Linear(2, 2)
    m2.act = lambda x: torch.relu(x)  # a closure over nothing: not state
    k = 3
    m2.scale = lambda x: x * k  # over a number: not state
    assert derived.unmanaged(m2) == []


def _replica(m: nn.Module, rebuild: bool) -> RankReplica:
    def on_dirty(dirty):
        if rebuild:
            params = engine_params(m)
            derived.rebuild_from(m, [params[n] for n in dirty])

    rep = RankReplica(m, on_dirty=on_dirty)
    info = rep.setup(_shapes(m))
    assert info.derived_copies == {"toy": 3} and info.stale_derived == []
    assert info.unmanaged == []
    return rep


def _gather_write(rep: RankReplica, pos: list[int], new: torch.Tensor):
    import numpy as np

    name = "model.embed_tokens.weight"
    rep.gather("a1", {name: np.asarray(pos, dtype=np.int32)})
    return rep.write("a1", {name: new.view(torch.int32).numpy()})


def test_write_that_leaves_a_copy_stale_is_undone():
    m = Tied()
    before = m.model.embed_tokens.weight.detach().clone()
    rep = _replica(m, rebuild=False)
    with pytest.raises(ReplicaError, match="derived copies not rebuilt.*lm_head"):
        _gather_write(rep, [0, 17, V * D - 1], torch.tensor([1.5, -2.0, 3.25]))
    assert torch.equal(m.model.embed_tokens.weight, before)  # undone
    assert derived.stale(m) == []


def test_write_rebuilds_the_tied_copies_and_serves_the_new_values():
    m = Tied()
    rep = _replica(m, rebuild=True)
    out = _gather_write(rep, [0, 17, V * D - 1], torch.tensor([1.5, -2.0, 3.25]))
    assert out.dirty == ["model.embed_tokens.weight"]
    rep.commit("a1")
    assert derived.stale(m) == []
    w = m.model.embed_tokens.weight.reshape(-1)
    assert w[17].item() == -2.0
    ids = torch.tensor([[0, 2, V - 1]])
    ref = m.model.proj(m.model.embed_tokens(ids)) @ m.model.embed_tokens.weight.t()
    assert torch.equal(m(ids), ref)  # the kernels read the patched bytes


def test_sums_report_a_copy_left_stale_behind_the_replica():
    m = Tied()
    rep = _replica(m, rebuild=True)
    with torch.no_grad():  # e.g. a write that bypassed the apply path
        m.model.proj.weight[0, 0] = 9.0
    assert rep.handle(rpc.Sums()).stale_derived == ["model.proj (toy)"]


def test_an_apply_in_batches_rebuilds_the_copies_once_with_its_last_batch():
    import numpy as np

    m = Tied()
    calls: list[set[str]] = []

    def on_dirty(dirty):
        calls.append(set(dirty))
        params = engine_params(m)
        derived.rebuild_from(m, [params[n] for n in dirty])

    rep = RankReplica(m, on_dirty=on_dirty)
    rep.setup(_shapes(m))
    emb, proj = "model.embed_tokens.weight", "model.proj.weight"

    def batch(name: str, pos: list[int], vals: list[float], last: bool):
        rep.gather("b1", {name: np.asarray(pos, dtype=np.int32)})
        return rep.write("b1", {name: torch.tensor(vals).view(torch.int32).numpy()}, last)

    batch(emb, [0, 5], [1.5, -2.0], last=False)
    assert calls == [] and derived.stale(m) != []  # copies rebuilt later, steps still held
    batch(proj, [3], [0.25], last=False)
    batch(emb, [9], [4.0], last=True)
    assert calls == [{emb, proj}]  # once, for every parameter of every batch
    assert derived.stale(m) == []
    assert [w for _, w in rep.last_write] and len(rep.last_write) == 3  # all three batches
    rep.undo("b1")  # one undo for the whole apply: every batch put back, copies rebuilt
    assert calls[-1] == {emb, proj} and derived.stale(m) == []
    assert m.model.embed_tokens.weight.reshape(-1)[5].item() != -2.0


def test_a_last_batch_that_leaves_a_copy_stale_undoes_only_itself_and_raises():
    import numpy as np

    m = Tied()
    rep = _replica(m, rebuild=False)
    before = m.model.embed_tokens.weight.detach().clone()
    name = "model.embed_tokens.weight"
    rep.gather("c1", {name: np.asarray([1], dtype=np.int32)})
    rep.write("c1", {name: torch.tensor([2.5]).view(torch.int32).numpy()}, False)  # no check yet
    rep.gather("c1", {name: np.asarray([2], dtype=np.int32)})
    with pytest.raises(ReplicaError, match="derived copies not rebuilt"):
        rep.write("c1", {name: torch.tensor([3.5]).view(torch.int32).numpy()}, True)
    rep.undo("c1")  # what the coordinator does next: the earlier batch is put back too
    assert torch.equal(m.model.embed_tokens.weight, before)


def test_not_rebuilt_names_touched_copies_stamped_before_the_mark():
    m = Tied()
    w, p = m.model.embed_tokens.weight, m.model.proj.weight
    mark = derived.generation()
    # both copies built from the shared embedding predate the mark; proj was not written
    assert derived.not_rebuilt(m, [w], mark) == ["lm_head (toy)", "model.embed_tokens (toy)"]
    assert derived.not_rebuilt(m, [p], mark) == ["model.proj (toy)"]
    derived.rebuild_from(m, [w])
    assert derived.not_rebuilt(m, [w], mark) == []
    assert derived.not_rebuilt(m, [w, p], mark) == ["model.proj (toy)"]
    later = derived.generation()
    assert derived.not_rebuilt(m, [w], later) != []  # a new write needs a new rebuild


@pytest.mark.parametrize("threads", [1, 3])
def test_stamps_and_checks_on_threads_name_exactly_the_stale_copies(threads):
    """`stale` and `rebuild_from` hash the copies on `threads` threads: the result is the same
    copies as one by one."""
    stack = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(12))
    for mod in stack:
        _pack(mod, mod.weight)
        derived.register(mod, "toy", {"weight": mod.weight},
                         lambda mod=mod: _pack(mod, mod.weight))
    assert derived.stale(stack) == []
    with torch.no_grad():
        for i in (2, 7, 11):
            stack[i].weight[0, 0] += 1  # written, not rebuilt
    assert derived.stale(stack, threads=threads) == ["11 (toy)", "2 (toy)", "7 (toy)"]
    assert derived.stale(stack, [stack[7].weight], threads=threads) == ["7 (toy)"]
    mark = derived.generation()
    assert derived.rebuild_from(stack, [stack[i].weight for i in (2, 7, 11)],
                                threads=threads) == ["11", "2", "7"]
    assert derived.stale(stack, threads=threads) == []
    assert derived.not_rebuilt(stack, [stack[i].weight for i in (2, 7, 11)], mark) == []
