"""The versions layer: versions on a board, how they are announced, fetched, materialised and
followed.

The manifest and `latest` models (`manifest`), the boards (`board`: local, HTTP, NATS), writing,
reading and planning versions (`store`), materialising a version as files and `pull`
(`materialize`), NATS announcements and heartbeats (`announce`), a local nats-server for the dev
stack (`natsserver`), the follower loop (`follower`), the bounded node-local cache (`cache`) and
board retention (`retention`: `stitch gc`). Uses the format layer only.

The names of `store` are re-exported here: `stitch_core.versions` was that module before the
layered tree, and `from stitch_core.versions import read_manifest` keeps working.
"""

from stitch_core.versions.store import (
    Step,
    VersionError,
    fetch_object,
    fetch_patch,
    list_manifests,
    now,
    object_ref,
    plan,
    read_manifest,
    sha256_file,
    write_version,
)

__all__ = ["Step", "VersionError", "fetch_object", "fetch_patch", "list_manifests", "now",
           "object_ref", "plan", "read_manifest", "sha256_file", "write_version"]
