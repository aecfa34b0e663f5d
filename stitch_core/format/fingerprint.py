"""Fingerprints: a bitwise proof of a tensor's content that any partition of it can compute.

    F(tensor) = sum over flat positions i of h(seed, i, bits_i)   (mod 2^64)

* seed = CRC-32 of the tensor's name (UTF-8), so swapped tensors do not verify.
* h is built from `mix32`, a 32-bit bijective mixer (x ^= x>>16; x *= 0x45D9F3B; twice; x ^= x>>16,
  all mod 2^32). Its multiplier is below 2^27, so every product fits in a signed 64-bit integer:
  the same int64 tensor ops give the same result on CPU and GPU, in torch and in numpy.
* a = mix32(lo32(i) ^ seed) ^ mix32(hi32(i))    (the second term only when hi32(i) != 0)
  b = bits as an unsigned integer of the element's width; 8-byte elements fold to lo32 ^ mix32(hi32)
  h = mix32(a ^ b)

Because F is a sum it is decomposable (shards and TP ranks sum the positions they hold and the
partial sums add up) and incremental (a patch moves F by sum h(i, new) - h(i, old) over the changed
positions). For elements of at most 4 bytes a single changed element always changes F (mix32 is
a bijection; 8-byte elements are folded to 32 bits first); for random corruption of several
elements a collision has probability about 2^-32. F is for state integrity against
accidents and bugs, not against an adversary: signatures cover that.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from stitch_core._jit import MIX_MUL, SUM32_BLOCK, numba, sum32_block
from stitch_core.format import dtypes

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
_MUL = MIX_MUL  # one owner: stitch_core._jit, which emits the same mixer in LLVM IR
_BLOCK = 1 << 22  # elements hashed per step, bounds temporary memory


def seed_of(name: str) -> int:
    """The seed of tensor `name`: CRC-32 of its UTF-8 bytes."""
    return zlib.crc32(name.encode("utf-8")) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit mixer on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL) & MASK32
    return x ^ (x >> 16)


def _bits32(sbits: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize < 8:
        return dtypes.unsigned(sbits, itemsize)
    b = sbits.to(torch.int64)
    return (b & MASK32) ^ mix32((b >> 32) & MASK32)


def element_hash(
    positions: torch.Tensor, sbits: torch.Tensor, itemsize: int, seed: int
) -> torch.Tensor:
    """h(seed, i, bits) for int64 positions and integer bits (same length); int64 in [0, 2^32)."""
    pos = positions.to(torch.int64)
    a = mix32((pos & MASK32) ^ seed)
    hi = pos >> 32
    if bool((hi != 0).any()):
        a = a ^ torch.where(hi != 0, mix32(hi & MASK32), torch.zeros_like(hi))
    return mix32(a ^ _bits32(sbits, itemsize))


def partial_sum(positions: torch.Tensor, sbits: torch.Tensor, itemsize: int, seed: int) -> int:
    """Sum of h over the given positions (mod 2^64). Positions need not be contiguous."""
    total = 0
    for s in range(0, positions.numel(), _BLOCK):
        h = element_hash(positions[s : s + _BLOCK], sbits[s : s + _BLOCK], itemsize, seed)
        total += int(h.sum())
    return total & MASK64


@numba.njit(cache=True, nogil=True)
def _mix(x):  # pragma: no cover - compiled
    x ^= x >> 16
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@numba.njit(cache=True, nogil=True, inline="always")
def _h(pos, b, seed, itemsize):  # pragma: no cover - compiled
    a = _mix((pos & 0xFFFFFFFF) ^ seed)
    hi = pos >> 32
    if hi != 0:
        a ^= _mix(hi & 0xFFFFFFFF)
    if itemsize < 8:
        b &= (np.int64(1) << (8 * itemsize)) - 1
    else:
        b = (b & 0xFFFFFFFF) ^ _mix((b >> 32) & 0xFFFFFFFF)
    return np.uint64(_mix(a ^ b))


# h for numba kernels elsewhere that fold a fingerprint into a pass they make anyway (the
# codec's compare and apply passes), so that no object is hashed twice
element_hash_nb = _h


@numba.njit(cache=True, nogil=True)
def _sum_cpu(bits, offset, seed, itemsize):  # pragma: no cover - compiled
    """The same sum as the torch path, one pass, for CPU tensors (int views as numpy)."""
    n = bits.shape[0]
    acc = np.uint64(0)
    if itemsize < 8 and offset + n <= 0x100000000:
        # every position below 2^32 and every item at most 4 bytes: h has no branch left, and
        # sum32_block runs it in 32-bit vector lanes (stitch_core._jit)
        mask = (np.int64(1) << (8 * itemsize)) - 1
        for s in range(0, n, SUM32_BLOCK):
            c = min(SUM32_BLOCK, n - s)
            acc += np.uint64(sum32_block(bits, s, c, offset + s, seed, mask))
        return acc
    for j in range(n):
        acc += _h(np.int64(offset + j), np.int64(bits[j]), seed, itemsize)
    return acc


@numba.njit(cache=True, nogil=True)
def _delta_cpu(pos, old, new, seed, itemsize):  # pragma: no cover - compiled
    """sum h(i, new) - h(i, old) over positions, mod 2^64."""
    acc = np.uint64(0)
    for j in range(pos.shape[0]):
        p = np.int64(pos[j])
        acc += _h(p, np.int64(new[j]), seed, itemsize)
        acc -= _h(p, np.int64(old[j]), seed, itemsize)
    return acc


@numba.njit(cache=True, nogil=True)
def _psum_cpu(pos, bits, seed, itemsize):  # pragma: no cover - compiled
    """sum h(pos[j], bits[j]) over scattered positions, mod 2^64."""
    acc = np.uint64(0)
    for j in range(pos.shape[0]):
        acc += _h(np.int64(pos[j]), np.int64(bits[j]), seed, itemsize)
    return acc


def sum_at(name: str, positions: torch.Tensor, sbits: torch.Tensor, itemsize: int) -> int:
    """Partial fingerprint of `name` over scattered flat positions holding integer bits `sbits`."""
    seed = seed_of(name)
    if positions.device.type == "cpu" and sbits.device.type == "cpu":
        return int(_psum_cpu(positions.numpy(), sbits.numpy(), seed, itemsize)) & MASK64
    return partial_sum(positions, sbits, itemsize, seed)


def fingerprint(name: str, t: torch.Tensor, offset: int = 0) -> int:
    """Fingerprint of a whole tensor, or of a contiguous flat slice starting at `offset`."""
    dt = dtypes.info(t.dtype)
    flat = dtypes.int_view(t)
    seed = seed_of(name)
    if flat.device.type == "cpu":
        return int(_sum_cpu(flat.numpy(), offset, seed, dt.itemsize)) & MASK64
    return fingerprint_torch(flat, dt.itemsize, seed, offset)


def fingerprint_torch(flat: torch.Tensor, itemsize: int, seed: int, offset: int = 0) -> int:
    """Device-agnostic path (integer torch ops); used on accelerators and to cross-check."""
    total = 0
    for s in range(0, flat.numel(), _BLOCK):
        chunk = flat[s : s + _BLOCK]
        pos = torch.arange(offset + s, offset + s + chunk.numel(), device=flat.device)
        total += int(element_hash(pos, chunk, itemsize, seed).sum())
    return total & MASK64


def update(
    fp: int, name: str, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, itemsize: int
) -> int:
    """Incremental fingerprint after the bits at `positions` went from `old` to `new`."""
    seed = seed_of(name)
    if positions.device.type == "cpu":
        delta = int(_delta_cpu(positions.numpy(), old.numpy(), new.numpy(), seed, itemsize))
    else:
        delta = partial_sum(positions, new, itemsize, seed) - partial_sum(
            positions, old, itemsize, seed
        )
    return (fp + delta) & MASK64


def fmt(fp: int) -> str:
    """A fingerprint as 16 lower-case hex digits."""
    return f"{fp & MASK64:016x}"


def digest(entries: Iterable[tuple[str, str, tuple[int, ...], int]]) -> str:
    """Digest of a whole version: BLAKE2b-256 over sorted lines `name dtype shape fp`."""
    h = hashlib.blake2b(digest_size=32)
    for name, dtype, shape, fp in sorted(entries):
        h.update(f"{name}\t{dtype}\t{','.join(map(str, shape))}\t{fmt(fp)}\n".encode())
    return h.hexdigest()


def state_fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """{name: fingerprint} of every tensor."""
    return {name: fingerprint(name, t) for name, t in tensors.items()}


def parse(s: str) -> int:
    """A fingerprint from its hex form (the inverse of `fmt`)."""
    return int(s, 16)
