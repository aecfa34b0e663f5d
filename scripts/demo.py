#!/usr/bin/env python3
"""Demo: a trainer publishes versions of a model; a follower, then an engine, follow them.

Part 1, on this machine: a real nats-server (JetStream) and a board directory, a Llama-shaped
model trained with AdamW at an RL learning rate, the `Publisher` shipping each step as a lossless
patch (a snapshot every 5 versions), and a `Follower` subscribed to the announcements that fetches,
applies and verifies every version bit for bit. Then the CLI: `stitch versions`, `stitch pull`,
`stitch inspect`, and a corrupted patch being refused.

Part 2 (`scripts/demo_engine.py`; `--no-engine` skips it): a stock vLLM (default) or SGLang
(`--engine sglang`) OpenAI server with the Stitch plugin follows a trainer's versions in place, and
each completion says which version served it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.format.views import project
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer import Publisher

RUN = "demo"


def small_llama(layers: int, hidden: int, inter: int, vocab: int) -> torch.nn.ParameterDict:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {
        k: torch.nn.Parameter(torch.ones(s) if len(s) == 1 else torch.randn(*s, generator=g) * 0.02)
        for k, s in shapes.items()
    }


def stitch(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stitch_core.cli", *map(str, args)], capture_output=True, text=True
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                    help="the engine of part 2")
    ap.add_argument("--no-engine", action="store_true",
                    help="skip part 2 (the engine), e.g. where the engine cannot be installed")
    ap.add_argument("--engine-versions", type=int, default=6,
                    help="versions the trainer of part 2 publishes after v0")
    ap.add_argument("--engine-python", type=Path, default=None,
                    help="python of the engine's venv (default: $STITCH_VLLM_VENV or "
                         ".venv-vllm; $STITCH_SGLANG_VENV or .venv-sglang)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind: cleanup
    work = a.out or Path(tempfile.mkdtemp(prefix="stitch-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        engine = None
        if not a.no_engine:
            from demo_engine import EngineDemo

            # part 2's server boots (vLLM 30-60 s, SGLang 1-3 min) while part 1 runs
            engine = stack.enter_context(EngineDemo(work / "engine", a.engine_versions,
                                                    engine=a.engine, python=a.engine_python))
            print(f"(part 2's {engine.kind.title} server is starting in the background "
                  f"meanwhile; log: {engine.engine.log})\n")
        print("=== part 1: trainer -> board + NATS -> follower, bit for bit ===\n")
        follower_demo(work, a)
        if engine is not None:
            print(f"\n=== part 2: trainer -> board + NATS -> {engine.kind.title} server with the "
                  "Stitch plugin ===\n")
            engine.show()
    print(f"\ndemo done in {time.monotonic() - t0:.0f} s; work directory {work}")


def follower_demo(work: Path, a: argparse.Namespace) -> None:
    board = work / "board"

    params = small_llama(layers=4, hidden=512, inter=1408, vocab=8000)
    opt = torch.optim.AdamW(params.values(), lr=a.lr, weight_decay=0.01)
    n = sum(p.numel() for p in params.values())
    with NatsServer(work / "nats", port=0) as nats:
        print(
            f"nats-server {nats.url}, board {board}\n"
            f"model: {n / 1e6:.1f}M params, AdamW lr={a.lr}, served view bf16\n"
        )
        pub = Publisher(str(board), RUN, "bf16", nats=nats.url, snapshot_every=5)
        replica = MemoryReplica()
        loop = asyncio.new_event_loop()
        follower = Follower(
            str(board),
            RUN,
            replica,
            nats=nats.url,
            cache_dir=work / "cache",
            reconcile_interval=5.0,
            engine_id="demo-follower",
        )
        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(follower.start(), loop).result(30)

        print(
            f"{'ver':>3} {'kind':<8} {'changed %':>9} {'patch bytes':>12} {'full bytes':>11} "
            f"{'smaller':>8} {'publish ms':>10} {'upload ms':>9} {'fetch ms':>8} "
            f"{'apply ms':>8}  follower"
        )
        for step in range(a.steps + 1):
            if step:
                for p in params.values():  # noisy gradients with a little shared signal
                    p.grad = torch.randn_like(p) * 1e-2 + 1e-3 * torch.randn(1)
                opt.step()
            info = pub.publish(step, params)
            t0 = time.perf_counter()
            m = info.result(120)
            upload = time.perf_counter() - t0
            ok = asyncio.run_coroutine_threadsafe(follower.wait_for(m.version, 60), loop).result()
            h = follower.history[-1]
            expect = fpr.state_fingerprints(
                project({k: p.detach() for k, p in params.items()}, "bf16")
            )
            verified = ok and replica.fingerprints == expect
            full = sum(t.numel() * 2 for t in replica.tensors.values())
            moved = m.patch_bytes if h["kind"] == "patch" else m.full_bytes
            changed = (
                ""
                if m.changed_elements is None
                else f"{100 * m.changed_elements / m.total_elements:.3f}"
            )
            print(
                f"{m.version:>3} {m.kind:<8} {changed:>9} {m.patch_bytes or '-':>12} "
                f"{full:>11,} {full / moved:>7.0f}x {1e3 * info.blocked_seconds:>10.0f} "
                f"{1e3 * upload:>9.0f} {1e3 * h['fetch_s']:>8.0f} {1e3 * h['apply_s']:>8.0f}"
                f"  v{follower.version} {h['kind']}, "
                f"{'bit-exact' if verified else 'MISMATCH'}"
            )
            if not verified:
                raise SystemExit("follower diverged from the trainer")
        pub.close()

        print("\n$ stitch versions", board, "--run", RUN)
        print(stitch("versions", board, "--run", RUN).stdout)
        print(f"$ stitch status --nats {nats.url} --run {RUN}")
        print(stitch("status", "--nats", nats.url, "--run", RUN).stdout)
        asyncio.run_coroutine_threadsafe(follower.stop(), loop).result(30)
    r = stitch("pull", board, "--run", RUN, "-o", work / "pulled", "--force", "--json")
    print(
        f"$ stitch pull {board} --run {RUN} -o {work / 'pulled'} --json\n{r.stdout.strip()}"
        f"{r.stderr.strip()}"
    )
    patch = board / RUN / "versions" / f"{a.steps:06d}" / "patch.stp"
    print(f"\n$ stitch inspect {patch}")
    print("\n".join(stitch("inspect", patch).stdout.splitlines()[:6]) + "\n  ...")
    info = json.loads(stitch("inspect", patch, "--json").stdout)
    bad = bytearray(patch.read_bytes())
    bad[len(bad) // 3] ^= 1
    (work / "bad.stp").write_bytes(bytes(bad))
    base = work / "base"
    stitch("pull", board, "--run", RUN, "--version", str(a.steps - 1), "-o", base, "--force")
    r = stitch("apply", base, work / "bad.stp", "-o", work / "bad-out")
    print(
        f"\na patch with one flipped bit ({info['patch_bytes']:,} bytes): exit {r.returncode}, "
        f"{r.stderr.strip()!r}; output written: {(work / 'bad-out').exists()}"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers are stopped by now
        sys.exit(130)
