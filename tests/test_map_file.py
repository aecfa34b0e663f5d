"""`stitch_core.format.checkpoint.map_file`: a safetensors file's tensors as views of one mapping
of it (read-only or shared), and the header checks that keep a lying header from placing a
tensor outside the file, over another tensor, or misaligned."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from stitch_core.format.checkpoint import CheckpointError, map_file, populate_writable


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(16, 8, generator=g).bfloat16(),
            "b.bias": torch.randn(5, generator=g),
            "c.idx": torch.arange(7, dtype=torch.int64),
            "d.flag": torch.tensor([True, False, True]),
            "e.empty": torch.zeros(0, 4)}


def test_the_mapping_reads_what_safetensors_reads(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), p)
    got = map_file(p)
    want = load_file(p)
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t)


def test_a_shared_mapping_writes_the_file_and_a_private_one_does_not(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), p)
    private = map_file(p)
    private["c.idx"][0] = 99
    assert load_file(p)["c.idx"][0] == 0
    shared = map_file(p, writable=True)
    populate_writable(shared)  # bytes unchanged
    assert torch.equal(load_file(p)["a.weight"], tensors()["a.weight"])
    shared["a.weight"][3, 2] = 7.0
    shared["c.idx"][6] = -1
    back = load_file(p)
    assert back["a.weight"][3, 2] == 7.0 and back["c.idx"][6] == -1
    assert torch.equal(back["b.bias"], tensors()["b.bias"])


def _rewrite(p, edit) -> None:
    """Rewrite `p`'s header through `edit(header dict)` (space-padded to 8 bytes, as
    safetensors writes it)."""
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head.setdefault("__metadata__", {})
    edit(head)
    raws = {}
    for k, v in head["__metadata__"].items():  # raw JSON text (too deep for json.dumps)
        if isinstance(v, _Raw):
            raws[k], head["__metadata__"][k] = str(v), f"@raw-{k}@"
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # a hostile header may hold integers Python refuses to print
    try:
        new = json.dumps(head)
    finally:
        sys.set_int_max_str_digits(limit)
    for k, v in raws.items():
        new = new.replace(f'"@raw-{k}@"', v)
    new = new.encode()
    new = new.ljust(-(-len(new) // 8) * 8)
    p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


LIES = {
    "size differs from shape": lambda h: h["a.weight"].__setitem__("shape", [16, 9]),
    "overlapping": lambda h: h["b.bias"].__setitem__(  # over c.idx, aligned, right size
        "data_offsets", [h["c.idx"]["data_offsets"][0], h["c.idx"]["data_offsets"][0] + 20]),
    "unknown dtype": lambda h: h["b.bias"].__setitem__("dtype", "Q7"),
    "negative dimension": lambda h: h["e.empty"].__setitem__("shape", [-1, 0]),
    "no offsets": lambda h: h["d.flag"].pop("data_offsets"),
    # hostile numbers: not integers, or integers no tensor has
    "infinite dimension": lambda h: h["a.weight"].__setitem__("shape", [float("inf"), 8]),
    "float dimension": lambda h: h["a.weight"].__setitem__("shape", [16.0, 8]),
    "bool dimension": lambda h: h["d.flag"].__setitem__("shape", [True, 3]),
    "string offset": lambda h: h["c.idx"].__setitem__(
        "data_offsets", [str(x) for x in h["c.idx"]["data_offsets"]]),
    "5000-digit dimension": lambda h: h["e.empty"].__setitem__("shape", [10**5000, 0]),
    "dimension past int64": lambda h: h["e.empty"].__setitem__("shape", [2**63, 0]),
    "strides past int64": lambda h: h["e.empty"].__setitem__("shape", [2**40, 2**40, 0]),
    "deeply nested": lambda h: h["__metadata__"].__setitem__("x", _nested(100_000)),
}


def _nested(depth: int) -> object:
    """A JSON value nested `depth` lists deep (json.dumps recurses: built as raw text below)."""
    return _Raw("[" * depth + "]" * depth)


class _Raw(str):
    """Text spliced into the rewritten header as it is (see _rewrite)."""


@pytest.mark.parametrize("lie", LIES)
def test_a_header_that_lies_is_refused(tmp_path, lie):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), p)
    _rewrite(p, LIES[lie])
    with pytest.raises(CheckpointError):
        map_file(p, writable=True)


def test_a_tensor_past_the_end_of_a_truncated_file_is_refused(tmp_path):
    """Sizes and offsets agree with each other; the file lacks its last bytes."""
    p = tmp_path / "m.safetensors"
    save_file(tensors(), p)
    p.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="does not lie in the file"):
        map_file(p)


def test_a_misaligned_tensor_is_refused(tmp_path):
    """One float32 tensor of the right size, inside the file, overlapping nothing, at an offset
    that is not a multiple of 4 from the file's start."""
    head = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()
    head = head.ljust(-(-len(head) // 8) * 8)
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head + bytes(9))
    with pytest.raises(CheckpointError, match="does not lie in the file"):
        map_file(p)
    head2 = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    head2 = head2.ljust(-(-len(head2) // 8) * 8)
    p.write_bytes(struct.pack("<Q", len(head2)) + head2 + bytes(9))
    assert map_file(p)["x"].tolist() == [0.0, 0.0]  # the same file, aligned: mapped


@pytest.mark.parametrize("raw", [b"", b"\x05\x00", struct.pack("<Q", 1 << 40) + b"{}",
                                 struct.pack("<Q", 4) + b"[1] ", struct.pack("<Q", 3) + b"\xff{}"])
def test_not_a_safetensors_file(tmp_path, raw):
    p = tmp_path / "m.safetensors"
    p.write_bytes(raw)
    with pytest.raises(CheckpointError):
        map_file(p)
