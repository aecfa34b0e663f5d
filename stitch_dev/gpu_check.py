"""GPU check: the core's device paths on one device, compared bit for bit with the CPU, timed.

    python3 scripts/dev.py gpu-check [--device cuda] [--json] [--out FILE]
    python -m stitch_dev.gpu_check --device cpu --numel 4096 --changed 256   # runs here, too

Sections of named checks (docs/benchmarks.md, "GPU check"; any failed check: exit status 1):
``projection`` (bf16, fp8-e4m3-block, fresh and with pinned scales), ``fingerprint`` (CPU numba
sums = device sums = the torch path; `update`), ``diff`` (the same patch bytes from device views),
``apply`` (a patch written in place into device tensors, proven by fingerprints), ``replica``
(`RankReplica` setup / gather / write with read-back / undo / commit on the TP-2 toy engine,
answering as the same calls on CPU engines) and ``follower`` (a `Follower` drives a `Coordinator`
over the device ranks through published versions; `verify` proves every copy). Timings: ms per
1M changed elements of Stitch's diff, fingerprint update, apply and rank write against a bare
``torch.nonzero(a != b)`` and a bare ``index_put_`` (warm-up, synchronised, median).

``--corrupt SECTION`` flips one bit on the device side of that section: it must then fail (a
check that cannot fail proves nothing). Needs the wheel's dependencies, no engine, no network;
never part of `dev.py test`.

Size: about 480 lines, one job: the check (its sections share the comparison, tampering and
report helpers, and the toy engine runs set up once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.replica import RankReplica
from stitch_core.format import codec, dtypes, entropy
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import apply, diff
from stitch_core.format.stp import FOOTER, PatchReader
from stitch_core.format.views import project, view_changed_scales
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import read_manifest
from stitch_dev.toy_engine import ToyEngine, publish_toy_run

SECTIONS = ("projection", "fingerprint", "diff", "apply", "replica", "follower")
VIEWS = ("bf16", "fp8-e4m3-block")
RUN, VERSIONS, WORLD = "gpu-check", 4, 2
BUDGET_S = 300  # the whole check is meant to take at most 5 minutes on a GPU machine
SCALE = "model.layers.1.scale"  # the toy engine's transforming loader: not placed by a layout


class Checks:
    """Named results by section; `tamper` flips one bit on the device side of a corrupted one."""

    def __init__(self, corrupt: list[str]):
        self.rows: list[dict] = []
        self.corrupt, self.tampered = set(corrupt), set()
        self.seconds: dict[str, float] = {}

    def record(self, section: str, check: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"section": section, "check": check, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def tamper(self, section: str, t: torch.Tensor) -> torch.Tensor:
        """Once per corrupted section: flip the lowest bit of `t`'s first element, in place."""
        if section in self.corrupt and section not in self.tampered:
            self.tampered.add(section)
            dtypes.int_view(t.data)[0] ^= 1
        return t

    def same(self, section: str, check: str, cpu: torch.Tensor, dev: torch.Tensor) -> bool:
        dev = self.tamper(section, dev.detach().clone())
        return self.record(section, check, same_bits(cpu, dev), f"{cpu.dtype} {list(cpu.shape)}")

    def run(self, section: str, fn, *args, **kw):
        """`fn(*args, **kw)`; an exception is a failed check of `section` (the rest still runs).
        Its seconds add up per section (a section run inside another counts in both)."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            traceback.print_exc()
            self.record(section, "ran to the end", False, f"{type(e).__name__}: {e}")
            return None
        finally:
            dt = time.perf_counter() - t0
            self.seconds[section] = round(self.seconds.get(section, 0.0) + dt, 2)

    def counts(self) -> dict[str, dict[str, int]]:
        return {s: {"checks": sum(r["section"] == s for r in self.rows),
                    "failed": sum(r["section"] == s and not r["ok"] for r in self.rows)}
                for s in SECTIONS}

    @property
    def ok(self) -> bool:
        """Every section ran checks, and every check passed."""
        return (all(v["checks"] for v in self.counts().values())
                and all(r["ok"] for r in self.rows))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(dtypes.int_view(a), dtypes.int_view(b)))


def masters(side: int, seed: int) -> dict[str, torch.Tensor]:
    """HF-layout fp32 masters: matrices with partial 128-blocks, embeddings, norms, an int."""
    g = torch.Generator().manual_seed(seed)
    r, c = side, side + 77
    m = {"model.embed_tokens.weight": (257, 64, 0.02), "lm_head.weight": (257, 64, 0.02),
         "model.layers.0.mlp.up_proj.weight": (r, c, 0.02),
         "model.layers.0.self_attn.o_proj.weight": (c, r, 0.05),
         "model.layers.0.self_attn.q_proj.bias": (r, 0, 0.01)}
    out = {k: torch.randn(*(d for d in (a, b) if d), generator=g) * s
           for k, (a, b, s) in m.items()}
    out["model.layers.0.input_layernorm.weight"] = 1 + torch.randn(c, generator=g) * 0.01
    out["model.position_ids"] = torch.arange(64)
    return out


def step(m: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An AdamW-like update (every weight moves ~1e-3 relative), one block jumps (new scale)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: (v * (1 + 1e-3 * torch.randn(v.shape, generator=g)) if v.is_floating_point()
               else v.clone()) for k, v in m.items()}
    out["model.layers.0.mlp.up_proj.weight"][:16, :16] *= 50  # clips: that block's scale moves
    return out


# ---------------------------------------------------------------- correctness sections


def check_format(c: Checks, dev: torch.device, side: int) -> None:
    m1, m2 = masters(side, 1), step(masters(side, 1), 2)
    d1, d2 = ({k: v.to(dev) for k, v in m.items()} for m in (m1, m2))
    for view in VIEWS:
        cv1, gv1 = project(m1, view), project(d1, view)
        cv2, gv2 = project(m2, view, previous=cv1), project(d2, view, previous=gv1)
        for tag, cv, gv in (("fresh", cv1, gv1), ("pinned", cv2, gv2)):
            c.record("projection", f"{view} {tag}: same tensors", cv.keys() == gv.keys())
            for k in sorted(cv.keys() & gv.keys()):
                c.same("projection", f"{view} {tag} {k}", cv[k], gv[k])
        if view.startswith("fp8"):  # pinning kept every scale but the clipping block's
            moved = view_changed_scales(gv1, gv2)
            c.record("projection", f"{view}: pinned scales, one block rescaled",
                     moved == view_changed_scales(cv1, cv2) and sum(moved.values()) == 1,
                     str(moved))
        c.run("fingerprint", check_fingerprints, c, view, (cv1, gv1), (cv2, gv2))
        c.run("diff", check_diff_apply, c, dev, view, (cv1, gv1), (cv2, gv2))


def check_fingerprints(c: Checks, view: str, *pairs) -> None:
    for tag, (cv, gv) in zip(("fresh", "pinned"), pairs, strict=True):
        for k in sorted(gv):
            t, want = gv[k], fpr.fingerprint(k, cv[k])
            got = fpr.fingerprint(k, c.tamper("fingerprint", t.clone()))
            c.record("fingerprint", f"{view} {tag} {k}", got == want,
                     f"{fpr.fmt(got)} vs cpu {fpr.fmt(want)}")
            torch_path = fpr.fingerprint_torch(dtypes.int_view(t), t.element_size(),
                                               fpr.seed_of(k))
            c.record("fingerprint", f"{view} {tag} {k} (torch path)", torch_path == want)
    (_, gv1), (cv2, gv2) = pairs
    for k in sorted(gv2):  # incremental update over the changed positions
        a, b = dtypes.int_view(gv1[k]), dtypes.int_view(gv2[k])
        if a.shape != b.shape:
            continue
        pos = torch.nonzero(a != b).reshape(-1)
        sz = gv2[k].element_size()
        got = fpr.update(fpr.fingerprint(k, gv1[k]), k, pos, a[pos].long(), b[pos].long(), sz)
        c.record("fingerprint", f"{view} update {k} ({pos.numel()} changed)",
                 got == fpr.fingerprint(k, cv2[k]))


def check_diff_apply(c: Checks, dev: torch.device, view: str, first, second) -> None:
    (cv1, gv1), (cv2, gv2) = first, second
    cp, gp = diff(cv1, cv2, view=view), diff(gv1, gv2, view=view)
    c.record("diff", f"{view}: same payload and header", same_patch(cp.data, c.tamper(
        "diff", torch.frombuffer(bytearray(gp.data), dtype=torch.uint8)).numpy().tobytes()),
        f"{len(cp.data)} bytes")
    for src, p in (("cpu", cp), ("device", gp)):  # in place into device tensors, proven
        base = {k: v.clone() for k, v in gv1.items()}
        out = c.run("apply", apply, base, p, inplace=True) or {}
        c.record("apply", f"{view}: {src} patch in place on {dev.type}",
                 out is base and all(v.device.type == dev.type for v in out.values()))
        for k in sorted(cv2):
            if src == "cpu" and k in out:
                c.tamper("apply", out[k])
            c.record("apply", f"{view}: {src} patch {k}", k in out and same_bits(cv2[k], out[k]))


def same_patch(a: bytes, b: bytes) -> bool:
    """Two patches equal but for the header's `created` stamp."""
    ha, hb = FOOTER.unpack(a[-FOOTER.size:])[0], FOOTER.unpack(b[-FOOTER.size:])[0]
    if a[:ha] != b[:hb]:
        return False
    with PatchReader(a) as ra, PatchReader(b) as rb:
        return (ra.header.model_dump(exclude={"created"})
                == rb.header.model_dump(exclude={"created"}))


