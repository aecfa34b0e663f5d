"""A publisher process for tests/test_publish_crash.py, meant to die mid-publish.

    python tests/publish_crash_child.py BOARD RUN STAGE [fresh]

It resumes RUN at version 0 (published by the test with `weights(0)`) and publishes version 1
(`weights(1)`: a snapshot with its patch, in two shards plus an index: four objects); with
`fresh` it does not resume, so version 1 is a snapshot without a patch (the index and two
shards), as the first version of any restarted publisher is. It is killed with SIGKILL at STAGE:

* `mid-object`: while the board stores the first object (the patch): the board's `put` reads
  the file through a pipe that delivers half of it, and the process kills itself while the board
  waits for the rest (the board's own code, with a partial object in flight);
* `after-object`, `after-objects`, `after-manifest`, `after-latest`: at the failpoint
  `publish:<STAGE>` of `write_version`, set by the test in $STITCH_FAILPOINTS.

Exit status 0 means the failpoint never fired (the test fails on that).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

SHAPES = {"embed.weight": (1024, 1024), "mlp.weight": (512, 1024), "norm.weight": (1024,)}
MAX_SHARD_BYTES = 3 << 19  # 1.5 MiB: embed.weight alone, then mlp + norm (two shards)


def weights(i: int) -> dict[str, torch.Tensor]:
    """Version i's bf16 tensors (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + i)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def kill_mid_object(board) -> None:
    """Make the board's first `put` of a file read half of it from a pipe, then SIGKILL."""
    real_put = board.put

    async def put(key: str, src, *, sha256=None):
        size = src.stat().st_size
        fifo = src.with_name(src.name + ".fifo")
        os.mkfifo(fifo)

        def feed() -> None:
            with open(fifo, "wb") as w, open(src, "rb") as r:
                w.write(r.read(size // 2))  # returns once the board has read all but a pipe's worth
                w.flush()
                time.sleep(0.5)  # the board writes out what it read, and waits for more
                print(f"killing mid-object: {key}, {size // 2} of {size} bytes sent", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=feed, daemon=True).start()
        await real_put(key, Path(fifo))

    board.put = put


def main(board_url: str, run: str, stage: str, mode: str = "") -> int:
    from stitch_core.format import fingerprint as fpr
    from stitch_core.versions.board import open_board
    from stitch_trainer.publisher import Publisher

    board = open_board(board_url)
    if stage == "mid-object":
        kill_mid_object(board)
    pub = Publisher(board, run, "bf16", snapshot_every=1, max_shard_bytes=MAX_SHARD_BYTES)
    assert pub.published == 0, pub.published
    if mode != "fresh":
        base = weights(0)
        pub.resume_from(0, base, fpr.state_fingerprints(base))
    info = pub.publish(1, weights(1))
    assert info.version == 1, info.version
    info.result(60)
    print(f"failpoint {stage} did not fire: v1 published", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
