"""CLI verb `stitch keys`: make an ed25519 signing key pair for signed versions."""

from __future__ import annotations

import argparse
import json

from stitch_core.settings import Settings
from stitch_core.versions.trust import TrustSet, new_key


def trust_set(a: argparse.Namespace) -> TrustSet | None:
    """The trust set of a command: its `--trust` options, else $STITCH_TRUST, else None."""
    specs = getattr(a, "trust", None) or Settings.read("trust")
    ts = TrustSet.parse(specs)
    return ts if ts else None


def cmd_keys_new(a: argparse.Namespace) -> int:
    """`stitch keys new PATH`: private key to PATH (0600), public key to PATH.pub; prints it."""
    pub = new_key(a.path)
    if a.json:
        print(json.dumps({"key_id": pub.id, "public_key": pub.text, "private": a.path,
                          "public": f"{a.path}.pub"}))
    else:
        print(pub.text)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `keys new` to `sub`."""
    k = sub.add_parser("keys", help="signing keys for signed versions")
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    n = ks.add_parser("new", help="write a new ed25519 key: PATH (private, 0600) and PATH.pub; "
                                  "prints the public key")
    n.add_argument("path")
    n.add_argument("--json", action="store_true", help="print key id and paths as JSON")
    n.set_defaults(fn=cmd_keys_new)
