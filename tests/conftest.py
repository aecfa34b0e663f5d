"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A real `nats-server -js` process on a free port for the whole session (see natsserver)."""
    from stitch_core.versions.natsserver import NatsServer

    server = NatsServer(tmp_path_factory.mktemp("nats"), port=0).start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server):
    """A nats-py connection to the session server, closed after the test."""
    from stitch_core.versions.nats_conn import connect

    conn = await connect(nats_server.url)
    yield conn
    await conn.close()


# ------------------------------------------------------------------ a board origin and its relay
# The relay tests (tests/test_relay*.py): a real `stitch board serve` counting what it answers
# (what crossed the 'WAN') and a real nginx relay in front of it.


@pytest.fixture
def origin(tmp_path):
    from stitch_dev.board_origin import start_origin, stop_origin

    root = tmp_path / "board"
    root.mkdir()
    srv = start_origin(root)
    yield srv
    stop_origin(srv)


@pytest.fixture
def relay(origin, tmp_path):
    from stitch_core.versions.relay import NginxRelay, find_nginx
    from stitch_dev.ports import free_port

    find_nginx()  # RelayError (a failure, not a skip) when nginx is missing
    r = NginxRelay(origin.url, free_port(), tmp_path / "relay").start()
    yield r
    r.stop()


# ------------------------------------------------------------------ which CPU weight path ran
# The engine suites say which of the engine's CPU GEMM paths each test exercised (vLLM packs
# weights with AMX or oneDNN where the CPU can, and reads the parameters directly elsewhere), so a
# run on a host that does not pack is visible as such, never silently counted as the packed case.
_CPU_PATHS: dict[str, str] = {}


def describe_cpu_paths(kinds: dict[str, int]) -> str:
    """'amx 120, onednn 49' from {kind: count}; what a host that packs nothing gets, said so."""
    return (", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
            or "nothing packed (kernels read the parameters)")


@pytest.fixture
def record_cpu_path(request):
    """record_cpu_path(kinds, dtype): note the packed copies an engine kept in step in a test."""
    def record(kinds: dict[str, int], dtype: str = "bfloat16") -> None:
        text = f"{dtype}: {describe_cpu_paths(kinds)}"
        prev = _CPU_PATHS.get(request.node.nodeid)
        _CPU_PATHS[request.node.nodeid] = f"{prev}; {text}" if prev else text
        print(f"CPU weight path: {text}")

    return record


def pytest_terminal_summary(terminalreporter):
    if not _CPU_PATHS:
        return
    import torch

    caps = torch.backends.cpu.get_cpu_capability()
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    terminalreporter.section(
        f"CPU weight paths exercised (host: {caps}, AMX {'yes' if amx else 'no'})")
    for nodeid, text in _CPU_PATHS.items():
        terminalreporter.line(f"{nodeid}: {text}")