def _engines(views: dict[str, torch.Tensor], dev: torch.device) -> list[ToyEngine]:
    engines = [ToyEngine(r, WORLD).to(dev) for r in range(WORLD)]
    for e in engines:
        e.load_weights(iter(views.items()))
    return engines


def _params_equal(a: list[ToyEngine], b: list[ToyEngine]) -> bool:
    pairs = [(dict(x.named_parameters()), dict(y.named_parameters()))
             for x, y in zip(a, b, strict=True)]
    return all(pa.keys() == pb.keys() and all(same_bits(pa[k], pb[k]) for k in pa)
               for pa, pb in pairs)


def _replies(replies) -> list:
    """Replies as plain comparable values (timings dropped)."""
    def plain(x):
        if isinstance(x, rpc_.Held):
            return (None if x.index is None else x.index.tolist(), x.bits.tolist())
        if isinstance(x, dict):
            return {k: plain(v) for k, v in sorted(x.items())}
        return x
    out = []
    for r in replies:
        d = {k: v for k, v in vars(r).items() if k != "seconds" and not k.endswith("_s")}
        out.append({k: plain(v) for k, v in d.items()})
    return out


def check_replica(c: Checks, dev: torch.device, views: list[dict[str, torch.Tensor]]) -> None:
    v0, v1 = views[0], views[1]
    shapes = {k: (tuple(t.shape), dtypes.info(t.dtype).name) for k, t in v0.items()}
    sides = {}
    for side, where in (("cpu", torch.device("cpu")), ("dev", dev)):
        engines = _engines(v0, where)
        reps = [RankReplica(e, rank_info={"rank": i}) for i, e in enumerate(engines)]
        sides[side] = (engines, reps, [r.setup(shapes) for r in reps])
    (ce, _, csetup), (ge, _, gsetup) = sides["cpu"], sides["dev"]
    c.record("replica", "setup sums equal the CPU ranks'",
             [s.sums for s in csetup] == [s.sums for s in gsetup])
    names = [k for k in v0 if k != SCALE and not torch.equal(dtypes.int_view(v0[k]),
                                                                dtypes.int_view(v1[k]))]
    pos = {k: torch.nonzero(dtypes.int_view(v0[k]) != dtypes.int_view(v1[k])).reshape(-1)
           .numpy() for k in names}
    new = {k: dtypes.int_view(v1[k])[torch.from_numpy(pos[k])].numpy() for k in names}
    truth = dict(v0, **{k: v1[k] for k in names})
    c.record("replica", f"{sum(p.size for p in pos.values())} positions change in "
             f"{len(names)} tensors", len(names) > 0)
    for aid, finish in (("undo-1", "undo"), ("commit-1", "commit")):
        calls = {}
        for side, (engines, reps, _) in sides.items():
            g = [r.gather(aid, pos) for r in reps]
            w = [r.write(aid, new) for r in reps]
            if side != "cpu":
                c.tamper("replica", next(iter(engines[0].parameters())))
            after = _params_equal(engines, _engines(truth, torch.device("cpu")))
            sums = [r.sums() for r in reps]
            done = [getattr(r, finish)(aid) for r in reps]
            calls[side] = (_replies(g), _replies(w), sums, after, _replies(done))
        (cg, cw, cs, _, cd), (gg, gw, gs, gafter, gd) = calls["cpu"], calls["dev"]
        c.record("replica", f"{aid}: gather: old bits equal the CPU ranks'", cg == gg)
        c.record("replica", f"{aid}: write: read-back deltas equal the CPU ranks'", cw == gw)
        c.record("replica", f"{aid}: written engines equal fresh engines", gafter)
        c.record("replica", f"{aid}: sums after the write equal the CPU ranks'", cs == gs)
        c.record("replica", f"{aid}: {finish} answers as on CPU", cd == gd)
        want = v0 if finish == "undo" else truth
        c.record("replica", f"{aid}: after {finish}, engines hold the "
                 f"{'old' if finish == 'undo' else 'new'} bits",
                 _params_equal(ge, _engines(want, torch.device("cpu")))
                 and _params_equal(ce, _engines(want, torch.device("cpu"))))




