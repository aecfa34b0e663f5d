"""stitch_core.engine.prebuild: kernels' copies of weights built ahead of an apply's pause.

The tied toy model of tests/test_derived.py, whose "kernels" read packed copies held in closures
(as vLLM's CPU backend does), with a `build` that packs a copy from given sources without
touching the module. A build ahead must be installed only for exactly the write it was staged
for, and the model must then serve what a fresh pack of the written weights serves.
"""

from __future__ import annotations

import gc
import logging
import resource
import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from stitch_core.engine import derived, rpc
from stitch_core.engine.layout import engine_params
from stitch_core.engine.replica import RankReplica

from .test_derived import D, V
from .test_derived import Tied as TiedBase

EMB = "model.embed_tokens.weight"
SHAPES = {EMB: ((V, D), "F32"), "model.proj.weight": ((D, D), "F32")}


def _packed(source: torch.Tensor, lookup: bool = False):
    packed = source.detach().clone()  # a private copy, as a packed kernel keeps
    return (lambda ids: packed[ids]) if lookup else (lambda x: x @ packed.t())


class Tied(TiedBase):
    """embed_tokens and lm_head share one parameter (test_derived's model); each packs its own
    copy, and counts how often it was rebuilt in place and built ahead (and on which thread)."""

    def __init__(self, fail_build: bool = False, gate: threading.Event | None = None):
        super().__init__(register=False)
        self.rebuilds = 0
        self.builds: list[str] = []  # thread names
        for mod in (self.model.embed_tokens, self.lm_head, self.model.proj):
            w, lookup = mod.weight, mod is self.model.embed_tokens
            mod.cpu_linear = _packed(w, lookup)

            def rebuild(mod=mod, w=w, lookup=lookup):
                self.rebuilds += 1
                mod.cpu_linear = _packed(w, lookup)

            def build(sources, mod=mod, lookup=lookup):
                self.builds.append(threading.current_thread().name)
                if gate is not None:
                    gate.wait(10)
                if fail_build:
                    raise RuntimeError("packing failed")
                fn = _packed(sources["weight"], lookup)

                def install(mod=mod, fn=fn):
                    old, mod.cpu_linear = mod.cpu_linear, fn
                    return old  # the rank frees it after the pause
                return install

            derived.register(mod, "toy", {"weight": w}, rebuild, holders=("cpu_linear",),
                             build=build)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens.cpu_linear(ids)
        return self.lm_head.cpu_linear(self.model.proj.cpu_linear(h))


def _replica(m: Tied, budget: int = 1 << 20, fail_once: bool = False) -> RankReplica:
    failed = []

    def on_dirty(dirty):
        params = engine_params(m)
        out = derived.rebuild_from(m, [params[n] for n in dirty])
        if fail_once and not failed:
            failed.append(1)
            raise RuntimeError("rank failed after its rebuild")
        return out

    rep = RankReplica(m, on_dirty=on_dirty, prebuild_memory=budget)
    assert rep.setup(SHAPES).stale_derived == []
    return rep


def _fresh_output(m: Tied) -> torch.Tensor:
    """What a model packed from scratch from `m`'s current weights serves."""
    fresh = Tied()
    fresh.load_weights((n, p.detach()) for n, p in m.named_parameters())
    for mod in (fresh.model.embed_tokens, fresh.lm_head, fresh.model.proj):
        mod.cpu_linear = _packed(mod.weight, mod is fresh.model.embed_tokens)
    return fresh(IDS)


IDS = torch.tensor([[1, 3, 5, 39]])
POS = np.asarray([0, 17, 3 * D + 1, V * D - 1], dtype=np.int32)
NEW = torch.tensor([1.5, -2.0, 0.75, 3.25])


def _stage(rep: RankReplica, new: torch.Tensor = NEW) -> rpc.PrebuildReply:
    rep.gather("a1", {EMB: POS})
    out = rep.prebuild("a1", {EMB: new.view(torch.int32).numpy()})
    while not out.done:
        out = rep.prebuild("a1", None)
    return out


