"""The fault rig of the follower: one engine-shaped follower on real parts, each fault a scenario
(the rows of benchmarks/faults.py, run shorter by tests/test_fault_suite.py).

Every row builds a fresh rig on this machine: a real ``Publisher`` (stitch_trainer) writing a
LocalBoard directory and announcing on a real ``nats-server`` (``NatsServer``); that directory
served over HTTP by ``stitch_core.versions.board.serve`` in a thread (its ``BoardHandler``
subclassed to answer 5xx, answer slowly, or drop connections); and one engine-shaped follower: a
``Follower`` (HTTP board + NATS) driving a ``Coordinator`` over two in-process ``RankReplica``s of
the TP=2 toy engine (stitch_dev.toy_engine), with a ``VersionGate`` wired as
``stitch_core.node.EngineFollower`` wires it; an engine-step loop checks every admitted request.
The trainer publishes precomputed AdamW versions of the toy model (``views[k]`` after k steps),
so every version's true bits are known to the harness independently of the board. What each row
measures is said in benchmarks/faults.py.

The modules (import each name from the module that owns it; this package re-exports nothing):

* ``truth``: the trainer's versions (``make_views``, ``N_VIEWS``, ``RUN``) and ``Truth``, what
  each published version must be
* ``http_board``: the board directory served over HTTP, with faults (``HttpBoardServer``)
* ``tamper``: a trainer board that writes bad bytes (``TamperingBoard``, ``bomb_patch``,
  ``corrupt``, ``truncate``)
* ``rig``: ``Rig`` (publisher + nats-server + HTTP board + the follower, the engine-step loop)
  and its ``Row``
* ``rows``: the faults, one coroutine per kind (``bad_patch``, ``rank_fault``, ...)
* ``scenarios``: ``scenarios(views)`` maps each row's key to ``f(work, Truth(views), args)`` ->
  ``Row``; ``args`` carries ``reconcile``, ``rpc_timeout``, ``fault_window``, ``outage``,
  ``slow`` and ``settle``
"""
