"""The rank write's fused CPU kernel (stitch_core.engine.scatter) against torch's own steps."""

from __future__ import annotations

import pytest
import torch

from stitch_core.engine import scatter
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr


@pytest.mark.parametrize("order", ["rising", "shuffled"])  # one pass / write all, then read back
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                   torch.float8_e4m3fn])
def test_write_read_back_sum_equals_index_put_then_hash(dtype, order):
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(5000, generator=g).to(dtype)
    ref = flat.clone()
    eng = torch.randperm(5000, generator=g)[:700]
    if order == "rising":
        eng = eng.sort().values
    hpos = eng * 3 + 11  # HF positions need not equal engine positions
    new = dtypes.int_view(torch.randn(700, generator=g).to(dtype))
    assert scatter.fused(flat, dtype, eng)
    got = scatter.write_read_back_sum("t", flat, eng, new, hpos)
    dtypes.int_view(ref).index_put_((eng,), new)
    assert torch.equal(dtypes.int_view(flat), dtypes.int_view(ref))
    itemsize = dtypes.info(dtype).itemsize
    assert got == fpr.sum_at("t", hpos, dtypes.int_view(ref)[eng], itemsize)


def test_the_sum_is_of_what_is_there_after_every_write():
    # two writes to one engine position (a layout that maps two HF elements onto one engine
    # element): the later write wins and both read-backs hash it, not what each meant to write
    flat = torch.zeros(10, dtype=torch.bfloat16)
    eng = torch.tensor([4, 4])
    hpos = torch.tensor([0, 1])
    new = dtypes.int_view(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    got = scatter.write_read_back_sum("t", flat, eng, new, hpos)
    there = dtypes.int_view(torch.tensor([2.0, 2.0], dtype=torch.bfloat16))
    assert got == fpr.sum_at("t", hpos, there, 2)
    assert got != fpr.sum_at("t", hpos, new, 2)


def test_a_later_write_over_an_earlier_element_shows_whatever_the_order():
    # positions that fall and rise again (5, 2, 5): not rising, so the read-back is a second pass
    flat = torch.zeros(10, dtype=torch.bfloat16)
    eng = torch.tensor([5, 2, 5])
    hpos = torch.tensor([0, 1, 2])
    new = dtypes.int_view(torch.tensor([1.0, 3.0, 2.0], dtype=torch.bfloat16))
    got = scatter.write_read_back_sum("t", flat, eng, new, hpos)
    there = dtypes.int_view(torch.tensor([2.0, 3.0, 2.0], dtype=torch.bfloat16))
    assert got == fpr.sum_at("t", hpos, there, 2) != fpr.sum_at("t", hpos, new, 2)


@pytest.mark.parametrize("bad", [-1, 10, 1 << 40])
def test_out_of_range_positions_write_nothing(bad):
    flat = torch.zeros(10, dtype=torch.bfloat16)
    eng = torch.tensor([1, bad, 3])
    new = dtypes.int_view(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out of range"):
        scatter.write_read_back_sum("t", flat, eng, new, torch.arange(3))
    assert not flat.any()


def test_mismatched_lengths_are_refused():
    flat = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="positions"):
        scatter.write_read_back_sum("t", flat, torch.tensor([1, 2]),
                                    dtypes.int_view(torch.ones(3, dtype=torch.bfloat16)),
                                    torch.tensor([1, 2]))


def test_only_cpu_tensors_of_the_served_dtype_take_the_fused_path():
    eng = torch.tensor([0])
    assert not scatter.fused(torch.zeros(4, dtype=torch.float32), torch.bfloat16, eng)
    assert not scatter.fused(torch.zeros(8)[::2], torch.float32, eng)  # strided: a copy
    assert scatter.fused(torch.zeros(4), torch.float32, eng)