def test_copies_built_ahead_are_installed_by_the_write_they_were_staged_for():
    m = Tied()
    rep = _replica(m)
    staged = _stage(rep)
    # the embedding's and the tied lm_head's copies; proj is not written
    assert staged.copies == 2 and staged.nbytes == 2 * V * D * 4 and staged.why == ""
    assert m.builds == ["stitch-prebuild"] * 2 and m.rebuilds == 0
    # each step of the two builds timed, none longer than the whole
    steps = {k: staged.phases[k] for k in ("copy", "write", "build", "digest")}
    assert all(v > 0 for v in steps.values()) and sum(steps.values()) <= staged.seconds
    if hasattr(resource, "RUSAGE_THREAD"):  # Linux: the kernel's share of the build
        assert 0 <= staged.phases["build_sys"] <= staged.phases["build"] + 0.01
    before = m(IDS)
    old_copy = weakref.ref(m.lm_head.cpu_linear)
    out = rep.write("a1", {EMB: NEW.view(torch.int32).numpy()})
    assert old_copy() is not None  # replaced, but freed only at the commit (after the pause)
    rep.commit("a1")
    gc.collect()
    assert old_copy() is None
    assert out.ahead == 2 and out.rebuilt == ["lm_head", "model.embed_tokens"]
    assert m.rebuilds == 0  # installed, not rebuilt in the pause
    assert derived.stale(m) == []  # their stamps are the written weights' digests
    assert m.model.embed_tokens.weight.reshape(-1)[POS.astype(np.int64)].tolist() == NEW.tolist()
    after = m(IDS)
    assert not torch.equal(after, before) and torch.equal(after, _fresh_output(m))


def test_a_write_of_other_bits_rebuilds_in_the_pause():
    m = Tied()
    rep = _replica(m)
    _stage(rep)
    other = NEW + 1
    out = rep.write("a1", {EMB: other.view(torch.int32).numpy()})
    assert out.ahead == 0 and m.rebuilds == 2
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))
    assert m.model.embed_tokens.weight.reshape(-1)[POS.astype(np.int64)].tolist() == other.tolist()


def test_a_load_between_stage_and_write_drops_the_build():
    m = Tied()
    rep = _replica(m)
    _stage(rep)
    rep.load([(EMB, torch.zeros(V, D))])  # a snapshot load: the staged build is stale
    assert rep.prebuild("a1", None).copies == 0
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))


def test_a_failed_build_falls_back_to_the_rebuild(caplog):
    m = Tied(fail_build=True)
    rep = _replica(m)
    assert _stage(rep).done
    with caplog.at_level(logging.WARNING, "stitch.engine"):
        out = rep.write("a1", {EMB: NEW.view(torch.int32).numpy()})
    assert out.ahead == 0 and m.rebuilds == 2 and "packing failed" in caplog.text
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))


def test_a_failed_write_restores_from_the_old_weights_not_the_build():
    m = Tied()
    rep = _replica(m, fail_once=True)
    old_out, old_w = m(IDS), m.model.embed_tokens.weight.detach().clone()
    _stage(rep)
    with pytest.raises(RuntimeError, match="after its rebuild"):
        rep.write("a1", {EMB: NEW.view(torch.int32).numpy()})
    # the builds ahead were installed, then the write failed: the restore rebuilt from the old
    assert torch.equal(m.model.embed_tokens.weight, old_w)
    assert derived.stale(m) == [] and torch.equal(m(IDS), old_out)


def test_copies_over_the_budget_are_rebuilt_in_the_pause():
    m = Tied()
    rep = _replica(m, budget=V * D * 4)  # room for one of the two copies
    staged = _stage(rep)
    assert staged.copies == 1
    out = rep.write("a1", {EMB: NEW.view(torch.int32).numpy()})
    assert out.ahead == 1 and m.rebuilds == 1
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))
    rep2 = _replica(Tied(), budget=0)
    assert "STITCH_PREBUILD_MEMORY is 0" in _stage(rep2).why


def test_prebuild_needs_the_matching_gather():
    m = Tied()
    rep = _replica(m)
    rep.gather("a1", {EMB: POS})
    with pytest.raises(Exception, match="without a matching gather"):
        rep.prebuild("a2", {EMB: NEW.view(torch.int32).numpy()})
    assert rep.prebuild("a2", None).copies == 0  # nothing staged for it


def test_prebuild_travels_through_the_rank_rpc():
    m = Tied()
    rep = _replica(m)
    rep.handle(rpc.Gather("a1", {EMB: POS}))
    reply = rpc.decode(rpc.encode(rep.handle(rpc.decode(rpc.encode(
        rpc.Prebuild("a1", {EMB: NEW.view(torch.int32).numpy()}))))))
    assert isinstance(reply, rpc.PrebuildReply) and reply.copies == 2
    while not rep.handle(rpc.Prebuild("a1")).done:
        pass
    out = rep.handle(rpc.Write("a1", {EMB: NEW.view(torch.int32).numpy()}))
    assert out.ahead == 2 and torch.equal(m(IDS), _fresh_output(m))


def test_a_staged_write_carries_no_bits():
    m = Tied()
    rep = _replica(m)
    _stage(rep)
    out = rep.handle(rpc.Write("a1", {}, staged=True))
    assert out.ahead == 2 and m.rebuilds == 0
    assert m.model.embed_tokens.weight.reshape(-1)[POS.astype(np.int64)].tolist() == NEW.tolist()
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))


