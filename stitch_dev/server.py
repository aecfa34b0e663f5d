"""An engine's HTTP server as a subprocess, with the Stitch status helpers the engine suites, the
engine benchmark and the demo poll it with. Needs httpx (every engine venv has it), nothing of
stitch_core: the engine benchmark's child imports it before its engine exists."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from .procs import stop


class ServerProcess:
    """An engine's HTTP server as a user runs it: a subprocess in its own process group, its
    output in `log`, with the Stitch status helpers."""

    name = "engine"
    # SIGTERM the whole group (vLLM) or only the launcher (SGLang's launcher stops its own
    # schedulers, and takes their SIGTERM as a crash)
    signal_group = True

    def __init__(self, cmd: list[str], env: Mapping[str, str], port: int, model: str,
                 log: Path, *, cwd: Path | None | str = "log", timeout: float = 120):
        """`cwd`: by default the log's folder (outside the checkout, so the engine imports
        Stitch from its venv's installed distribution, entry points and modules, as a user's
        engine does); None: this process's."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        self.log = log
        self._logf = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=dict(env), stdout=self._logf,
                                     cwd=log.parent if cwd == "log" else cwd,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=timeout)

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def wait_version(self, version: int, timeout: float = 400, poll: float = 0.25) -> dict:
        """Poll /stitch/status every `poll` s until the engine serves `version` (fails fast if it
        died)."""
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
            time.sleep(poll)
        raise TimeoutError(f"engine not at v{version} after {timeout}s: {last}\n{self.tail()}")

    def wait_applied(self, version: int, timeout: float = 400) -> dict:
        """`wait_version`, then until ``last_apply`` is that version's: the status switches
        `version` inside the apply's pause and fills `last_apply` once the ranks committed, a few
        ms later (outside the pause)."""
        deadline = time.monotonic() + timeout
        st = self.wait_version(version, timeout)
        while (st.get("last_apply") or {}).get("version") != version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"v{version} served but no apply of it recorded: {st}")
            time.sleep(0.05)
            st = self.status()
        return st

    def wait_healthy(self, timeout: float = 400) -> float:
        """Poll /health until 200 (SGLang: its own warm-up request passed); the seconds it
        took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            self._alive()
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s\n{self.tail()}")

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


def verify_clean(server: ServerProcess) -> None:
    """`POST /stitch/verify`: every tensor and every derived copy proven."""
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True and check["stale_derived"] == [], check


def wait_rejected(status, timeout: float = 60.0) -> dict:
    """Poll `status()` (an engine's /stitch/status) until its follower reports an error."""
    deadline = time.monotonic() + timeout
    st = status()
    while time.monotonic() < deadline and not (st.get("follower") or {}).get("last_error"):
        time.sleep(0.2)
        st = status()
    return st


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
