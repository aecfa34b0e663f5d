"""The versions layer: versions on a board, how they are announced, fetched, materialised and
followed.

The manifest and `latest` models (`manifest`), the boards (`board`: local, HTTP, NATS), writing,
reading and planning versions (`store`), materialising a version as files and `pull`
(`materialize`), NATS announcements and heartbeats (`announce`), a local nats-server for the dev
stack (`natsserver`), the follower loop (`follower`), the bounded node-local cache (`cache`) and
board retention (`retention`: `stitch gc`). Uses the format layer only.

Nothing is re-exported here: each name is imported from the module that owns it.
"""
