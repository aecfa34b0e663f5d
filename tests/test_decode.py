"""The coordinator's batch decoder (stitch_core.engine.decode): chunks decoded on a thread pool
give the same new bits, the same running fingerprints and the same errors as on one thread."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

import stitch_core
from stitch_core.engine.decode import BatchDecoder
from stitch_core.engine.proof import EngineStateError
from stitch_core.engine.rpc import GatherReply, Held
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import chunk_list
from stitch_core.format.stp import PatchError, PatchReader

SPAN = 4096  # positions per chunk: every tensor below has several


def _pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base, new = {}, {}
    for name, shape in {"a.weight": (96, 400), "b.weight": (30_000,), "c.bias": (333,)}.items():
        w = torch.randn(shape, generator=g) * 0.02
        step = 3e-5 * torch.randn(shape, generator=g).sign()  # an Adam-like step at lr ~3e-5
        base[name] = w.to(torch.bfloat16)
        new[name] = (w - step).to(torch.bfloat16)
    return base, new


def _batch(reader: PatchReader):
    return [(e, chunk_list(reader, e), True) for e in reader.header.tensors if e.changed]


def _gather(plan, base: dict[str, torch.Tensor], ranks: int) -> list[GatherReply]:
    """The old bits of the planned positions, split over `ranks` like TP ranks would hold them
    (rank r: positions r, r + ranks, ...)."""
    replies = []
    for r in range(ranks):
        old = {}
        for name, (pos, _) in plan.items():
            idx = np.arange(r, pos.numel(), ranks)
            bits = dtypes.int_view(base[name]).reshape(-1)[pos[idx]].numpy()
            old[name] = Held(None, bits) if ranks == 1 else Held(idx, bits)
        replies.append(GatherReply(old, 0.0))
    return replies


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("ranks", [1, 2])
def test_threads_decode_the_same_bits(tmp_path, threads, ranks):
    base, new = _pair()
    fps = fpr.state_fingerprints(base)
    patch = stitch_core.diff(base, new, base_fingerprints=fps, chunk_span=SPAN)
    (tmp_path / "p.stp").write_bytes(patch.data)
    with PatchReader(tmp_path / "p.stp") as reader:
        batch = _batch(reader)
        assert {e.name: len(segs) for e, segs, _ in batch} == {"a.weight": 10, "b.weight": 8,
                                                                 "c.bias": 1}
        dec = BatchDecoder(threads)
        plan = dec.positions(batch)
        running: dict[str, int] = {}
        got = dec.values(plan, _gather(plan, base, ranks), running, fps)
    assert set(got) == {n for n in base if not torch.equal(base[n], new[n])}
    for name, bits in got.items():
        pos = plan[name][0]
        assert torch.equal(torch.from_numpy(bits),
                           dtypes.int_view(new[name]).reshape(-1)[pos]), name
        assert fpr.fmt(running[name]) == fpr.fmt(fpr.state_fingerprints(new)[name])


@contextmanager
def _planned(seed: int, threads: int, ranks: int):
    """A patch of `_pair(seed)` read, its positions planned on `threads` threads and the old bits
    gathered from `ranks` ranks: (decoder, plan, replies, base fingerprints)."""
    base, new = _pair(seed)
    fps = fpr.state_fingerprints(base)
    patch = stitch_core.diff(base, new, base_fingerprints=fps, chunk_span=SPAN)
    with PatchReader(patch.data) as reader:
        dec = BatchDecoder(threads)
        plan = dec.positions(_batch(reader))
        yield dec, plan, _gather(plan, base, ranks), fps


@pytest.mark.parametrize("threads", [1, 3])
def test_wrong_old_bits_fail_the_fingerprint_check_on_any_thread_count(threads):
    with _planned(1, threads, 1) as (dec, plan, gathered, fps):
        held = gathered[0].old["b.weight"]
        held.bits[len(held.bits) // 2] ^= 1  # a rank reports one wrong old value mid-tensor
        with pytest.raises(PatchError, match="b.weight: result fingerprint"):
            dec.values(plan, gathered, {}, fps)


def test_positions_no_rank_holds_are_refused():
    with _planned(2, 4, 2) as (dec, plan, gathered, fps):
        gathered = gathered[:1]  # rank 1 did not answer for its half
        with pytest.raises(EngineStateError, match="held by no rank"):
            dec.values(plan, gathered, {}, fps)


def test_a_split_tensor_carries_its_fingerprint_across_batches(tmp_path):
    """A tensor whose chunks span two batches is checked once, with the second batch."""
    base, new = _pair(3)
    fps = fpr.state_fingerprints(base)
    patch = stitch_core.diff(base, new, base_fingerprints=fps, chunk_span=SPAN)
    with PatchReader(patch.data) as reader:
        e = reader.header.tensors[[t.name for t in reader.header.tensors].index("b.weight")]
        segs = chunk_list(reader, e)
        dec, running = BatchDecoder(3), {}
        out = []
        for part, last in ((segs[:3], False), (segs[3:], True)):
            plan = dec.positions([(e, part, last)])
            out.append((plan["b.weight"][0], dec.values(plan, _gather(plan, base, 1), running,
                                                        fps)["b.weight"]))
    assert fpr.fmt(running["b.weight"]) == e.target_fp
    pos = torch.cat([p for p, _ in out])
    bits = torch.from_numpy(np.concatenate([b for _, b in out]))
    assert torch.equal(bits, dtypes.int_view(new["b.weight"]).reshape(-1)[pos])


def test_thread_count_is_capped_by_the_host():
    import os

    assert BatchDecoder(10_000).threads == (os.cpu_count() or 1)
    assert BatchDecoder(0).threads == 1
