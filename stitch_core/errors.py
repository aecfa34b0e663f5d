"""The root of every error Stitch raises on purpose: `StitchError`.

Each layer's errors subclass it and keep the builtin base they always had (a `PatchError` is still
a `ValueError`, a `BoardError` a `RuntimeError`), so callers can catch Stitch's failures as one
family (the CLI turns any of them into exit 1 and a one-line message) without breaking code that
caught the builtin. Every exception class in stitch_core, stitch_trainer, stitch_vllm and
stitch_sglang is one, and its name ends in ``Error`` (tests/test_architecture.py checks both).

The rule for ``raise``: a deliberate refusal that reaches the caller (bad or corrupt input, a
refused or unprovable state, a failed publish or engine call) raises the owning module's
`StitchError` subclass. A bare builtin stays only where converting adds nothing: abstract
methods (`NotImplementedError`), "unreachable" assertions, a misused internal helper or a wrong
argument to a constructor (a programming error, not a Stitch refusal), checks inside pydantic
validators (pydantic turns them into its `ValidationError`), and ``FileExistsError`` /
``FileNotFoundError`` / ``TimeoutError`` / ``KeyError`` where that builtin is itself the contract.

The hierarchy (builtin base in brackets; module under stitch_core unless named)::

    StitchError
    ├── cli.main.CliError [RuntimeError]
    ├── settings.SettingsError [ValueError]
    ├── format.checkpoint.CheckpointError [ValueError]
    ├── format.codec.CodecError [ValueError]
    ├── format.entropy.StreamError [ValueError]
    ├── format.stp.PatchError [ValueError]
    ├── engine.failpoints.FailpointError [RuntimeError]
    ├── engine.proof.EngineStateError [RuntimeError]
    ├── engine.replica.ReplicaError [RuntimeError]
    ├── serve.admission.HeartbeatRejectedError [ValueError]
    ├── serve.asgi.BodyTooLargeError [ValueError]
    ├── serve.gate.NotReadyError [RuntimeError]  (its 409 body's shape: protocol.NotReadyBody)
    ├── serve.protocol.BadRequestError [ValueError]
    ├── serve.proxy.ClientGoneError [ConnectionError]
    ├── serve.stamping.StreamStoppedError [OSError]
    ├── versions.board.base.BoardError [RuntimeError]
    │   ├── NotFoundError, TooLargeError, LatestConflictError, ReadOnlyBoardError, BadCopyError
    │   └── versions.store.VersionError
    │       ├── versions.store.RefusedVersionError (also an UntrustedVersionError)
    │       ├── versions.materialize.RollbackRefusedError
    │       └── versions.squash.SquashError
    ├── versions.board.http._TransientError [ConnectionError]  (retried, never escapes)
    ├── versions.board.serve_conns.AbortedError [ConnectionAbortedError]
    ├── versions.nats_conn.NatsConfigError [ValueError]
    ├── versions.nats_conn.NatsConnectionError [ConnectionError]
    ├── versions.nats_conn.NatsPermissionError [PermissionError]
    ├── versions.nats_conn.TLSRequiredError [nats.errors.Error, ConnectionError]
    ├── versions.natsserver.NatsServerError [RuntimeError]
    ├── versions.relay.RelayError [RuntimeError]
    ├── versions.relay_nginx.RelayConfigError [ValueError]
    ├── versions.trust.TrustError [ValueError]
    ├── versions.trust.UntrustedVersionError [ValueError]
    └── stitch_trainer.fsdp.PublishError [RuntimeError]

Pure: no imports.
"""


class StitchError(Exception):
    """Base class of Stitch's own errors: corrupt or refused input, unreachable or inconsistent
    boards, an engine state that cannot be proven."""
