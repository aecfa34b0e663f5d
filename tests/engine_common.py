"""Parts shared by the engine suites (tests/vllm and tests/sglang run in venvs of their own, both
with stitch installed and transformers available): the server subprocess with its Stitch status
helpers, the vLLM server command (the SGLang suite starts one too), the trainer that publishes a
run, and a forged version for the "refuse, keep serving, recover" tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import diff
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.store import object_ref, read_manifest, write_version

from .procs import stop


class ServerProcess:
    """An engine's HTTP server as a user runs it: a subprocess in its own process group, its
    output in `log`, with the Stitch status helpers."""

    name = "engine"
    # SIGTERM the whole group (vLLM) or only the launcher (SGLang's launcher stops its own
    # schedulers, and takes their SIGTERM as a crash)
    signal_group = True

    def __init__(self, cmd: list[str], env: Mapping[str, str], port: int, model: str,
                 log: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        self.log = log
        self._logf = open(log, "wb")  # noqa: SIM115 (closed in stop)
        # run outside the checkout, so the engine imports Stitch from its venv's installed
        # distribution (entry points and modules), as a user's engine does
        self.proc = subprocess.Popen(cmd, env=dict(env), stdout=self._logf, cwd=log.parent,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def wait_version(self, version: int, timeout: float = 400) -> dict:
        """Poll /stitch/status until the engine serves `version` (fails fast if it died)."""
        deadline = time.monotonic() + timeout
        last: dict | str = "no answer"
        while time.monotonic() < deadline:
            self._alive()
            try:
                r = self.http.get("/stitch/status", timeout=5)
                last = r.json()
                if last.get("version") == version and last.get("state") == "serving":
                    return last
            except (httpx.HTTPError, ValueError) as e:
                last = str(e)
            time.sleep(0.25)
        raise TimeoutError(f"engine not at v{version} after {timeout}s: {last}\n{self.tail()}")

    def status(self) -> dict:
        return self.http.get("/stitch/status").json()

    def tail(self, n: int = 60) -> str:
        self._logf.flush()
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM, wait for the process group to empty, SIGKILL what is left after `grace`."""
        self.http.close()
        stop(self.proc, grace, self.signal_group)
        self._logf.close()


def vllm_cmd(python: str, model: str, port: int, tp: int = 1,
             max_model_len: int = 256) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the Stitch worker extension and
    middleware, small CPU settings."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--max-num-seqs", "4", "--port", str(port), "--seed", "0",
           "--generation-config", "vllm",
           "--worker-extension-cls", "stitch_vllm.worker.StitchWorkerExtension",
           "--middleware", "stitch_vllm.server.StitchMiddleware"]
    if tp > 1:
        cmd += ["-tp", str(tp), "--distributed-executor-backend", "mp"]
    return cmd


def vllm_env(base: Mapping[str, str], tp: int = 1, **stitch: str) -> dict[str, str]:
    """`base` with vLLM's CPU settings (1 GB KV cache, one core per rank) and STITCH_* set from
    `stitch`."""
    env = dict(base)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_CPU_OMP_THREADS_BIND="nobind" if tp == 1 else "|".join(
                   str(i % (os.cpu_count() or 1)) for i in range(tp)))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update({f"STITCH_{k.upper()}": str(v) for k, v in stitch.items()})
    return env


class Trainer:
    """A real HF model trained by transformers with AdamW on random tokens, publishing every
    step (v0 is the untrained model)."""

    def __init__(self, model_dir, board, nats: str, run: str, lr: float = 2e-3,
                 signing_key: Path | None = None):
        from transformers import AutoModelForCausalLM

        from stitch_trainer import Publisher

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.g = torch.Generator().manual_seed(0)
        self.pub = Publisher(str(board), run, "bf16", nats=nats, config_dir=model_dir,
                             signing_key=signing_key)
        self.step = 0
        self.lock = threading.Lock()

    def view(self) -> dict[str, torch.Tensor]:
        """The served bf16 view of the current weights (what the Publisher ships)."""
        return {k: v.detach().to(torch.bfloat16).clone()
                for k, v in self.model.state_dict().items() if k != "lm_head.weight"
                or not self.model.config.tie_word_embeddings}

    def train(self) -> None:
        """One AdamW step on random tokens (`publish(train=False)` then ships it)."""
        with self.lock:
            x = torch.randint(0, self.model.config.vocab_size, (4, 16), generator=self.g)
            loss = self.model(input_ids=x, labels=x).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self._trained = True

    def publish(self, train: bool = True) -> int:
        """Train one step (none for v0; none when `train()` already ran), publish, wait until
        it is on the board. A test that needs the publish itself to be quick (an apply landing
        while a request streams) trains first."""
        if train and self.step and not getattr(self, "_trained", False):
            self.train()
        with self.lock:
            v = self.pub.publish(self.step, self.model).result().version
            self.step += 1
            self._trained = False
            return v


