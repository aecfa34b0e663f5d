#!/usr/bin/env python3
"""FSDPPublisher benchmark: per-rank diff+encode time and bytes exchanged between ranks.

    .venv/bin/python benchmarks/fsdp.py [--params 20e6] [--world 2] [--steps 4] [--reps 5] \\
        [--lr 3e-6] [--warmup 2] [--seed 0] [--md out.md]

`--world` gloo processes on the CPU (torch threads 1 per rank, OMP_NUM_THREADS=1) build the same
Llama-shaped `transformers.LlamaForCausalLM` (sized by benchmarks/adam_data.py's `shape_for`, as
benchmarks/codec.py; norms ~1 + N(0, 0.01)), shard it with `fully_shard` per decoder layer + root
on a CPU mesh, and train it with AdamW on noisy synthetic gradients (the same global gradient
whatever --world: every rank draws the full tensor from a seed and keeps its rows). After
`--warmup` steps the weights are saved as the checkpoint `start_from` publishes as v0; then every
step is published (bf16 view) with `FSDPPublisher.publish`, on a local board. Same run, side by
side, every version:

* time. The publisher does not expose its phases, so the benchmark wraps its fingerprint
  all-reduce (the first collective after the local phase) and the c10d calls to timestamp them.
  Per rank: the local phase of publish() (local_slices + project the rows to bf16 + diff + encode
  + write the chunks to its spool file), and, outside publish(), a `PatchBuilder` shard-mode diff
  (global shape, flat offset) of the same local rows, diff+encode only, run by all ranks at once
  (as in publish) and then one rank at a time (the others waiting at a barrier). Baseline: rank 0
  alone (the other ranks wait at a barrier), on the gathered full weights: `project` to bf16 and
  a `PatchBuilder` diff+encode of the full views (base fingerprints known, as the single-process
  Publisher does); then, in the same process, the full views cut into the ranks' rows and diffed
  in shard mode one part after another (what splitting costs without any contention: the codec
  has a fixed cost per tensor and chunk, ~1 ms here, that every part pays again). Ratio: per-rank
  time (slowest rank) / (single-process time / world); 1.0 is a perfect split. Shard diffs and
  baseline are the min of --reps runs; the local phase is one run (one publish per version). The
  cyclic GC is paused during every timed call.
* bytes. During publish() every c10d collective is wrapped (torch.distributed and
  distributed_c10d, so the tensors that all_gather_object / broadcast_object_list send for their
  pickled payloads are counted too), summing the bytes of every tensor argument, inputs and
  outputs, per rank; pickled payload sizes are recorded separately, and any DTensor.full_tensor /
  redistribute call. Compared with the patch: the sum of its parts' sizes. Target <= 1%.

Checks (the run exits non-zero otherwise): every manifest's fingerprints and changed-element
count equal the single-process diff of the same full weights, and the direct shard diffs add up to
the same changed count. The first published version also reads its base rows from the checkpoint and
fingerprints them inside the local phase: it is marked * and left out of the medians.

On a small machine (2 cores here) with --world 2 the ranks compete with each other and with
everything else running: read ratios, not absolute times, and the one-rank-at-a-time and
one-process columns for the split without contention.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import pickle
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from adam_data import ModelShape, shape_for  # noqa: E402
from bench_timing import best_of  # noqa: E402

import stitch_core  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.format.patch import PatchBuilder  # noqa: E402
from stitch_core.format.views import project  # noqa: E402

RUN = "bench-fsdp"
VIEW = "bf16"
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list")


# ---------------------------------------------------------------- helpers (both sides)


def build_model(shape: ModelShape, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)  # matrices ~N(0, 0.02)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights: not all exactly 1.0
                p.normal_(1.0, 0.01)
    return model


def diff_encode(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    fps: Mapping[str, int],
    where: Mapping[str, tuple[tuple[int, ...], int]] | None = None,
) -> PatchBuilder:
    """PatchBuilder.add of every tensor into memory (diff + encode; no header). With `where`
    (name -> global shape, flat offset) in shard mode, as FSDPPublisher does for its rows."""
    b = PatchBuilder(io.BytesIO(), run=RUN, view=VIEW)
    for n in sorted(new):
        if where is None:
            b.add(n, base[n], new[n], fps[n])
        else:
            shape, offset = where[n]
            b.add(n, base[n], new[n], fps[n], shape=shape, offset=offset)
    return b


def split_views(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    spans: list[Mapping[str, tuple[int, int]]],
) -> list[tuple[dict, dict, dict, dict]]:
    """The full views cut into the ranks' rows: (base rows, new rows, partial base fingerprints,
    where) per rank, the arguments of a shard-mode `diff_encode` (copies, made untimed)."""
    out = []
    for span in spans:
        b, n, fps, where = {}, {}, {}, {}
        for name, (start, stop) in span.items():
            shape = tuple(new[name].shape)
            if not shape:
                raise NotImplementedError(f"{name}: 0-dim tensors are not split here")
            offset = start * math.prod(shape[1:])
            b[name] = base[name][start:stop].contiguous()
            n[name] = new[name][start:stop].contiguous()
            fps[name] = fpr.fingerprint(name, b[name], offset=offset)
            where[name] = (shape, offset)
        out.append((b, n, fps, where))
    return out


# ---------------------------------------------------------------- worker (one per rank)


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _pickled(x) -> int:
    try:
        return len(pickle.dumps(x))
    except Exception:
        return 0


@contextlib.contextmanager
def count_collectives(rank: int):
    """Record every c10d collective (name, tensor bytes in and out, pickled payload bytes sent by
    this rank, entry time) and every DTensor gather or redistribution."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor import DTensor

    calls: list[dict] = []
    saved = []

    def wrap(name, fn):
        def counted(*a, **k):
            rec = {"name": name, "bytes": 0, "pickled": 0, "t": time.perf_counter()}
            calls.append(rec)
            args = list(a) + list(k.values())
            if name == "all_gather_object":  # (object_list, obj, group)
                rec["pickled"] = _pickled(a[1] if len(a) > 1 else k.get("obj"))
            elif name == "broadcast_object_list":  # (object_list, src, group): src sends
                src = a[1] if len(a) > 1 else k.get("src", 0)  # a global rank
                if rank == src:
                    rec["pickled"] = sum(_pickled(o) for o in a[0])
            elif name not in OBJECT_COLLECTIVES:
                rec["bytes"] = _tensor_bytes(args)
            return fn(*a, **k)

        return counted

    for mod in (dist, c10d):  # dist.X for direct calls, c10d.X for calls inside c10d
        for name in COLLECTIVES + OBJECT_COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is not None:
                saved.append((mod, name, fn))
                setattr(mod, name, wrap(name, fn))
    for name in ("full_tensor", "redistribute"):
        fn = getattr(DTensor, name)
        saved.append((DTensor, name, fn))
        setattr(DTensor, name, wrap(f"DTensor.{name}", fn))
    try:
        yield calls
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def noisy_step(params: list, opt: torch.optim.Optimizer, step: int, seed: int) -> None:
    """One AdamW step on gradients N(0, 1e-2) + a per-tensor N(0, 1e-3) offset. Every rank draws
    the full gradient of a tensor from the same seed and keeps its rows (no communication)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, (_, p) in enumerate(params):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + i)
        full = torch.randn(p.shape, generator=g) * 1e-2 + 1e-3 * torch.randn(1, generator=g)
        if isinstance(p, DTensor):
            shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            rows = full[off[0] : off[0] + shape[0]].contiguous()
            p.grad = DTensor.from_local(
                rows,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        else:
            p.grad = full
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(work: Path, rank: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stitch_trainer.fsdp import FSDPPublisher, local_slices
    from stitch_trainer.publisher import named_tensors

    a = json.loads((work / "args.json").read_text())
    world, reps = a["world"], a["reps"]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(ModelShape(**a["shape"]), a["seed"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], weight_decay=0.01)
    for step in range(1, a["warmup"] + 1):
        noisy_step(params, opt, step, a["seed"])
    full = named_tensors(model)  # gathers: setup only
    if rank == 0:
        (work / "ckpt").mkdir()
        save_file({n: t.contiguous() for n, t in full.items()}, work / "ckpt" / "model.safetensors")
        model.config.save_pretrained(work / "ckpt")
    dist.barrier()

    pub = FSDPPublisher(str(work / "board"), RUN, VIEW, spool_dir=work)
    marks: dict[str, float] = {}
    reduce_fps = pub.reduce_fingerprints

    def timed_reduce(*args, **kw):  # the fingerprint all-reduce ends the local phase
        marks["reduce_in"] = time.perf_counter()
        try:
            return reduce_fps(*args, **kw)
        finally:
            marks["reduce_out"] = time.perf_counter()

    pub.reduce_fingerprints = timed_reduce
    m0 = pub.start_from(work / "ckpt", step=a["warmup"])
    slices = local_slices(model, rank)
    where = {n: (s.shape, s.offset) for n, s in slices.items()}
    spans: list = [None] * world  # every rank's rows, for rank 0's single-process split
    dist.all_gather_object(spans, {n: (s.start, s.stop) for n, s in slices.items()})
    prev_rows = project({n: s.tensor for n, s in slices.items()}, VIEW)
    prev_rows_fps = {n: fpr.fingerprint(n, t, offset=where[n][1]) for n, t in prev_rows.items()}
    prev_full = prev_full_fps = None
    if rank == 0:
        prev_full = project(full, VIEW)
        prev_full_fps = fpr.state_fingerprints(prev_full)
        if prev_full_fps != m0.fingerprints:
            raise SystemExit("v0 fingerprints differ from the projected checkpoint")
    del full
    gc.collect()
    gc.freeze()
    out: list[dict] = []
    for step in range(a["warmup"] + 1, a["warmup"] + a["steps"] + 1):
        noisy_step(params, opt, step, a["seed"])
        dist.barrier()
        marks.clear()
        with count_collectives(rank) as calls:
            gc.disable()
            t0 = time.perf_counter()
            m = pub.publish(step, model).result()
            t1 = time.perf_counter()
            gc.enable()
        gather_t = next(c["t"] for c in calls if c["name"] == "all_gather_object")
        rec: dict = {
            "version": m.version,
            "patch_bytes": m.patch_bytes,
            "parts": [o.size for o in m.patches],
            "changed": m.changed_elements,
            "total": m.total_elements,
            "publish_s": t1 - t0,
            "local_s": marks["reduce_in"] - t0,
            "allreduce_s": marks["reduce_out"] - marks["reduce_in"],
            "finish_upload_s": gather_t - marks["reduce_out"],
            "rest_s": t1 - gather_t,
            "calls": [[c["name"], c["bytes"], c["pickled"]] for c in calls],
        }
        # outside publish(): the same local rows, PatchBuilder shard mode, diff+encode only
        slices = local_slices(model, rank)
        rows = project({n: s.tensor for n, s in slices.items()}, VIEW)
        dist.barrier()
        shard_diff = partial(diff_encode, prev_rows, rows, prev_rows_fps, where)
        rec["shard_concurrent_s"], b = best_of(reps, shard_diff)
        for r in range(world):
            dist.barrier()
            if r == rank:
                rec["shard_serial_s"], _ = best_of(reps, shard_diff)
        dist.barrier()
        rec["shard_changed"] = sum(e.changed for e in b.entries)
        rec["shard_elements"] = sum(t.numel() for t in rows.values())
        prev_rows = rows
        prev_rows_fps = {n: fp for n, (_, fp) in b.partial_fingerprints().items()}
        # the single-process baseline: rank 0 alone, on the gathered weights (same version)
        masters = named_tensors(model)
        if rank == 0:
            assert prev_full is not None and prev_full_fps is not None
            rec["single_project_s"], view = best_of(reps, partial(project, masters, VIEW))
            rec["single_diff_s"], b = best_of(
                reps, partial(diff_encode, prev_full, view, prev_full_fps)
            )
            b.finish()
            parts = split_views(prev_full, view, spans)
            rec["single_parts_s"], bs = best_of(
                reps, lambda parts=parts: [diff_encode(*p) for p in parts]
            )
            rec["single_parts_changed"] = sum(e.changed for x in bs for e in x.entries)
            del parts
            fps = {n: fp for n, (_, fp) in b.partial_fingerprints().items()}
            rec["single_patch_bytes"] = b.size
            rec["single_changed"] = sum(e.changed for e in b.entries)
            rec["match"] = (
                fps == m.fingerprints
                and rec["single_changed"] == rec["single_parts_changed"] == m.changed_elements
            )
            prev_full, prev_full_fps = view, fps
        del masters
        dist.barrier()
        out.append(rec)
    pub.close()
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent


def launch(work: Path, world: int, timeout: float) -> None:
    from stitch_dev.ranks import rank_env, run_ranks

    env = rank_env(MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    run_ranks(work, world, lambda r: [sys.executable, __file__, "--worker", str(work), str(r)],
              lambda r: env, timeout)


def machine_info() -> str:
    import transformers

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"Machine: {cpu}, os.cpu_count() {os.cpu_count()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; torch threads 1 per rank "
        f"(and OMP_NUM_THREADS=1). Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, stitch_core {stitch_core.__version__}."
    )


def ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def report(ranks: list[list[dict]], a: argparse.Namespace, shape: ModelShape) -> str:
    world = len(ranks)
    r0 = ranks[0]
    first = r0[0]["version"]
    n_tensors = len(shape.shapes())
    lines = [
        f"Model: transformers LlamaForCausalLM, {shape.n_params / 1e6:.2f}M params "
        f"({shape.layers} layers, hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"vocab {shape.vocab}, {n_tensors} tensors), fp32 masters; fully_shard per decoder layer "
        f"+ root on a CPU gloo mesh of {world} ranks. AdamW lr {a.lr:g}, wd 0.01, on noisy "
        f"gradients; {a.warmup} warm-up steps before v0, then {a.steps} published steps; "
        f"{VIEW} view, local board. Shard diff and single-process times: min of {a.reps} runs.",
        "",
        "### Time per version, ms",
        "",
        "| version | changed % | single: project | single: diff+encode | single: the "
        f"{world} parts in shard mode, one after another | ratio | local phase of publish(), "
        "per rank | ratio | shard diff+encode, ranks at once | ratio | shard diff+encode, one "
        "rank at a time | ratio | publish(), slowest rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    med: dict[str, list[float]] = {k: [] for k in ("parts", "local", "conc", "ser")}
    for i, rec in enumerate(r0):
        recs = [r[i] for r in ranks]
        single = rec["single_project_s"] + rec["single_diff_s"]
        ratios = {
            "parts": rec["single_parts_s"] / rec["single_diff_s"],
            "local": max(x["local_s"] for x in recs) / (single / world),
            "conc": max(x["shard_concurrent_s"] for x in recs) / (rec["single_diff_s"] / world),
            "ser": max(x["shard_serial_s"] for x in recs) / (rec["single_diff_s"] / world),
        }
        if rec["version"] != first or len(r0) == 1:
            for k, v in ratios.items():
                med[k].append(v)

        def per_rank(key: str, recs=recs) -> str:
            return " / ".join(ms(x[key]) for x in recs)

        star = "*" if rec["version"] == first else ""
        lines.append(
            f"| {rec['version']}{star} | {100 * rec['changed'] / rec['total']:.3f} | "
            f"{ms(rec['single_project_s'])} | {ms(rec['single_diff_s'])} | "
            f"{ms(rec['single_parts_s'])} | {ratios['parts']:.2f} | {per_rank('local_s')} | "
            f"**{ratios['local']:.2f}** | {per_rank('shard_concurrent_s')} | "
            f"**{ratios['conc']:.2f}** | {per_rank('shard_serial_s')} | {ratios['ser']:.2f} | "
            f"{ms(max(x['publish_s'] for x in recs))} |"
        )
    lines += [
        "",
        "Ratios: parts one after another / single diff+encode (1.0 = shard mode costs nothing "
        "extra; both in rank 0's process, the other ranks waiting); local phase (project + diff + "
        f"encode + spool writes) of the slowest rank / ((single project + diff+encode) / {world}); "
        f"shard diff+encode of the slowest rank / (single diff+encode / {world}). 1.0 = a perfect "
        "split. "
        f"\\* v{first}: the first publish also reads its base rows from the checkpoint and "
        "fingerprints them in the local phase (left out of the medians).",
        "",
        "### Where publish() time goes, ms per rank (median over versions)",
        "",
        "| rank | local phase | fingerprint all-reduce (incl. waiting for the other ranks) | "
        "finish + upload part | metadata all-gather + manifest + broadcast | total |",
        "|---|---|---|---|---|---|",
    ]
    keys = ("local_s", "allreduce_s", "finish_upload_s", "rest_s", "publish_s")
    for r, recs in enumerate(ranks):
        sel = [x for x in recs if x["version"] != first] or recs
        cells = " | ".join(ms(statistics.median(x[k] for x in sel)) for k in keys)
        lines.append(f"| {r} | {cells} |")
    lines += [
        "",
        "### Bytes per version",
        "",
        "| version | patch bytes (sum of parts) | parts | single-process patch bytes | "
        "collective bytes per rank | collective bytes, all ranks | % of patch | "
        "pickled payloads, all ranks | DTensor gathers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    pct = []
    for i, rec in enumerate(r0):
        recs = [r[i] for r in ranks]
        per_rank = [sum(c[1] for c in x["calls"]) for x in recs]
        pickled = sum(c[2] for x in recs for c in x["calls"])
        gathers = sum(c[0].startswith("DTensor.") for x in recs for c in x["calls"])
        pct.append(100 * sum(per_rank) / rec["patch_bytes"])
        lines.append(
            f"| {rec['version']} | {rec['patch_bytes']:,} | "
            f"{' + '.join(f'{p:,}' for p in rec['parts'])} | {rec['single_patch_bytes']:,} | "
            f"{' / '.join(f'{b:,}' for b in per_rank)} | {sum(per_rank):,} | "
            f"**{pct[-1]:.4f}** | {pickled:,} | {gathers} |"
        )
    names: dict[str, int] = {}
    for c in r0[-1]["calls"]:
        names[c[0]] = names.get(c[0], 0) + 1
    calls = ", ".join(f"{k} x{v}" for k, v in names.items())
    lines += [
        "",
        f"Collective calls per publish on rank 0 (last version): {calls}. Bytes: every tensor "
        "argument of every c10d call, inputs and outputs, on each rank (the object collectives' "
        "pickled payloads travel as uint8 tensors of their inner all_gather/broadcast calls and "
        "are counted there); the all-ranks sum over-counts the traffic.",
        "",
        "### Summary",
        "",
        f"* median local phase of publish() / (single-process project+diff+encode / {world}): "
        f"**{statistics.median(med['local']):.2f}** (1.0 = a perfect split)",
        f"* median shard diff+encode / (single-process diff+encode / {world}): "
        f"**{statistics.median(med['conc']):.2f}** with the ranks at once, "
        f"{statistics.median(med['ser']):.2f} one rank at a time; the {world} parts one after "
        f"another in one process / the single diff: {statistics.median(med['parts']):.2f}",
        f"* collective bytes (all ranks) / patch bytes: max **{max(pct):.4f}%**, median "
        f"{statistics.median(pct):.4f}% (target <= 1%: "
        f"{'met' if max(pct) <= 1 else 'NOT met'})",
        "* every manifest's fingerprints and changed elements equal the single-process diff of "
        "the same weights; the shards' changed elements add up to it; no DTensor gather during "
        "publish(): "
        + str(
            all(r["match"] for r in r0)
            and all(
                sum(r[i]["shard_changed"] for r in ranks) == rec["changed"]
                for i, rec in enumerate(r0)
            )
            and not any(c[0].startswith("DTensor.") for r in ranks for x in r for c in x["calls"])
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--params", type=float, default=20e6, help="model size")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (processes)")
    ap.add_argument("--steps", type=int, default=4, help="published steps (versions)")
    ap.add_argument("--warmup", type=int, default=2, help="AdamW steps before v0")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--reps", type=int, default=5, help="timing repeats (the min is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    ap.add_argument("--md", type=Path, help="also write the printed report here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--worker", nargs=2, metavar=("WORKDIR", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.world, args.steps, args.reps) < 1 or args.warmup < 0:
        ap.error("--world, --steps, --reps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]))
        return 0
    torch.set_num_threads(1)
    argv_shown = sys.argv[1:] if argv is None else argv
    head = (
        f"$ .venv/bin/python {shlex.join(['benchmarks/fsdp.py', *argv_shown])}\n\n"
        f"{machine_info()}\n"
    )
    print(head, flush=True)
    shape = shape_for(args.params)
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-fsdp-"))
    t0 = time.perf_counter()
    try:
        blob = {k: getattr(args, k) for k in ("world", "steps", "warmup", "lr", "reps", "seed")}
        blob["shape"] = shape.__dict__
        (work / "args.json").write_text(json.dumps(blob))
        launch(work, args.world, args.timeout)
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.world)]
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    body = report(ranks, args, shape) + f"\n\nTotal wall time {time.perf_counter() - t0:.0f} s."
    print(body, flush=True)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(head + "\n" + body + "\n")
    ok = all(r["match"] for r in ranks[0]) and all(
        sum(r[i]["shard_changed"] for r in ranks) == rec["changed"]
        for i, rec in enumerate(ranks[0])
    )
    if not ok:
        print("MISMATCH: a version differs from the single-process diff", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
