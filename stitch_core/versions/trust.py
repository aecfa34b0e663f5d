"""Signed versions: ed25519 keys, signatures over manifests and `latest`, trust sets.

A publisher holding a signing key signs each version's manifest (everything in it: run, version,
parent, kind, view, every object's size and SHA-256, every tensor's fingerprint, created, the key
id) and each `latest` pointer it writes. A reader given a `TrustSet` believes a manifest or a
`latest` only when it carries a valid signature by one of the set's keys; without a trust set the
board is trusted as before. Objects are bound to the signed manifest by their SHA-256 (checked on
every fetch), and the engine proves what its ranks hold against the manifest's fingerprints, so a
signature covers the bytes that are served.

What is signed is the model, not the file: the payload is a domain tag (manifest and `latest`
signatures cannot stand in for each other) followed by the canonical JSON of the parsed model
without its `signature` field (sorted keys, no spaces, UTF-8). The signature is over what a reader
uses after parsing, whatever whitespace or key order the stored file has.

Key files (docs/security.md): the private key is PKCS#8 PEM (mode 0600, readable by `openssl`); the
public key is one line ``ed25519:<base64 of the 32 raw bytes>``, which is also the inline form
accepted by ``--trust``/``STITCH_TRUST``. A key id is the first 16 hex digits of the SHA-256 of the
raw public key. Cryptography is `cryptography`'s (no hand-written primitives).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from stitch_core.errors import StitchError

KEY_PREFIX = "ed25519:"
_DOMAIN = {"manifest": b"stitch-manifest-signature-v1\n", "latest": b"stitch-latest-signature-v1\n",
           "span": b"stitch-span-signature-v1\n"}
MAX_KEY_FILE = 64 << 10  # a key file is a few hundred bytes; refuse to read anything big


class TrustError(StitchError, ValueError):
    """A key or trust set cannot be read, or a key file would be overwritten."""


class UntrustedVersionError(StitchError, ValueError):
    """A manifest or `latest` pointer is unsigned, signed by a key outside the trust set, or its
    signature does not match its content. The message names the version and the key."""


class Signed(Protocol):
    """A model with the two signature fields (Manifest, Latest)."""

    signed_by: str | None
    signature: str | None

    def model_dump(self, **kw: Any) -> dict[str, Any]: ...

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any: ...


S = TypeVar("S", bound=Signed)


def key_id(raw: bytes) -> str:
    """The id of a raw 32-byte ed25519 public key: 16 hex digits of its SHA-256."""
    return hashlib.sha256(raw).hexdigest()[:16]


def payload(obj: Signed, kind: str) -> bytes:
    """The bytes signed for `obj` (a Manifest: kind "manifest"; a Latest: "latest")."""
    body = obj.model_dump(mode="json", exclude={"signature"})
    return _DOMAIN[kind] + json.dumps(body, sort_keys=True, separators=(",", ":"),
                                      ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class PublicKey:
    """An ed25519 public key (raw 32 bytes) and its id."""

    raw: bytes

    @property
    def id(self) -> str:
        return key_id(self.raw)

    @property
    def text(self) -> str:
        """The one-line form: ``ed25519:<base64>``."""
        return KEY_PREFIX + base64.b64encode(self.raw).decode()

    def verify(self, signature: bytes, data: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, data)
        except InvalidSignature:
            return False
        return True

    @classmethod
    def parse(cls, text: str) -> PublicKey:
        """A key from ``ed25519:<base64>``, bare base64 of 32 bytes, or a PEM public key."""
        text = text.strip()
        if text.startswith("-----BEGIN"):
            try:
                k = serialization.load_pem_public_key(text.encode())
            except ValueError as e:
                raise TrustError(f"not a PEM public key: {e}") from None
            if not isinstance(k, Ed25519PublicKey):
                raise TrustError("the PEM public key is not an ed25519 key")
            return cls(k.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
        b64 = text[len(KEY_PREFIX):] if text.startswith(KEY_PREFIX) else text
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 32:
            raise TrustError(f"not an ed25519 public key: {text[:60]!r} (expected "
                             f"'{KEY_PREFIX}<base64 of 32 bytes>', a .pub file or a PEM key)")
        return cls(raw)


class SigningKey:
    """A private ed25519 key loaded from a PKCS#8 PEM file (`stitch keys new`)."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = PublicKey(key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw))

    @property
    def id(self) -> str:
        return self.public.id

    @classmethod
    def load(cls, path: str | os.PathLike) -> SigningKey:
        p = Path(path)
        try:
            data = _read_small(p)
            key = serialization.load_pem_private_key(data, password=None)
        except (OSError, ValueError, TypeError) as e:
            raise TrustError(f"cannot read signing key {p}: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise TrustError(f"{p} is not an ed25519 private key")
        return cls(key)

    def sign(self, obj: S, kind: str) -> S:
        """A copy of `obj` signed by this key (`signed_by` is part of what is signed)."""
        unsigned = obj.model_copy(update={"signed_by": self.id, "signature": None})
        sig = self._key.sign(payload(unsigned, kind))
        return unsigned.model_copy(update={"signature": base64.b64encode(sig).decode()})


def new_key(path: str | os.PathLike) -> PublicKey:
    """Write a new private key to `path` (mode 0600, never over an existing file) and its public
    key to `path`.pub; return the public key."""
    p = Path(path)
    pub = p.with_name(p.name + ".pub")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    public = SigningKey(key).public
    for target in (p, pub):
        if target.exists() or target.is_symlink():
            raise TrustError(f"{target} exists; not overwriting a key")
    _write_new(p, pem, 0o600)
    _write_new(pub, (public.text + "\n").encode(), 0o644)
    return public


def _write_new(path: Path, data: bytes, mode: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise TrustError(f"{path} exists; not overwriting a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_small(p: Path) -> bytes:
    with open(p, "rb") as f:
        data = f.read(MAX_KEY_FILE + 1)
    if len(data) > MAX_KEY_FILE:
        raise TrustError(f"{p} is too large for a key file")
    return data


@dataclass
class TrustSet:
    """The public keys a reader accepts versions from (several: key rotation)."""

    keys: dict[str, PublicKey] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def ids(self) -> list[str]:
        return sorted(self.keys)

    @classmethod
    def parse(cls, specs: Iterable[str] | str | None) -> TrustSet:
        """Keys from public-key files or inline keys. A string is split at commas
        (`STITCH_TRUST`); a file may hold one key per line (``#`` comments) or a PEM key."""
        if specs is None:
            return cls()
        items = specs.split(",") if isinstance(specs, str) else list(specs)
        keys: dict[str, PublicKey] = {}
        for item in (s.strip() for s in items):
            if not item:
                continue
            for k in _keys_of(item):
                keys[k.id] = k
        return cls(keys)

    def check(self, obj: Signed, kind: str, what: str) -> str:
        """The id of the trusted key that signed `obj`; UntrustedVersionError (naming `what`, e.g.
        "run v7", and the key) otherwise."""
        kid = obj.signed_by
        if kid is None or not obj.signature:
            raise UntrustedVersionError(f"{what} is unsigned; trusted keys: {', '.join(self.ids)}")
        key = self.keys.get(kid)
        if key is None:
            raise UntrustedVersionError(f"{what} is signed by key {kid}, which is not trusted "
                                   f"(trusted: {', '.join(self.ids)})")
        try:
            sig = base64.b64decode(obj.signature, validate=True)
        except (binascii.Error, ValueError):
            sig = b""
        if len(sig) != 64 or not key.verify(sig, payload(obj, kind)):
            raise UntrustedVersionError(f"{what}: the signature by key {kid} does not match its "
                                   "content (edited or forged)")
        return kid


def _keys_of(item: str) -> list[PublicKey]:
    p = Path(item)
    if not item.startswith(KEY_PREFIX) and not item.startswith("-----") and p.is_file():
        try:
            text = _read_small(p).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TrustError(f"cannot read public key file {p}: {e}") from None
        if text.lstrip().startswith("-----BEGIN"):
            return [PublicKey.parse(text)]
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        keys = [PublicKey.parse(ln) for ln in lines if ln]
        if not keys:
            raise TrustError(f"{p} holds no public key")
        return keys
    if not item.startswith(KEY_PREFIX) and ("/" in item or item.endswith(".pub")):
        raise TrustError(f"public key file {item} not found")
    return [PublicKey.parse(item)]
