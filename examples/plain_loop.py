#!/usr/bin/env python3
"""A custom training loop publishing every step (runs on the CPU in seconds).

    python examples/plain_loop.py [--board /tmp/stitch-example-board]

Then follow it from anywhere: `stitch versions BOARD --run plain`, `stitch pull BOARD --run plain
-o /tmp/plain-latest`.
"""

from __future__ import annotations

import argparse

import torch

from stitch_trainer import Publisher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--board", default="/tmp/stitch-example-board")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 128), torch.nn.Linear(128, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 1000))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6)
    with Publisher(a.board, run="plain", view="bf16", snapshot_every=10) as pub:
        for step in range(a.steps):
            x = torch.randint(0, 1000, (8, 32))
            loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 1000),
                                                     x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            info = pub.publish(step, model)  # returns after projecting; upload in background
            print(f"step {step}: version {info.version} queued in "
                  f"{1e3 * info.blocked_seconds:.1f} ms")
        pub.flush()
        m = info.result()
        print(f"latest: v{m.version} ({m.kind}), {m.patch_bytes or m.full_bytes:,} bytes")


if __name__ == "__main__":
    main()