def follow_versions(trainer: Trainer, server: ServerProcess, n: int, request) -> list[int]:
    """Publish `n` versions; after each, `request(v)` (a request pinned to v that waits for it)
    must answer 200 and the server's last apply be v. Returns the elements each apply changed,
    every one of them > 0 (a test whose versions change nothing could not fail)."""
    changed = []
    for _ in range(n):
        v = trainer.publish()
        r = request(v)
        assert r.status_code == 200, r.text
        last = server.status()["last_apply"]
        assert last["version"] == v
        changed.append(last["changed"])
    assert all(changed), changed
    return changed


def verify_clean(server: ServerProcess) -> None:
    """`POST /stitch/verify`: every tensor and every derived copy proven."""
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True and check["stale_derived"] == [], check


@dataclass
class ForgedVersion:
    """Version v + 1 written by hand: its manifest claims the fingerprints of a real next state,
    but the patch first put on the board produces another state (a forged or corrupted upload).
    `repair()` puts the right patch and manifest in place, as an operator would."""

    board_dir: Path
    run: str
    version: int
    stage: Path
    bad: Manifest
    good: Manifest

    def publish_bad(self) -> None:
        asyncio.run(write_version(LocalBoard(self.board_dir), self.bad,
                                  {"patch.stp": self.stage / "bad" / "patch.stp"},
                                  expected_latest=self.version - 1))

    def repair(self) -> None:
        vdir = self.board_dir / self.run / "versions" / f"{self.version:06d}"
        (vdir / "patch.stp").write_bytes((self.stage / "good" / "patch.stp").read_bytes())
        (vdir / "manifest.json").write_text(self.good.model_dump_json(indent=1))


def forge_next_version(trainer: Trainer, board_dir: Path, run: str, v: int,
                       stage: Path) -> ForgedVersion:
    """Forge v + 1 on top of the trainer's current state, which must be version v."""
    good = asyncio.run(read_manifest(LocalBoard(board_dir), run, v))
    with trainer.lock:
        cur = trainer.view()
    assert good.fingerprints == fpr.state_fingerprints(cur)
    nxt = {k: t.clone() for k, t in cur.items()}
    other = {k: t.clone() for k, t in cur.items()}
    for t in nxt.values():
        t.view(-1)[::97] = (t.view(-1)[::97].float() * 1.01 + 1e-3).to(torch.bfloat16)
    for t in other.values():
        t.view(-1)[::89] = (t.view(-1)[::89].float() * 0.99 - 1e-3).to(torch.bfloat16)
    (stage / "bad").mkdir(parents=True)
    (stage / "good").mkdir()
    kw = dict(run=run, base_version=v, target_version=v + 1, view="bf16")
    diff(cur, other, **kw).write(stage / "bad" / "patch.stp")
    diff(cur, nxt, **kw).write(stage / "good" / "patch.stp")
    fps = fpr.state_fingerprints(nxt)
    tensors = [t.model_copy(update={"fingerprint": fpr.fmt(fps[t.name])}) for t in good.tensors]

    def manifest(which: str) -> Manifest:
        ref = object_ref(stage / which / "patch.stp", "patch")
        return Manifest(run=run, version=v + 1, parent=v, kind="patch", view="bf16",
                        created=good.created, producer="test", tensors=tensors,
                        digest=fpr.digest((t.name, t.dtype, tuple(t.shape), fps[t.name])
                                          for t in tensors),
                        objects=[ref], total_elements=good.total_elements)

    return ForgedVersion(board_dir, run, v + 1, stage, manifest("bad"), manifest("good"))


def wait_rejected(status, timeout: float = 60.0) -> dict:
    """Poll `status()` (an engine's /stitch/status) until its follower reports an error."""
    deadline = time.monotonic() + timeout
    st = status()
    while time.monotonic() < deadline and not (st.get("follower") or {}).get("last_error"):
        time.sleep(0.2)
        st = status()
    return st


def sse_events(text: str) -> list[tuple[str | None, object]]:
    """(event name or None, data: parsed JSON or '[DONE]') of each event of an SSE body."""
    import json

    out: list[tuple[str | None, object]] = []
    for ev in text.replace("\r\n", "\n").split("\n\n"):
        lines = ev.splitlines()
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = "\n".join(ln[6:] if ln.startswith("data: ") else ln[5:]
                         for ln in lines if ln.startswith("data:"))
        if data:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def wait_started(server: ServerProcess, timeout: float = 400) -> dict:
    """Poll /stitch/status until the engine's start-up check ran (whether or not it serves)."""
    deadline = time.monotonic() + timeout
    last: dict | str = "no answer"
    while time.monotonic() < deadline:
        server._alive()
        try:
            last = server.http.get("/stitch/status", timeout=5).json()
            if "fingerprint_check" in last or "error" in last:
                return last
        except (httpx.HTTPError, ValueError) as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"{server.name}: no start-up check after {timeout}s: {last}\n"
                       f"{server.tail()}")
