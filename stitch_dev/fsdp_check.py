"""FSDP2 trainer-side check on one device: `FSDPPublisher` publishing from sharded masters.

    python -m stitch_dev.fsdp_check [--device cuda] [--hidden 256] [--layers 2] [--steps 3]
    python -m stitch_dev.fsdp_check --device cpu          # runs here too (gloo)

One process (world size 1: NCCL on a CUDA device, gloo on the CPU) shards a small HF-named model
with `fully_shard` per block and at the root, trains it with AdamW and publishes every step with
`FSDPPublisher` on a local board. So the trainer side's device path runs where the masters are:
DTensor local shards on the device, projection to bf16 and the compare on the device, the
fingerprint all-reduce over the device's backend. Checks (exit status 1 on any failure): every
version's manifest fingerprints equal those of the bf16 projection of the full masters computed
on the CPU; the single-process `Publisher` diffing the same CPU views counts the same changed
elements; `pull` of the last version rebuilds it bit for bit. Timing: median seconds of
`publish()` per version against a bare `torch.nonzero(a != b)` over the same bf16 views on the
device (the floor of any diff).

Needs only the wheel's dependencies (no transformers, no engine); never part of `dev.py test`
beyond a small CPU run (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.views import project
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import read_manifest

RUN = "fsdp-check"


class _Block(nn.Module):
    def __init__(self, h: int, ff: int):
        super().__init__()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(h))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, h, bias=True)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(h, ff, bias=False)  # ff odd: uneven rows, partial chunks
        self.mlp.down_proj = nn.Linear(ff, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.input_layernorm.weight
        return x + self.self_attn.q_proj(y) + self.mlp.down_proj(nn.functional.silu(
            self.mlp.up_proj(y)))


class TinyLM(nn.Module):
    """HF-style names (`model.embed_tokens`, `model.layers.N.mlp.up_proj`, `lm_head`)."""

    def __init__(self, vocab: int, h: int, layers: int):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, h)
        self.model.layers = nn.ModuleList(_Block(h, 2 * h + 3) for _ in range(layers))
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for b in self.model.layers:
            x = b(x)
        return self.lm_head(x)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full fp32 masters on the CPU (DTensor shards gathered; world 1: the local shard)."""
    out = {}
    for n, t in model.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[n] = t.detach().to("cpu", copy=True).contiguous()  # a copy: the optimizer steps on
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(dtypes.int_view(a[k]), dtypes.int_view(b[k]))
        for k in a)


def run(dev: torch.device, hidden: int, layers: int, steps: int, lr: float, work: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stitch_trainer.fsdp import FSDPPublisher
    from stitch_trainer.publisher import Publisher

    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{work / 'store'}", rank=0,
                            world_size=1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    checks: list[dict] = []
    try:
        torch.manual_seed(0)
        model = TinyLM(257, hidden, layers)
        (work / "ckpt").mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  work / "ckpt" / "model.safetensors")
        model.to(dev)
        mesh = init_device_mesh(dev.type, (1,))
        for b in model.model.layers:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1)
        fulls, secs, bare = [_full(model)], [], []
        board = work / "board"
        with FSDPPublisher(str(board), RUN, "bf16") as pub:
            pub.start_from(work / "ckpt", step=0)
            for step in range(1, steps + 1):
                ids = torch.randint(0, 257, (4, 32), generator=g).to(dev)
                loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                sync()
                t0 = time.perf_counter()
                pub.publish(step, model).result()
                secs.append(time.perf_counter() - t0)
                fulls.append(_full(model))
                old, new = (project({k: v.to(dev) for k, v in f.items()}, "bf16")
                            for f in fulls[-2:])
                sync()
                t0 = time.perf_counter()
                for k in new:
                    torch.nonzero(dtypes.int_view(old[k]) != dtypes.int_view(new[k]))
                sync()
                bare.append(time.perf_counter() - t0)
        views = [project(f, "bf16") for f in fulls]
        ms = asyncio.run(_manifests(board))
        checks.append({"check": "one manifest per version", "ok": sorted(ms) == list(
            range(steps + 1))})
        with Publisher(str(work / "single"), RUN, "bf16") as single:
            infos = [single.publish(v, views[v]).result() for v in range(steps + 1)]
        for v in range(steps + 1):
            m = ms.get(v)
            want = fpr.state_fingerprints(views[v])
            checks.append({"check": f"v{v}: fingerprints of the CPU projection",
                           "ok": m is not None and m.fingerprints == want})
            if v:
                checks.append({"check": f"v{v}: changed elements (> 0) as the single-process "
                               "Publisher", "ok": m is not None and m.changed_elements
                               == infos[v].changed_elements > 0,
                               "changed": None if m is None else m.changed_elements})
        d = work / "pulled"
        asyncio.run(pull(LocalBoard(board), RUN, steps, d, work / "cache", quiet=True))
        from safetensors.torch import load_file

        pulled = {}
        for f in sorted(d.glob("*.safetensors")):
            pulled.update(load_file(f))
        checks.append({"check": f"pull of v{steps} equals the CPU projection bit for bit",
                       "ok": _same(pulled, views[steps])})
        params = sum(t.numel() for t in views[0].values())
    finally:
        dist.destroy_process_group()
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "backend": backend,
            "params": params, "publish_s": statistics.median(secs),
            "bare_compare_s": statistics.median(bare),
            "changed": [c.get("changed") for c in checks if "changed" in c]}


async def _manifests(board: Path) -> dict:
    b = LocalBoard(board)
    return {v: await read_manifest(b, RUN, v) for v in await b.list_versions(RUN)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fsdp-check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--out", type=Path, help="write the report as JSON to this file")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("fsdp-check: no CUDA device here; --device cpu runs the same code on the CPU",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="stitch-fsdp-check-") as tmp:
        r = run(dev, a.hidden, a.layers, a.steps, a.lr, Path(tmp))
    r["device"] = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    for c in r["checks"]:
        print(f"{'ok    ' if c['ok'] else 'FAILED'} {c['check']}")
    print(f"{r['device']} ({r['backend']}), {r['params']:,} params: publish() median "
          f"{r['publish_s'] * 1e3:.1f} ms per version, a bare compare of the same views "
          f"{r['bare_compare_s'] * 1e3:.2f} ms; changed per version {r['changed']}")
    print(f"fsdp-check: {'ok' if r['ok'] else 'FAILED'}")
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