def test_a_staged_write_without_staged_bits_is_refused():
    m = Tied()
    rep = _replica(m)
    rep.gather("a1", {EMB: POS})
    before = m.model.embed_tokens.weight.detach().clone()
    with pytest.raises(Exception, match="no bits staged"):
        rep.write("a1", {}, staged=True)
    assert torch.equal(m.model.embed_tokens.weight, before)


def test_the_write_does_not_wait_for_a_build_still_running():
    gate = threading.Event()
    m = Tied(gate=gate)
    rep = _replica(m)
    rep.gather("a1", {EMB: POS})
    assert rep.prebuild("a1", {EMB: NEW.view(torch.int32).numpy()}).copies == 2
    try:
        out = rep.write("a1", {}, staged=True)  # the first build is held at the gate
    finally:
        gate.set()
    assert out.ahead == 0 and m.rebuilds == 2  # both rebuilt in the pause, none waited for
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))


def test_a_source_written_under_two_parameter_names_gets_both_writes():
    # two parameter objects over one storage (an alias no dedup by identity catches): the copy
    # built ahead must see the writes made through either name, or it is stale once installed
    from stitch_core.engine import prebuild

    m = Tied()
    w = m.model.proj.weight
    alias = nn.Parameter(w.data, requires_grad=False)
    params = {"model.proj.weight": w, "alias.weight": alias}
    one = (torch.tensor([1]), torch.tensor([7], dtype=torch.int32), torch.float32)
    two = (torch.tensor([5]), torch.tensor([9], dtype=torch.int32), torch.float32)
    jobs, nbytes, _ = prebuild._jobs(m, params, {"model.proj.weight": [one],
                                                 "alias.weight": [two]}, 1 << 20)
    assert len(jobs) == 1 and nbytes == D * D * 4
    assert [e[0].item() for e in jobs[0].writes["weight"]] == [1, 5]
    # a written view of part of the source: not built ahead (rebuilt in the pause)
    params["alias.weight"] = nn.Parameter(w.data.view(-1)[: D], requires_grad=False)
    part = prebuild._jobs(m, params, {"model.proj.weight": [one], "alias.weight": [two]},
                          1 << 20)[0]
    assert [j.dc for j in part] == []


def test_batches_staged_one_by_one_are_built_ahead_together_and_written_in_one_call():
    # an apply over the batch budget: each batch gathered and staged in turn, the last one
    # starting the build over all of them; the write installs copies holding every batch's bits
    m = Tied()
    rep = _replica(m)
    bits = NEW.view(torch.int32).numpy()
    rep.handle(rpc.Gather("a1", {EMB: POS[:2]}, 0))
    first = rep.handle(rpc.Prebuild("a1", {EMB: bits[:2]}, 0, False))
    assert first.copies == 0 and m.builds == []  # staged only
    rep.handle(rpc.Gather("a1", {EMB: POS[2:]}, 1))
    out = rep.handle(rpc.Prebuild("a1", {EMB: bits[2:]}, 1, True))
    while not out.done:
        out = rep.handle(rpc.Prebuild("a1"))
    assert out.copies == 2
    w = rep.handle(rpc.Write("a1", {}, staged=True))
    assert w.ahead == 2 and m.rebuilds == 0
    assert m.model.embed_tokens.weight.reshape(-1)[POS.astype(np.int64)].tolist() == NEW.tolist()
    assert derived.stale(m) == [] and torch.equal(m(IDS), _fresh_output(m))
    assert rep._plans == {} and rep._ahead.values("a1") is None  # let go once written
    rep.commit("a1")


def test_a_batch_staged_for_positions_it_was_not_gathered_with_is_refused_before_the_write():
    m = Tied()
    rep = _replica(m)
    bits = NEW.view(torch.int32).numpy()
    rep.gather("a1", {EMB: POS[:2]}, 0)
    with pytest.raises(Exception, match="3 values for 2 positions"):
        rep.prebuild("a1", {EMB: bits[:3]}, 0, False)
    with pytest.raises(Exception, match="batch 1 without a matching gather"):
        rep.prebuild("a1", {EMB: bits[2:]}, 1, True)
    before = m.model.embed_tokens.weight.detach().clone()
    with pytest.raises(Exception, match="no bits staged"):
        rep.write("a1", {}, staged=True)
    assert torch.equal(m.model.embed_tokens.weight, before)
    # a new apply drops what the last one staged and planned
    rep.prebuild("a1", {EMB: bits[:2]}, 0, False)
    rep.gather("a2", {EMB: POS}, 0)
    assert rep._ahead.values("a1") is None and list(rep._plans) == [0]