async def check_follower(c: Checks, dev: torch.device, work: Path, views) -> None:
    board = LocalBoard(work / "board")
    await pull(board, RUN, 0, work / "v0", work / "cache", quiet=True)
    engines = _engines(views[0], dev)
    coord = Coordinator(rpc_.in_process([RankReplica(e, rank_info={"rank": i})
                              for i, e in enumerate(engines)]), run=RUN, loader_fallback=True)
    c.record("follower", "coordinator start proves v0 on the device ranks",
             await coord.start(work / "v0") == 0)
    f = Follower(board, RUN, coord, served=coord.served, cache_dir=work / "cache")
    for v in range(1, VERSIONS):
        await f.catch_up(v)
        m = await read_manifest(board, RUN, v)
        c.record("follower", f"v{v}: applied and proven", coord.version == v == f.version,
                 f"{coord.last_apply and coord.last_apply.get('changed')} changed")
        c.record("follower", f"v{v}: fingerprints are the manifest's", coord.fps == m.fingerprints)
        c.record("follower", f"v{v}: ranks equal fresh engines",
                 _params_equal(engines, _engines(views[v], torch.device("cpu"))))
    c.tamper("follower", engines[1].model.layers[0].qkv_proj.weight)
    c.record("follower", "verify: every copy on every rank proven",
             bool((await coord.verify())["ok"]))


