"""Publish versions of a model sharded with FSDP2, on the CPU: 2 gloo processes, then follow them.

    python examples/fsdp2_publish.py [--steps 3] [--dir ./stitch-fsdp2-demo] [--view bf16]

Each rank builds the same tiny Llama (transformers), shards it with `fully_shard` on a 2-rank CPU
mesh and trains a few AdamW steps. `FSDPPublisher.start_from` publishes the starting checkpoint as
snapshot v0 (rank 0); after every optimizer step each rank diffs *its own shard* against its shard
of the previous version and uploads its part of the patch; rank 0 writes the manifest. No weight
is ever gathered. The main process then follows every version with a `MemoryReplica` (each step
verified by fingerprint) and materialises the last one with `pull`, as `stitch pull` would.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

RUN = "fsdp2-demo"
WORLD = 2


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def worker(rank: int, port: int, work: Path, steps: int, view: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stitch_trainer.fsdp import FSDPPublisher
    from stitch_trainer.publisher import named_tensors

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    model = build_model()
    ckpt = work / "start"
    if rank == 0:  # the HF checkpoint the run starts from (normally: your model directory)
        ckpt.mkdir(parents=True, exist_ok=True)
        sd = {k: v.contiguous() for k, v in named_tensors(model).items()}
        save_file(sd, ckpt / "model.safetensors")
        model.config.save_pretrained(ckpt)
    dist.barrier()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    with FSDPPublisher(str(work / "board"), RUN, view) as pub:
        pub.start_from(ckpt, step=0)
        for step in range(1, steps + 1):
            batch = torch.randint(0, 256, (2, 16), generator=g)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            info = pub.publish(step, model)  # every rank: its own part; synchronous
            m = info.result()
            if rank == 0:
                print(
                    f"step {step}: v{m.version} published in {info.blocked_seconds:.2f}s, "
                    f"{len(m.patches)} parts, {m.patch_bytes:,} bytes"
                )
    dist.destroy_process_group()


async def follow(work: Path) -> None:
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.follower import Follower
    from stitch_core.versions.materialize import pull
    from stitch_core.versions.memory_replica import MemoryReplica
    from stitch_core.versions.store import list_manifests

    board = LocalBoard(work / "board")
    ms = await list_manifests(board, RUN)
    replica = MemoryReplica()
    follower = Follower(board, RUN, replica, cache_dir=work / "cache")
    print(f"{'version':>7} {'kind':<8} {'parts':>5} {'bytes':>10} {'changed %':>9}  digest")
    for m in ms:
        await follower.catch_up(m.version)  # applies and verifies every tensor's fingerprint
        assert replica.digest == m.digest
        size = m.patch_bytes or m.full_bytes
        pct = (
            ""
            if m.changed_elements is None
            else f"{100 * m.changed_elements / m.total_elements:.2f}"
        )
        print(
            f"{m.version:>7} {m.kind:<8} {len(m.patches):>5} {size:>10,} {pct:>9}  {m.digest[:16]}"
        )
    out = work / "pulled"
    last = await pull(board, RUN, None, out, work / "cache", force=True, quiet=True)
    print(f"follower applied {follower.applied}; pulled v{last.version} to {out}")
    await follower.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default="./stitch-fsdp2-demo")
    ap.add_argument("--view", default="bf16", choices=["bf16", "fp16"])
    a = ap.parse_args()
    work = Path(a.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, work, a.steps, a.view), nprocs=WORLD, join=True)
    asyncio.run(follow(work))


if __name__ == "__main__":
    main()
