"""`stitch gateway` in front of a real vLLM engine and a real SGLang engine of one run, serving
different versions: requests go to the engine that serves what they ask for, a wait header waits
for an engine to get there, the answers keep their stamps and stream through.

The SGLang engine follows a frozen copy of the board (taken after v1): it sees the announcements
of later versions but its board never has them, so it stays at v1 while vLLM follows on. The
gateway runs as users run it (`stitch gateway`, the installed CLI). Like test_cross_engine.py it
starts the vLLM server with STITCH_VLLM_PYTHON (scripts/dev.py points it at .venv-vllm).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")


from stitch_core.serve import protocol  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.ports import free_port  # noqa: E402
from stitch_dev.procs import sglang_cmd, stop  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import Stamp, sse_events  # noqa: E402
from .engines import Engine, VllmServer, engine_env, vllm_python  # noqa: E402

RUN = "sg-gateway"
VLLM_PYTHON = vllm_python()


class SglangServer(Engine):
    name = "SGLang server"

    def __init__(self, model_dir: Path, log: Path, **stitch: str):
        port = free_port()
        stitch["engine_url"] = f"http://127.0.0.1:{port}"
        super().__init__(sglang_cmd(sys.executable, str(model_dir), port, 1,
                                    ["--random-seed", "0"]),
                         engine_env(1, False, **stitch), port, str(model_dir), log)


class GatewayProcess:
    def __init__(self, nats: str, log: Path, **opts: str):
        self.port = free_port()
        args = [a for k, v in opts.items() for a in (f"--{k}", v)]
        self._logf = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.log = log
        # outside the checkout: the installed `stitch` CLI, as a user runs it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stitch_core.cli", "gateway", "--nats", nats, "--run", RUN,
             "--port", str(self.port), *args], stdout=self._logf, stderr=subprocess.STDOUT,
            cwd=log.parent, start_new_session=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=180)

    def status(self) -> dict:
        return self.http.get("/stitch/gateway").json()

    def wait(self, cond, timeout: float = 120) -> dict:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.log.read_text()[-3000:]}")
            try:
                last = self.status()
                if cond(last):
                    return last
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway never got there: {last}")

    def stop(self) -> None:
        self.http.close()
        stop(self.proc, 10, True)
        self._logf.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, nats_server):
    tmp = tmp_path_factory.mktemp("gateway")
    model_dir = build_tiny_model(tmp / "model", arch="qwen2")
    trainer = AdamWTrainer(model_dir, tmp / "board", nats_server.url, RUN)
    procs: list = []
    try:
        assert trainer.publish() == 0
        asyncio.run(pull(LocalBoard(tmp / "board"), RUN, 0, tmp / "v0", tmp / "cache",
                         quiet=True))
        assert trainer.publish() == 1
        shutil.copytree(tmp / "board", tmp / "board-v1")  # frozen at v1
        common = dict(nats_url=nats_server.url, run=RUN, reconcile_interval="1")
        procs.append(VllmServer(VLLM_PYTHON, tmp / "v0", tmp / "vllm.log", board=str(tmp / "board"),
                                cache_dir=str(tmp / "vllm-cache"), engine_id="vllm",
                                region="eu", **common))
        procs.append(SglangServer(tmp / "v0", tmp / "sglang.log",
                                  board=str(tmp / "board-v1"),
                                  cache_dir=str(tmp / "sglang-cache"), engine_id="sglang",
                                  region="us", **common))
        vllm, sglang = procs
        for e in procs:
            e.wait_version(1, timeout=600)
        assert trainer.publish() == 2
        vllm.wait_version(2, timeout=120)
        gw = GatewayProcess(nats_server.url, tmp / "gateway.log", region="us", id="gw-test")
        procs.append(gw)
        gw.wait(lambda s: s["versions"] == [1, 2] and s["routable"] == 2)
        yield trainer, vllm, sglang, gw
    finally:
        for p in reversed(procs):
            p.stop()
        trainer.pub.close()


def complete(gw: GatewayProcess, model: str, headers: dict, **kw) -> httpx.Response:
    return gw.http.post("/v1/completions", headers=headers, json={
        "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **kw})


def test_each_request_goes_to_an_engine_serving_its_version(fleet):
    trainer, vllm, sglang, gw = fleet
    r = complete(gw, vllm.model, {protocol.MIN_VERSION_HEADER: "2"})
    assert r.status_code == 200, r.text
    assert r.headers["x-stitch-engine"] == "vllm"
    assert r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "2"
    assert r.json()["stitch"] == Stamp(RUN, 2)
    r = complete(gw, sglang.model, {protocol.VERSION_HEADER: "1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-stitch-engine"] == "sglang"
    assert r.json()["stitch"] == Stamp(RUN, 1)
    # unpinned: the gateway's own region (us) first
    r = complete(gw, vllm.model, {})
    assert r.status_code == 200 and r.headers["x-stitch-engine"] == "sglang"
    # an exact version no engine serves any more, or none yet within a short wait
    r = complete(gw, vllm.model, {protocol.VERSION_HEADER: "0"})
    assert r.status_code == 409 and protocol.parse_not_ready(r.json()).reason == "passed"
    t0 = time.monotonic()
    r = complete(gw, vllm.model, {protocol.MIN_VERSION_HEADER: "9", protocol.WAIT_HEADER: "1"})
    assert r.status_code == 409 and time.monotonic() - t0 >= 0.9
    err = protocol.parse_not_ready(r.json())
    assert err.reason == "behind" and err.wanted == 9 and err.serving == 2
    rows = {e["id"]: e for e in gw.status()["engines"]}
    assert rows["vllm"]["version"] == 2 and rows["sglang"]["version"] == 1
    assert rows["sglang"]["region"] == "us"
    # the gateway's own count is exact once the responses are back; the engine's `load` is what
    # its last heartbeat counted, and a heartbeat sent during a request above counted that one
    assert rows["vllm"]["in_flight"] == rows["sglang"]["in_flight"] == 0
    deadline = time.monotonic() + 30
    while rows["vllm"]["load"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = {e["id"]: e for e in gw.status()["engines"]}
    assert rows["vllm"]["load"] == 0, rows["vllm"]


def test_a_wait_header_waits_for_an_engine_to_get_there(fleet):
    trainer, vllm, sglang, gw = fleet
    out: dict = {}

    def ask() -> None:
        out["r"] = complete(gw, vllm.model, {protocol.MIN_VERSION_HEADER: "3",
                                             protocol.WAIT_HEADER: "180"})

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(1.0)
    assert t.is_alive()  # nothing serves v3 yet
    assert trainer.publish() == 3
    t.join(200)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-stitch-engine"] == "vllm" and r.json()["stitch"]["version_start"] == 3
    assert gw.status()["waited_total"] >= 1
    # the frozen SGLang engine still serves v1 for those who pin it
    r = complete(gw, sglang.model, {protocol.VERSION_HEADER: "1"})
    assert r.status_code == 200 and r.headers["x-stitch-engine"] == "sglang"


def test_sse_streams_through_with_the_engine_stamp(fleet):
    trainer, vllm, sglang, gw = fleet
    for engine, version in (("sglang", "1"), ("vllm", None)):
        headers = {protocol.VERSION_HEADER: version} if version else {
            protocol.MIN_VERSION_HEADER: "2"}
        with gw.http.stream("POST", "/v1/completions", headers=headers, json={
                "model": vllm.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["x-stitch-engine"] == engine
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = list(r.iter_raw())
        evs = sse_events(b"".join(chunks).decode())
        assert evs[-1] == (None, "[DONE]")
        stamp = [d["stitch"] for _, d in evs if isinstance(d, dict) and "stitch" in d]
        assert len(stamp) == 1 and stamp[0]["run"] == RUN
        if version:
            assert stamp[0]["version_start"] == stamp[0]["version_end"] == 1
        else:
            assert stamp[0]["version_start"] >= 2
    m = gw.http.get("/metrics").text
    assert f'stitch_gateway_engine_up{{run="{RUN}",engine="sglang"}} 1' in m.splitlines()