# ---------------------------------------------------------------- timings


def timed(fn, repeat: int, sync, reset=None) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up; `reset` runs untimed."""
    times = []
    for i in range(repeat + 1):
        if reset is not None:
            reset()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _uncoded(pos, old, new, dt, start, stop) -> codec.EncodedChunk:
    """`codec.encode_chunk` without the coding: what is left of `diff` is its device part
    (compare, nonzero, old/new bits, fingerprint update, chunk windows, positions to the host)."""
    k = int(pos.shape[0])
    return codec.EncodedChunk(start, stop, k, "gaps", "raw", None, b"",
                              bytes(entropy.min_stream_bytes(k)))


class _Flat(torch.nn.Module):
    """One bf16 parameter, loaded whole: the rank-side timing's engine."""

    def __init__(self, n: int, dev: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device=dev),
                                         requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.weight.data.copy_(t.reshape(-1))
        return {"weight"}


def timings(c: Checks, dev: torch.device, n: int, k: int, repeat: int) -> list[dict]:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    pos = torch.randperm(n, generator=g)[:k].sort().values.to(dev)
    b = a.clone()
    dtypes.int_view(b)[pos] += 1  # one ULP up: every chosen element changes
    ai, bi, vals = dtypes.int_view(a), dtypes.int_view(b), dtypes.int_view(b)[pos].clone()
    name, base = "model.w.weight", a.clone()
    fp_a = fpr.fingerprint(name, a)
    patch = diff({name: a}, {name: b}, base_fingerprints={name: fp_a})
    rows = []

    def row(op, seconds, bare=None, per="changed", copy=None):
        per_m = seconds * 1e3 / ((k if per == "changed" else n) / 1e6)
        rows.append({"op": op, "ms": seconds * 1e3, "ms_per_1M": per_m, "per": per,
                     "x_bare": None if bare is None else seconds / bare,
                     "x_copy": None if copy is None else seconds / copy})
        return seconds

    reset = lambda: base.copy_(a)  # noqa: E731
    t_nz = row("bare torch.nonzero(a != b)", timed(lambda: torch.nonzero(ai != bi), repeat, sync))
    row("stitch diff (one tensor, base fp known)", timed(
        lambda: diff({name: a}, {name: b}, base_fingerprints={name: fp_a}), repeat, sync), t_nz)

    def nz_down():  # what must reach the host: the changed positions and their new bits
        idx = torch.nonzero(ai != bi).squeeze(1)
        return idx.cpu(), bi[idx].cpu()

    t_nzd = row("bare nonzero + positions, values to host", timed(nz_down, repeat, sync), t_nz)
    with mock.patch.object(codec, "encode_chunk", _uncoded):
        row("stitch diff, coding stubbed (device part)", timed(
            lambda: diff({name: a}, {name: b}, base_fingerprints={name: fp_a}), repeat, sync),
            t_nz, copy=t_nzd)
    old = ai[pos].long()
    row("stitch fingerprint update (changed)", timed(
        lambda: fpr.update(fp_a, name, pos, old, vals.long(), 2), repeat, sync), t_nz)
    row("stitch fingerprint (whole tensor)", timed(lambda: fpr.fingerprint(name, a), repeat,
                                                   sync), per="element")
    bflat = dtypes.int_view(base)
    t_ip = row("bare index_put_", timed(lambda: bflat.index_put_((pos,), vals), repeat, sync,
                                        reset))
    pos_h, vals_h = pos.cpu(), vals.cpu()  # an engine's positions and values arrive on the host
    t_ipu = row("bare positions, values to device + index_put_", timed(
        lambda: bflat.index_put_((pos_h.to(dev),), vals_h.to(dev)), repeat, sync, reset), t_ip)
    row("stitch apply in place (format.apply)", timed(
        lambda: apply({name: base}, patch, inplace=True, base_fingerprints={name: fp_a}),
        repeat, sync, reset), t_ip, copy=t_ipu)
    c.record("apply", f"timing size: {k} of {n} applied in place equal b", same_bits(b, base))
    rep = RankReplica(_Flat(n, dev))
    rep.model.weight.data.copy_(a)
    rep.setup({name: ((n,), "BF16")})
    pos_np, new_np = pos.cpu().numpy(), vals.cpu().numpy()

    def write():
        rep.gather("t", {name: pos_np})
        rep.write("t", {name: new_np})

    row("RankReplica gather + write + read-back", timed(
        write, repeat, sync, lambda: rep.undo("t")), t_ip, copy=t_ipu)
    c.record("replica", "timing size: rank write equals b", same_bits(b, rep.model.weight))
    return rows


