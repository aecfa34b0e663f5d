"""Corrupted and forged patches: apply raises PatchError (and nothing else) or, when a mutation is
semantically neutral, returns exactly the target. Never a silent wrong result; in place, a refused
patch leaves the base bitwise intact.

Forged patches carry a recomputed, valid checksum (and valid chunk CRCs where payloads change), so
what must catch them is header validation, bounds checks, the decoders and the fingerprints.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import zlib

import numpy as np
import pytest
import torch

from stitch_core import PatchError, apply, diff
from stitch_core.format import codec, dtypes, entropy
from stitch_core.format import fingerprint as fpr
from stitch_core.format.stp import END_MAGIC, FOOTER, PREAMBLE

SPAN = 512
SPAN1 = 2048
N = 2048
DTYPE_NAMES = [i.name for i in dtypes.INFOS]


# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return dtypes.int_view(t)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def state_equal(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(same(got[k], want[k]) for k in want)


def snapshot(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def split(data: bytes) -> tuple[int, dict]:
    hoff, hlen, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    return hoff, json.loads(data[hoff : hoff + hlen])


def forge(data: bytes, header, extra_payload: bytes = b"") -> bytes:
    """Same payloads (plus extra_payload appended), a new header, a valid footer checksum."""
    hoff, _ = split(data)
    body = data[:hoff] + extra_payload
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = body + blob + struct.pack("<QQ", len(body), len(blob))
    return body + hashlib.blake2b(body, digest_size=32).digest() + END_MAGIC


def with_payload(data: bytes, header: dict, chunk: dict, pos_b: bytes, val_b: bytes) -> bytes:
    """Point `chunk` (a dict inside `header`) at a new payload with a correct CRC."""
    hoff, _ = split(data)
    chunk.update(
        offset=hoff,
        pos_bytes=len(pos_b),
        val_bytes=len(val_b),
        crc32=zlib.crc32(val_b, zlib.crc32(pos_b)),
    )
    return forge(data, header, pos_b + val_b)


def outcome(base: dict, target: dict, data: bytes, what: str, *, inplace: bool = False) -> str:
    """'error' (PatchError, base intact) or 'ok' (exactly the target). Anything else fails."""
    state = snapshot(base)
    try:
        out = apply(state, data, inplace=inplace)
    except PatchError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"{what}: PatchError message not one line: {msg!r}"
        assert state_equal(state, base), f"{what}: base modified by a refused patch ({msg})"
        return "error"
    except Exception as e:  # noqa: BLE001 - any other exception type is a bug
        raise AssertionError(f"{what}: {type(e).__name__} instead of PatchError: {e}") from e
    assert state_equal(out, target), f"{what}: SILENT WRONG RESULT"
    if inplace:
        assert out is state
    return "ok"


# ---------------------------------------------------------------- valid patches


def _ulp_step(t: torch.Tensor, pos: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    info = dtypes.info(t.dtype)
    b = bits(t).to(torch.int64).clone()
    b[pos] = dtypes.from_key(dtypes.to_key(b[pos], info) + step, info)
    return dtypes.from_int(b.to(info.int_dtype), t.dtype, tuple(t.shape))


def build_cases() -> list[tuple[str, dict, dict, bytes]]:
    g = torch.Generator().manual_seed(1234)

    def w(n=N, dtype=torch.bfloat16):
        return (torch.randn(n, generator=g) * 0.02).to(dtype)

    # 1: bf16 ULP family: sparse (gaps), half (bitmap), dense with a sign context (all/ctx);
    # contexts pay for their tables only in long chunks, hence 2 * SPAN1 elements here
    n1 = 2 * SPAN1
    sparse, half, dense = w(n1), w(n1), w(n1)
    base1 = {"sparse": sparse, "half": half, "dense": dense}
    sp = torch.randperm(n1, generator=g)[:60]
    hp = torch.randperm(n1, generator=g)[: n1 // 2]
    db = bits(dense).to(torch.int64)
    new1 = {
        "sparse": _ulp_step(sparse, sp, torch.ones(60, dtype=torch.int64)),
        "half": _ulp_step(half, hp, torch.randint(0, 2, (n1 // 2,), generator=g) * 2 - 1),
        "dense": _ulp_step(dense, torch.arange(n1), (db >= 0).to(torch.int64) * 2 - 1),
    }
    # 2: xor and raw values, 8-byte elements, whole tensors, an unchanged and an empty tensor
    sign = w()
    ints = torch.randint(-100, 100, (N,), generator=g, dtype=torch.int32)
    zp = torch.randperm(N, generator=g)[:40]
    i64 = torch.randint(-(1 << 40), 1 << 40, (N,), generator=g, dtype=torch.int64)
    i64_new = i64.clone()
    i64_new[zp] ^= 1 << 50
    base2 = {
        "sign": sign,
        "ints": ints,
        "rand": w(),
        "i64": i64,
        "same": w(64, torch.float32),
        "removed": torch.randint(-5, 5, (30,), generator=g, dtype=torch.int8),
        "reshaped": w(600, torch.float32).reshape(20, 30),
        "recast": w(100, torch.float16),
    }
    new2 = {
        "sign": (-sign.float()).bfloat16(),
        "ints": ints.clone().index_fill_(0, zp, 0),
        "rand": w(),
        "i64": i64_new,
        "same": base2["same"].clone(),
        "reshaped": base2["reshaped"].reshape(30, 20).clone(),
        "recast": base2["recast"].view(torch.bfloat16).clone(),
        "added": w(700, torch.float8_e4m3fn).reshape(7, 100),
        "added_empty": torch.zeros(0, 5, dtype=torch.float16),
        "added_bool": torch.rand(100, generator=g) < 0.5,
    }
    # 3: a tiny model, one sparse change per dtype that has a ULP or xor form
    base3 = {
        "f8": w(256, torch.float8_e5m2),
        "u8": torch.randint(0, 255, (256,), generator=g, dtype=torch.uint8),
        "f64": w(256, torch.float64),
    }
    new3 = {k: v.clone() for k, v in base3.items()}
    for v in new3.values():
        bits(v)[::37] ^= 3
    return [
        ("ulp", base1, new1, diff(base1, new1, chunk_span=SPAN1, run="r", base_version=1).data),
        ("mixed", base2, new2, diff(base2, new2, chunk_span=SPAN).data),
        ("small", base3, new3, diff(base3, new3, chunk_span=64).data),
    ]


CASES = build_cases()


def test_cases_cover_every_encoding():
    pos, val, ctx, kinds = set(), set(), False, set()
    for _, base, new, data in CASES:
        assert state_equal(apply(base, data), new)
        _, h = split(data)
        for t in h["tensors"]:
            kinds.add((t["kind"], t.get("note")))
            for c in t["chunks"]:
                pos.add(c["pos"])
                val.add(c["val"])
                ctx |= bool(c.get("ctx"))
    assert pos == {"all", "gaps", "bitmap"}
    assert val == {"ulp", "xor", "raw"}
    assert ctx
    assert {("removed", None), ("full", "added"), ("full", "reshaped")} <= kinds
    assert ("full", "dtype changed") in kinds


# ---------------------------------------------------------------- byte-level corruption


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_random_bit_flips(case):
    name, base, target, data = case
    rng = np.random.default_rng(1)
    # everywhere, plus the structured parts: preamble, header, footer
    hoff, _ = split(data)
    spots = list(rng.integers(0, len(data), 150))
    spots += list(range(PREAMBLE.size)) + list(range(len(data) - FOOTER.size, len(data)))
    spots += list(rng.integers(hoff, len(data) - FOOTER.size, 40))
    for i in spots:
        bad = bytearray(data)
        bad[int(i)] ^= 1 << int(rng.integers(0, 8))
        # a changed file can never be the same patch: the checksum must refuse it
        assert outcome(base, target, bytes(bad), f"{name}: flip @{i}") == "error"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_truncation_insertion_deletion(case):
    name, base, target, data = case
    rng = np.random.default_rng(2)
    cuts = {0, 1, PREAMBLE.size, len(data) - 1, len(data) - 8, len(data) - 40, len(data) - 56}
    cuts |= set(rng.integers(0, len(data), 60).tolist())
    for cut in sorted(cuts):
        assert outcome(base, target, data[:cut], f"{name}: truncate {cut}") == "error"
    for _ in range(60):
        i = int(rng.integers(0, len(data) + 1))
        ins = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        assert outcome(base, target, data[:i] + ins + data[i:], f"{name}: insert @{i}") == "error"
        j = int(rng.integers(0, len(data)))
        k = int(rng.integers(1, 9))
        assert outcome(base, target, data[:j] + data[j + k :], f"{name}: delete @{j}") == "error"
    assert outcome(base, target, data + data, f"{name}: doubled") == "error"
    assert outcome(base, target, b"", f"{name}: empty") == "error"


# ---------------------------------------------------------------- forged headers


ABSURD = [
    0, 1, -1, 2, 63, 64, SPAN - 1, SPAN, SPAN + 1, N - 1, N, N + 1, 1 << 24, (1 << 24) + 1,
    1 << 31, 1 << 32, 1 << 40, (1 << 40) + 1, 1 << 60, 1 << 63, 1 << 64, 10**30,
    "7", None, 1.5, True, [], {},
]  # fmt: skip


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(name) -> int | None:
    if not isinstance(name, str):
        return None
    try:
        return dtypes.info(name).itemsize
    except ValueError:
        return None


def mutate(h: dict, rng: np.random.Generator, data: bytes) -> str:
    """One random mutation (see _mutate); a header broken by an earlier one may stop it early."""
    try:
        return _mutate(h, rng, data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        return f"partial mutation ({type(e).__name__})"


def _mutate(h: dict, rng: np.random.Generator, data: bytes) -> str:
    """One random mutation of a header dict in place; returns its description.

    Excluded on purpose (see the known-hole tests at the end): relabelling a whole ('full')
    tensor with a dtype at least as wide (any dtype if it is empty) or a same-size shape, dropping
    an added tensor's entry, and turning a tensor into a valid removal. Those are silent wrong
    results today: apply never checks the header's target_digest and fingerprints bind neither
    dtype nor shape.
    """
    tensors = h.get("tensors")
    if not tensors:  # an earlier mutation removed them all
        return "no-op"
    t = tensors[int(rng.integers(0, len(tensors)))]
    chunks = t.get("chunks") or []
    c = chunks[int(rng.integers(0, len(chunks)))] if chunks else None
    pick = lambda seq: seq[int(rng.integers(0, len(seq)))]  # noqa: E731
    r = int(rng.integers(0, 34))
    if r >= 24:  # plausible mutations that pass header validation: deeper checks must act
        return _mutate_plausible(h, t, c, rng, data, r - 24)
    if r < 7 and c is not None:
        field = pick(["start", "stop", "count", "offset", "pos_bytes", "val_bytes", "crc32"])
        v = c[field]
        new = pick(ABSURD + [v - 1, v + 1, v * 2, v + SPAN, v ^ 1])
        c[field] = new
        return f"{t.get('name')}: chunk {field} {v} -> {new!r}"
    if r == 7 and c is not None:
        new = pick(["all", "gaps", "bitmap", "ulp", "xor", "raw", "", None, 3])
        c["pos"] = new
        return f"{t.get('name')}: chunk pos -> {new!r}"
    if r == 8 and c is not None:
        new = pick(["all", "gaps", "bitmap", "ulp", "xor", "raw", "", None, 3])
        c["val"] = new
        return f"{t.get('name')}: chunk val -> {new!r}"
    if r == 9 and c is not None:
        new = pick(
            [None, [], [0, 1, 0], [0, 12, 1], [120, 12, 0], [0, 33, 0], [0, 0, 0], [-1, 2, 0],
             [1 << 60, 1, 0], [0, 2, 2], [1, 2], [1, 2, 3, 4], "x", [0.5, 2, 0]]
        )  # fmt: skip
        c["ctx"] = new
        return f"{t.get('name')}: chunk ctx -> {new!r}"
    if r == 10 and chunks:
        op = pick(["delete", "duplicate", "swap", "reverse", "move", "extra-field"])
        if op == "delete":
            chunks.pop(int(rng.integers(0, len(chunks))))
        elif op == "duplicate":
            chunks.insert(0, copy.deepcopy(chunks[0]))
        elif op == "swap" and len(chunks) > 1:
            chunks[0], chunks[-1] = chunks[-1], chunks[0]
        elif op == "reverse":
            chunks.reverse()
        elif op == "move":
            other = pick(tensors)
            other.setdefault("chunks", []).append(chunks.pop())
        else:
            chunks[0]["zz"] = 1
        return f"{t.get('name')}: chunks {op}"
    if r == 11:
        is_full = t["kind"] == "full"
        size = _itemsize(t["dtype"])
        choices = [d for d in DTYPE_NAMES + ["XX", "", "bf16", None, 5] if d != t["dtype"]]
        if is_full:  # same-width or wider relabels of whole tensors: a known hole (below)
            empty = _numel(t["shape"]) == 0
            choices = [
                d for d in choices if _itemsize(d) is None or (_itemsize(d) < size and not empty)
            ]
        new = pick(choices)
        t["dtype"] = new
        return f"{t.get('name')}: dtype -> {new!r}"
    if r == 12:
        old = list(t["shape"])
        n = _numel(old)
        choices = [
            [1 << 60], [1 << 30, 1 << 30], [1 << 20, 1 << 21], [n + 1], [n - 1], [-1],
            [1 << 63, 0], [2**64, 0], [-n], [n, -1], [None], "x", [1] * 17, [],
            old[::-1], [n], old + [1],
        ]  # fmt: skip
        if t["kind"] == "full":  # same-size reshapes of whole tensors: a known hole
            choices = [s for s in choices if not _plain_same_numel(s, n)]
        new = pick(choices)
        t["shape"] = new
        return f"{t.get('name')}: shape {old} -> {new!r}"
    if r == 13:
        new = pick(["patch", "full", "removed", "", None])
        old = t["kind"]
        t["kind"] = new
        if new == "removed" and rng.random() < 0.5:  # make it otherwise valid
            t.pop("target_fp", None)
            t["chunks"], t["changed"] = [], 0
            if "base_fp" in t:
                t["kind"] = old  # a valid removal drops the tensor silently: known hole (below)
        return f"{t.get('name')}: kind {old} -> {t['kind']!r}"
    if r == 14:
        field = pick(["base_fp", "target_fp"])
        others = [o.get(field) for o in tensors if o.get(field) and o is not t]
        v = t.get(field)
        new = pick(
            others
            + [None, "0" * 16, "f" * 16, "zz", "F" * 16, "0" * 15, (v or "0" * 16)[::-1]]
            + ([fpr.fmt(fpr.parse(v) ^ (1 << int(rng.integers(0, 64))))] if v else [])
        )
        if new is None:
            t.pop(field, None)
        else:
            t[field] = new
        return f"{t.get('name')}: {field} {v} -> {new!r}"
    if r == 15:
        v = t["changed"]
        new = pick([v - 1, v + 1, 0, 1 << 60, -1, None, "3"])
        t["changed"] = new
        return f"{t.get('name')}: changed {v} -> {new!r}"
    if r == 16:
        names = [o["name"] for o in tensors if o is not t]
        new = pick(names + ["", "\x00", "a\x00b", "x" * 2000, "brand.new", 5, None])
        old = t.get("name")
        t["name"] = new
        return f"{old}: renamed -> {new!r}"
    if r == 17:
        op = pick(["duplicate", "delete", "reverse", "empty", "extra-field"])
        if op == "duplicate":
            tensors.append(copy.deepcopy(t))
        elif op == "delete":
            if t.get("base_fp") is None:  # dropping an added tensor: a known hole (below)
                return "no-op"
            tensors.remove(t)
        elif op == "reverse":
            tensors.reverse()
        elif op == "empty":
            tensors.clear()
        else:
            t["zz"] = 1
        return f"tensors {op} ({t.get('name')})"
    if r == 18:
        t["note"] = pick(["whatever", "added", None, 5])
        return f"{t.get('name')}: note -> {t['note']!r}"
    if r == 19:
        field = pick(["format", "format_version", "created", "producer", "base_digest"])
        new = pick(["stitch-patch", "x", 2, 0, None, "", "2030-01-01"])
        h[field] = new
        return f"{field} -> {new!r}"
    if r == 20:
        field = pick(["run", "base_version", "target_version", "view", "metadata"])
        new = pick([None, "other", 7, -1, {"a": "b"}, {"a": 1}, [], 1.5])
        h[field] = new
        return f"{field} -> {new!r}"
    if r == 21:
        h[pick(["zz", "tensors_", "Run"])] = 1
        return "unknown top-level field"
    if r == 22:
        del h[pick([k for k in h if k not in ("run", "base_version", "metadata")])]
        return "top-level field deleted"
    field = pick([k for k in t if k not in ("note",)])
    del t[field]
    return f"{t.get('name')}: field {field} deleted"


def _mutate_plausible(h: dict, t: dict, c: dict | None, rng, data: bytes, r: int) -> str:
    all_chunks = [cc for tt in h["tensors"] for cc in tt.get("chunks") or []]
    name = t.get("name")
    if c is None:
        return "no-op"
    if r in (0, 1):  # point at another chunk's payload (valid CRC, in bounds)
        o = all_chunks[int(rng.integers(0, len(all_chunks)))]
        keys = ("offset", "pos_bytes", "val_bytes", "crc32") + (("pos", "val", "ctx") if r else ())
        for k in keys:
            if k in o:
                c[k] = o[k]
            else:
                c.pop(k, None)
        return f"{name}[{c['start']}]: payload of another chunk (r={r})"
    if r == 2:  # shift the window over the file, CRC recomputed
        d = int(rng.integers(-8, 9))
        split_d = int(rng.integers(-3, 4))
        off, pb, vb = c["offset"] + d, c["pos_bytes"] + split_d, c["val_bytes"] - split_d
        if min(off, pb, vb) < 0:
            return "no-op"
        c.update(
            offset=off, pos_bytes=pb, val_bytes=vb, crc32=zlib.crc32(data[off : off + pb + vb])
        )
        return f"{name}[{c['start']}]: window shifted by {d}, split by {split_d}"
    if r == 3:  # count and changed moved together
        d = int(rng.choice([-1, 1]))
        c["count"] += d
        t["changed"] += d
        return f"{name}[{c['start']}]: count and changed {d:+d}"
    if r == 4:
        c["pos"] = pick_str(rng, ["all", "gaps", "bitmap"])
        c["val"] = pick_str(rng, ["ulp", "xor", "raw"])
        return f"{name}[{c['start']}]: relabelled {c['pos']}+{c['val']}"
    if r == 5:  # a valid but different value context
        ctx = list(c.get("ctx") or [int(rng.integers(0, 200)), int(rng.integers(1, 33)), 0])
        i = int(rng.integers(0, 3))
        alt = [max(0, ctx[0] + int(rng.choice([-1, 1]))), int(rng.integers(1, 33)), 1 - ctx[2]]
        ctx[i] = alt[i]
        c["ctx"] = ctx
        return f"{name}[{c['start']}]: ctx -> {ctx}"
    if r == 6 and t["kind"] == "patch":  # move the chunk to a span nobody covers
        numel = _numel(t["shape"])
        span = c["stop"] - c["start"]
        used = {cc["start"] for cc in t["chunks"]}
        free = [s for s in range(0, numel - span + 1, span) if s not in used]
        if not free:
            return "no-op"
        c["start"] = pick_str(rng, free)
        c["stop"] = c["start"] + span
        t["chunks"].sort(key=lambda cc: cc["start"])
        return f"{name}: chunk moved to {c['start']}"
    if r == 7:  # widen or narrow the span
        d = int(rng.choice([-64, -1, 1, 64, 512]))
        c["stop"] += d
        return f"{name}[{c['start']}]: stop {d:+d}"
    if r == 8:  # payload of another tensor's chunk with the same count, relabelled with it
        same = [o for o in all_chunks if o["count"] == c["count"] and o is not c]
        if not same:
            return "no-op"
        o = same[int(rng.integers(0, len(same)))]
        for k in ("offset", "pos_bytes", "val_bytes", "crc32", "pos", "val"):
            c[k] = o[k]
        return f"{name}[{c['start']}]: same-count payload swapped in"
    # base_fp and target_fp of the same entry exchanged
    if "base_fp" in t and "target_fp" in t:
        t["base_fp"], t["target_fp"] = t["target_fp"], t["base_fp"]
        return f"{name}: base_fp <-> target_fp"
    return "no-op"


def pick_str(rng, seq):
    return seq[int(rng.integers(0, len(seq)))]


def _plain_same_numel(s, n: int) -> bool:
    return (
        isinstance(s, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
        and _numel(s) == n
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forged_header_mutations(case):
    name, base, target, data = case
    _, h0 = split(data)
    rng = np.random.default_rng(3)
    seen = {"error": 0, "ok": 0}
    for i in range(200):
        h = copy.deepcopy(h0)
        whats = [mutate(h, rng, data) for _ in range(1 + int(rng.integers(0, 2)))]
        what = f"{name}#{i}: " + "; ".join(whats)
        seen[outcome(base, target, forge(data, h), what, inplace=i % 3 == 0)] += 1
    assert seen["error"] > 100  # most mutations are refused (the rest must be neutral)


def test_forged_non_object_headers():
    name, base, target, data = CASES[0]
    blobs = [
        b"", b"null", b"[]", b"5", b'"x"', b"{", b"\xff\xfe", b"{}", b"[" * 50 + b"]" * 50,
        json.dumps({"tensors": []}).encode(), b'{"a": NaN}', b"\x00" * 10,
    ]  # fmt: skip
    for blob in blobs:
        assert outcome(base, target, forge(data, blob), f"header {blob[:20]!r}") == "error"


def test_forged_deeply_nested_header():
    """json.loads raises RecursionError (not ValueError) on deep nesting: must be a PatchError."""
    name, base, target, data = CASES[0]
    for blob in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        assert outcome(base, target, forge(data, blob), "deep JSON") == "error"


def _entry(h: dict, name: str) -> dict:
    return next(t for t in h["tensors"] if t["name"] == name)


ENTRY_FORGERIES = [
    # (tensor, field, value): each must be refused
    *[(t, "shape", [1 << 60]) for t in ("ints", "added", "added_empty", "removed", "reshaped")],
    *[(t, "shape", [1 << 30] * 3) for t in ("ints", "added", "added_empty", "reshaped")],
    *[(t, "changed", 1 << 60) for t in ("ints", "added", "added_empty", "removed", "reshaped")],
    *[(t, "shape", [1 << 63, 0]) for t in ("ints", "added", "reshaped")],
    *[(t, "shape", [2**64, 0]) for t in ("ints", "added", "reshaped")],
    ("added_empty", "shape", [1 << 63, 0]),  # numel 0, but no tensor can have that shape
    ("added_empty", "shape", [2**64, 0]),
    *[(t, "dtype", "XX") for t in ("ints", "added", "added_empty", "reshaped")],
    *[(t, "dtype", "") for t in ("ints", "added", "reshaped")],
    ("ints", "dtype", "F64"),
    ("ints", "dtype", "F32"),  # same width as I32
    ("reshaped", "dtype", "BF16"),  # narrower than its raw values
    ("ints", "kind", "full"),
    ("removed", "kind", "full"),
    ("added", "kind", "patch"),
    ("added", "kind", "removed"),
]


@pytest.mark.parametrize(
    "tensor,field,value",
    ENTRY_FORGERIES,
    ids=[f"{t}.{f}={v!r}"[:40] for t, f, v in ENTRY_FORGERIES],
)
def test_forged_entry_absurd_values(tensor, field, value):
    name, base, target, data = CASES[1]
    _, h = split(data)
    _entry(h, tensor)[field] = value
    desc = f"{tensor}.{field} = {value!r}"
    assert outcome(base, target, forge(data, h), desc) == "error"


def test_forged_removed_entry_metadata_is_neutral_or_refused():
    """A removed tensor's dtype/shape are informational: relabelling them may pass, but the
    result must then still be the target."""
    name, base, target, data = CASES[1]
    for field, value in (
        ("dtype", "F64"),
        ("shape", [6, 5]),
        ("dtype", "XX"),
        ("shape", [2**64, 0]),
    ):
        _, h = split(data)
        _entry(h, "removed")[field] = value
        outcome(base, target, forge(data, h), f"removed.{field} = {value!r}")


@pytest.mark.parametrize(
    "field,value",
    [
        ("stop", N + 1),
        ("stop", 1 << 60),
        ("start", 1 << 60),
        ("count", 1 << 60),
        ("count", SPAN + 1),
        ("offset", 1 << 60),
        ("offset", 0),
        ("pos_bytes", 1 << 60),
        ("val_bytes", 1 << 62),
        ("crc32", 1 << 32),
    ],
)
def test_forged_chunk_absurd_values(field, value):
    name, base, target, data = CASES[1]
    _, h = split(data)
    for tname in ("ints", "added", "sign", "i64"):
        hh = copy.deepcopy(h)
        _entry(hh, tname)["chunks"][-1][field] = value
        desc = f"{tname}: last chunk {field} = {value!r}"
        assert outcome(base, target, forge(data, hh), desc) == "error"


def test_swapped_target_fingerprints():
    for name, base, target, data in CASES:
        _, h = split(data)
        live = [t for t in h["tensors"] if t.get("target_fp")]
        for a, b in zip(live, live[1:], strict=False):
            if a["target_fp"] == b["target_fp"]:
                continue
            hh = copy.deepcopy(h)
            ea, eb = _entry(hh, a["name"]), _entry(hh, b["name"])
            ea["target_fp"], eb["target_fp"] = eb["target_fp"], ea["target_fp"]
            what = f"{name}: swap target_fp {a['name']}/{b['name']}"
            assert outcome(base, target, forge(data, hh), what, inplace=True) == "error"


def test_every_single_fingerprint_bit_matters():
    name, base, target, data = CASES[0]
    _, h = split(data)
    for t in h["tensors"]:
        for field in ("base_fp", "target_fp"):
            for bit in (0, 31, 32, 63):
                hh = copy.deepcopy(h)
                e = _entry(hh, t["name"])
                e[field] = fpr.fmt(fpr.parse(e[field]) ^ (1 << bit))
                what = f"{t['name']}.{field} bit {bit}"
                assert outcome(base, target, forge(data, hh), what, inplace=True) == "error"


# ---------------------------------------------------------------- forged payloads (valid CRCs)


def _chunks_of(data: bytes):
    """(entry, chunk, pos_bytes, val_bytes) for every chunk of a patch."""
    _, h = split(data)
    for t in h["tensors"]:
        for c in t["chunks"]:
            p = data[c["offset"] : c["offset"] + c["pos_bytes"]]
            v = data[c["offset"] + c["pos_bytes"] : c["offset"] + c["pos_bytes"] + c["val_bytes"]]
            yield t, c, p, v


def _ctx_vec(t: dict, c: dict, base: dict, pos: np.ndarray):
    if not c.get("ctx"):
        return None
    dt = dtypes.info(t["dtype"])
    old = bits(base[t["name"]]).to(torch.int64)[torch.from_numpy(pos)].numpy()
    return codec.Context.from_list(c["ctx"]).of(old, dt)


def _positions(c: dict, pb: bytes) -> np.ndarray:
    return codec.decode_positions(c["pos"], pb, c["start"], c["stop"], c["count"])


def _payload_variants(case):
    """(description, forged patch, must_fail) for re-encoded chunk payloads."""
    name, base, target, data = case
    out = []
    for i, (t, c, pb, vb) in enumerate(_chunks_of(data)):
        _, h = split(data)
        pos = _positions(c, pb) if t["kind"] == "patch" else np.arange(c["start"], c["stop"])
        cvec = _ctx_vec(t, c, base, pos) if t["kind"] == "patch" else None
        n_ctx = codec.Context.from_list(c["ctx"]).count if c.get("ctx") else 1
        u = entropy.decode(vb, c["count"], cvec)
        tag = f"{name}/{t['name']}[{c['start']}:{c['stop']}] {c['pos']}+{c['val']}"

        # one value off by one (or one bit): a different result, so it must be refused
        j = i % u.size
        for delta_name, u2 in (("+1", u.copy()), ("^1", u.copy())):
            if delta_name == "+1":
                u2[j] = u2[j] + np.uint64(1)
            else:
                u2[j] ^= np.uint64(1)
            vb2 = entropy.encode(u2, cvec, n_ctx)
            hh = copy.deepcopy(h)
            cc = _entry(hh, t["name"])["chunks"][t["chunks"].index(c)]
            out.append((f"{tag}: value {delta_name}", with_payload(data, hh, cc, pb, vb2), True))

        # one position moved to an unchanged neighbour: the old one is left unpatched
        if t["kind"] == "patch" and c["count"] < c["stop"] - c["start"]:
            free = np.setdiff1d(np.arange(c["start"], c["stop"]), pos)
            pos2 = np.sort(np.concatenate([np.delete(pos, j % pos.size), free[:1]]))
            penc, pb2 = codec.encode_positions(pos2, c["start"], c["stop"])
            cvec2 = _ctx_vec(t, c, base, pos2)
            vb2 = entropy.encode(u, cvec2, n_ctx) if cvec2 is not None else vb
            hh = copy.deepcopy(h)
            cc = _entry(hh, t["name"])["chunks"][t["chunks"].index(c)]
            cc["pos"] = penc
            out.append((f"{tag}: position moved", with_payload(data, hh, cc, pb2, vb2), True))

        # the same content, re-encoded differently: raw values, bitmap positions -> neutral
        tgt = bits(target[t["name"]]).to(torch.int64)[torch.from_numpy(pos)]
        dt = dtypes.info(t["dtype"])
        raw = codec.values_for("raw", None, tgt, dt)
        pb3 = pb
        pos_enc = c["pos"]
        if t["kind"] == "patch":
            mask = np.zeros(c["stop"] - c["start"], dtype=np.uint8)
            mask[pos - c["start"]] = 1
            pb3, pos_enc = np.packbits(mask, bitorder="little").tobytes(), "bitmap"
        hh = copy.deepcopy(h)
        cc = _entry(hh, t["name"])["chunks"][t["chunks"].index(c)]
        cc.update(val="raw", pos=pos_enc)
        cc.pop("ctx", None)
        out.append(
            (
                f"{tag}: re-encoded raw/bitmap",
                with_payload(data, hh, cc, pb3, entropy.encode(raw)),
                False,
            )
        )

        # garbage of a plausible size, with a valid CRC
        rng = np.random.default_rng(i)
        junk = rng.integers(0, 256, len(pb) + len(vb), dtype=np.uint8).tobytes()
        hh = copy.deepcopy(h)
        cc = _entry(hh, t["name"])["chunks"][t["chunks"].index(c)]
        out.append(
            (f"{tag}: garbage", with_payload(data, hh, cc, junk[: len(pb)], junk[len(pb) :]), True)
        )
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reencoded_payloads(case):
    name, base, target, data = case
    variants = _payload_variants(case)
    assert len(variants) > 10
    for k, (what, forged, must_fail) in enumerate(variants):
        got = outcome(base, target, forged, what, inplace=k % 2 == 0)
        if must_fail:
            assert got == "error", f"{what}: a different payload was accepted"
        else:
            assert got == "ok", f"{what}: an equivalent re-encoding was refused"


def test_swapped_chunk_payloads():
    """Two chunks of a tensor with the same count trade payloads (CRCs stay valid). Usually
    refused; accepted only when neutral, e.g. streams whose contexts each hold a single token
    (then any context sequence decodes to the same, correct, deltas)."""
    keys = ("offset", "pos_bytes", "val_bytes", "crc32", "pos", "val", "ctx")
    seen = {"error": 0, "ok": 0}
    for name, base, target, data in CASES:
        _, h = split(data)
        for t in h["tensors"]:
            for i, (a, b) in enumerate(zip(t["chunks"], t["chunks"][1:], strict=False)):
                if a["count"] != b["count"]:
                    continue
                hh = copy.deepcopy(h)
                ca, cb = _entry(hh, t["name"])["chunks"][i : i + 2]
                for k in keys:
                    ca[k], cb[k] = cb.get(k), ca.get(k)
                for cc in (ca, cb):
                    if cc["ctx"] is None:
                        del cc["ctx"]
                what = f"{name}: swap payloads {t['name']} {i}/{i + 1}"
                seen[outcome(base, target, forge(data, hh), what, inplace=True)] += 1
    assert seen["error"] >= 10


# ---------------------------------------------------------------- known holes (target digest)


def _relabel_case(field: str, value):
    name, base, target, data = CASES[1]
    _, h = split(data)
    _entry(h, "added")[field] = value
    return base, target, forge(data, h)


def test_forged_same_width_dtype_of_whole_tensor_is_refused():
    """'added' is F8_E4M3; relabelled I8 (or F8_E5M2/U8) its fingerprint still matches, because
    fingerprints hash integer bits only. The header's target_digest covers the dtype, but apply
    never checks it: the result silently has the wrong dtype."""
    for dt in ("I8", "F8_E5M2", "U8"):
        base, target, forged = _relabel_case("dtype", dt)
        assert outcome(base, target, forged, f"added.dtype -> {dt}") == "error"


def test_forged_wider_dtype_of_whole_tensor_is_refused():
    """Widening works too: raw 8-bit values decode into I16/F32/F64 elements whose hash input is
    the same unsigned value, so the fingerprint still matches."""
    for dt in ("I16", "F32", "F64", "I64"):
        base, target, forged = _relabel_case("dtype", dt)
        assert outcome(base, target, forged, f"added.dtype -> {dt}") == "error"


def test_forged_dtype_or_shape_of_empty_whole_tensor_is_refused():
    """An empty tensor's fingerprint is 0 whatever its dtype or shape."""
    name, base, target, data = CASES[1]
    for field, value in (("dtype", "F64"), ("dtype", "BOOL"), ("shape", [5, 0, 3]), ("shape", [0])):
        _, h = split(data)
        _entry(h, "added_empty")[field] = value
        assert outcome(base, target, forge(data, h), f"added_empty.{field} -> {value}") == "error"


def test_forged_same_size_shape_of_whole_tensor_is_refused():
    for shape in ([100, 7], [700], [7, 10, 10]):
        base, target, forged = _relabel_case("shape", shape)
        assert outcome(base, target, forged, f"added.shape -> {shape}") == "error"


def test_forged_dropped_added_tensor_is_refused():
    name, base, target, data = CASES[1]
    _, h = split(data)
    h["tensors"] = [t for t in h["tensors"] if t["name"] != "added"]
    assert outcome(base, target, forge(data, h), "entry 'added' dropped") == "error"


def test_forged_patch_turned_into_removal_is_refused():
    name, base, target, data = CASES[1]
    _, h = split(data)
    e = _entry(h, "ints")
    e.update(kind="removed", chunks=[], changed=0)
    del e["target_fp"]
    assert outcome(base, target, forge(data, h), "ints turned into a removal") == "error"
