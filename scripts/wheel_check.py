#!/usr/bin/env python3
"""Check an installed `stitch-rl` the way a user gets it: from its wheel, outside the checkout.

    <venv>/bin/python scripts/wheel_check.py [--engine vllm|sglang] [--json]

Run by `python3 scripts/dev.py test` in a clean venv that holds only the wheel and its declared
dependencies (and again in each engine venv with ``--engine``). It works in a temporary directory,
so nothing is imported from the checkout, and fails (exit 1) unless

* every ``stitch_*`` package is imported from site-packages, not from a source tree;
* every module of the distribution imports (engine plugin modules: in their engine's venv; in the
  clean venv an engine module may only fail for want of its engine);
* the wheel ships no test or development code (``stitch_dev``, ``tests``, test models);
* the plugin entry points (``vllm.general_plugins``, ``sglang.srt.plugins``) and the ``stitch``
  console script are declared by the installed distribution and load;
* a CLI round trip works: ``stitch diff``/``inspect``/``apply``, then ``stitch publish`` of two
  versions to a local board, ``stitch versions --json`` and ``stitch pull``, the pulled tensors
  bit-identical to the published view.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path

DIST = "stitch-rl"
PACKAGES = ("stitch_core", "stitch_trainer", "stitch_vllm", "stitch_sglang")
ENGINE_OF = {"stitch_vllm": "vllm", "stitch_sglang": "sglang"}
# optional frameworks a module may need beyond the wheel's own dependencies
OPTIONAL = {"vllm", "sglang", "transformers", "accelerate", "trl", "megatron", "matplotlib",
            "datasets"}
ENTRY_POINTS = {("vllm.general_plugins", "stitch"): "stitch_vllm.plugin:register",
                ("sglang.srt.plugins", "stitch"): "stitch_sglang.plugin:register",
                ("console_scripts", "stitch"): "stitch_core.cli:main"}


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.notes: list[str] = []

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        print(f"FAIL {msg}", flush=True)

    def ok(self, msg: str) -> None:
        self.notes.append(msg)
        print(f"ok   {msg}", flush=True)


def check_location(c: Check) -> None:
    site = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"],
                                        sysconfig.get_paths()["platlib"])}
    for pkg in PACKAGES:
        try:
            mod = importlib.import_module(pkg)
        except Exception as e:  # noqa: BLE001 - e.g. a subpackage missing from the wheel
            c.fail(f"import {pkg}: {type(e).__name__}: {e}")
            continue
        where = Path(mod.__file__).resolve().parent.parent
        if where not in site:
            c.fail(f"{pkg} imported from {where}, not from the installed distribution")
    if not c.failures:
        c.ok(f"packages imported from {sorted(map(str, site))[0]}")


def check_contents(c: Check) -> None:
    files = [str(f) for f in md.files(DIST) or []]
    tops = sorted({f.split("/")[0] for f in files  # (../../bin/stitch: the console script)
                   if "/" in f and ".dist-info" not in f and not f.startswith("..")})
    if tops != sorted(PACKAGES):
        c.fail(f"top-level packages in the wheel: {tops}, expected {sorted(PACKAGES)}")
    bad = [f for f in files if f.startswith(("stitch_dev/", "tests/", "benchmarks/"))
           or "testmodel" in f or "/stub/" in f]
    if bad:
        c.fail(f"test or development code in the wheel: {bad[:5]}")
    else:
        c.ok(f"{len(files)} files, packages {', '.join(tops)}; no test code")


def check_imports(c: Check, engine: str | None) -> None:
    n = 0
    for pkg in PACKAGES:
        try:
            mod = importlib.import_module(pkg)
        except Exception:  # noqa: BLE001 - reported by check_location
            continue
        # (a `__main__` module is a program: importing it would run it)
        names = [pkg] + [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")
                         if not m.name.endswith(".__main__")]
        for name in names:
            try:
                importlib.import_module(name)
                n += 1
            except ModuleNotFoundError as e:
                missing = (e.name or "").split(".")[0]
                # an optional framework, except the engine this venv is for
                if missing in OPTIONAL and not (engine and ENGINE_OF.get(pkg) == engine):
                    c.notes.append(f"{name}: needs {missing} (not in this venv)")
                    continue
                c.fail(f"import {name}: {e}")
            except Exception:  # noqa: BLE001 - any import-time error is a packaging defect
                c.fail(f"import {name}:\n{traceback.format_exc(limit=3)}")
    c.ok(f"{n} modules imported" + (f" (with {engine})" if engine else ""))


def check_entry_points(c: Check, engine: str | None) -> None:
    eps = md.distribution(DIST).entry_points
    for (group, name), value in ENTRY_POINTS.items():
        found = [e for e in eps if e.group == group and e.name == name]
        if not found or found[0].value != value:
            c.fail(f"entry point {group}:{name} = {value} not declared (got {found})")
            continue
        ep = found[0]
        if group == "console_scripts" or ENGINE_OF.get(value.split(".")[0]) == engine:
            try:
                ep.load()
            except Exception as e:  # noqa: BLE001
                c.fail(f"entry point {group}:{name} does not load: {e}")
    # what the engine itself discovers (vLLM and SGLang use importlib.metadata entry points)
    if engine:
        group = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}[engine]
        seen = [e.value for e in md.entry_points(group=group)]
        if ENTRY_POINTS[(group, "stitch")] not in seen:
            c.fail(f"{engine} would not discover the plugin: {group} has {seen}")
    c.ok("entry points declared" + (f"; {engine} discovers the plugin" if engine else ""))


def _stitch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("stitch", path=str(Path(sys.executable).parent))
    if exe is None:
        raise RuntimeError("the stitch console script is not installed in this venv")
    r = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"stitch {' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return r


def check_cli(c: Check, work: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    before = len(c.failures)
    g = torch.Generator().manual_seed(0)
    v0 = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g),
          "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g) * 0.05,
          "model.norm.weight": torch.ones(32)}
    v1 = {k: t.clone() for k, t in v0.items()}
    v1["model.layers.0.mlp.up_proj.weight"][::7] += 1e-2
    v1["model.norm.weight"][3] = 1.5
    for name, state in (("v0", v0), ("v1", v1)):
        save_file(state, str(work / f"{name}.safetensors"))
    try:
        bf = {n: {k: t.to(torch.bfloat16) for k, t in s.items()} for n, s in (("a", v0), ("b", v1))}
        for n, s in bf.items():
            save_file(s, str(work / f"{n}.safetensors"))
        _stitch("diff", "a.safetensors", "b.safetensors", "-o", "ab.stp", cwd=work)
        _stitch("inspect", "ab.stp", cwd=work)
        _stitch("apply", "a.safetensors", "ab.stp", "-o", "b2.safetensors", cwd=work)
        got = load_file(str(work / "b2.safetensors"))
        if any(not torch.equal(got[k].view(torch.int16), t.view(torch.int16))
               for k, t in bf["b"].items()):
            c.fail("stitch diff/apply did not reconstruct the target bit for bit")
        board = work / "board"
        for i, name in enumerate(("v0", "v1")):
            _stitch("publish", str(board), f"{name}.safetensors", "--run", "wheel",
                    "--step", str(i), "--json", cwd=work)
        listed = json.loads(_stitch("versions", str(board), "--run", "wheel", "--json",
                                    cwd=work).stdout)
        versions = sorted(v["version"] for v in (listed if isinstance(listed, list)
                                                 else listed.get("versions", [])))
        if versions != [0, 1]:
            c.fail(f"stitch versions lists {versions}, expected [0, 1]")
        _stitch("pull", str(board), "--run", "wheel", "--version", "1", "-o", "pulled",
                "--cache-dir", str(work / "cache"), cwd=work)
        pulled = {}
        for f in sorted((work / "pulled").glob("*.safetensors")):
            pulled.update(load_file(str(f)))
        want = {k: t.to(torch.bfloat16) for k, t in v1.items()}
        if set(pulled) != set(want) or any(
                not torch.equal(pulled[k].view(torch.int16), want[k].view(torch.int16))
                for k in want):
            c.fail("stitch pull of v1 is not bit-identical to the published bf16 view")
    except RuntimeError as e:
        c.fail(str(e))
        return
    if len(c.failures) == before:
        c.ok("CLI round trip: diff/inspect/apply, publish x2, versions, pull (bit-identical)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(set(ENGINE_OF.values())))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    # nothing from the checkout: drop the script's own directory and the cwd from sys.path
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() not in
                   (here, here / "scripts", Path.cwd().resolve())]
    c = Check()
    with tempfile.TemporaryDirectory(prefix="stitch-wheel-") as tmp:
        os.chdir(tmp)
        try:
            dist = md.distribution(DIST)
            c.ok(f"{DIST} {dist.version} installed")
            check_location(c)
            check_contents(c)
            check_imports(c, a.engine)
            check_entry_points(c, a.engine)
            if a.engine is None:
                check_cli(c, Path(tmp))
        except md.PackageNotFoundError:
            c.fail(f"{DIST} is not installed in {sys.prefix}")
    if a.json:
        print(json.dumps({"ok": not c.failures, "failures": c.failures, "notes": c.notes}))
    print(f"wheel check: {'ok' if not c.failures else f'{len(c.failures)} failures'}")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
