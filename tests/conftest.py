"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A real `nats-server -js` process on a free port for the whole session (see natsserver)."""
    from stitch_core.natsserver import NatsServer

    server = NatsServer(tmp_path_factory.mktemp("nats"), port=0).start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server):
    """A nats-py connection to the session server, closed after the test."""
    from stitch_core.announce import connect

    conn = await connect(nats_server.url)
    yield conn
    await conn.close()