# ---------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    out = [f"{'operation':<46} {'median ms':>10} {'ms / 1M':>9} {'x bare':>7} {'x copy':>7}",
           "-" * 83]
    for r in rows:
        x, xc = ("" if r.get(f) is None else f"{r[f]:.1f}" for f in ("x_bare", "x_copy"))
        unit = "" if r["per"] == "changed" else " (per 1M elements)"
        out.append(f"{r['op']:<46} {r['ms']:>10.3f} {r['ms_per_1M']:>9.3f} {x:>7} {xc:>7}{unit}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--numel", type=int, default=1 << 25, help="timing tensor elements")
    p.add_argument("--changed", type=int, default=1 << 21, help="changed elements timed")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (median), after a warm-up")
    p.add_argument("--side", type=int, default=1031, help="rows of the projected matrices")
    p.add_argument("--json", action="store_true", help="print the report as JSON at the end")
    p.add_argument("--out", type=Path, help="write the report as JSON to this file")
    p.add_argument("--corrupt", action="append", default=[], choices=SECTIONS,
                   help="flip one bit on the device side of SECTION: it must then fail")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}); --device cpu runs "
              "the same code on the CPU", file=sys.stderr)
        return 2
    if not 0 < args.changed <= args.numel:
        p.error("need 0 < --changed <= --numel")
    t0, c = time.perf_counter(), Checks(args.corrupt)
    c.run("projection", check_format, c, dev, args.side)
    with tempfile.TemporaryDirectory(prefix="stitch-gpu-check-") as tmp:
        views = c.run("publish", publish_toy_run, Path(tmp) / "board", RUN, VERSIONS)
        c.run("replica", check_replica, c, dev, views)
        c.run("follower", lambda: asyncio.run(check_follower(c, dev, Path(tmp), views)))
    rows = c.run("timings", timings, c, dev, args.numel, args.changed, args.repeat) or []
    report = {"ok": c.ok, "device": str(dev), "device_name": (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"),
        "torch": torch.__version__, "numel": args.numel, "changed": args.changed,
        "repeat": args.repeat, "seconds": round(time.perf_counter() - t0, 2),
        "sections": c.counts(), "section_seconds": c.seconds,
        "checks": c.rows, "timings": rows}
    for r in c.rows:
        if not r["ok"]:
            print(f"FAILED {r['section']}: {r['check']} {r['detail']}")
    for s, v in report["sections"].items():
        state = "ok" if v["checks"] and not v["failed"] else "FAILED"
        print(f"{s:<12} {v['checks']:>4} checks  {v['failed']:>3} failed  {state}")
    print(f"\n{report['device_name']} ({dev}), torch {torch.__version__}, {args.changed:,} of "
          f"{args.numel:,} bf16 elements changed\n{table(rows)}\n")
    over = report["seconds"] > BUDGET_S
    print(f"gpu-check: {'ok' if c.ok else 'FAILED'} in {report['seconds']} s"
          + (f" (over the {BUDGET_S} s budget: lower --numel / --repeat)" if over else ""))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return 0 if c.ok else 1


if __name__ == "__main__":
    sys.exit(main())
