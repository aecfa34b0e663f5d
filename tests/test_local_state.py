"""Local state is private and writes are create-only: the default cache is per user (mode 0700),
a download never writes through a symlink planted at its temporary file, and two writers of one
key on a local board cannot both be told "stored"."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from stitch_core.versions.board import BoardError, LocalBoard
from stitch_core.versions.board.base import part_path
from stitch_core.versions.board.http import HttpBoard
from stitch_core.versions.board.serve import serve
from stitch_core.versions.materialize import default_cache_dir


def test_default_cache_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    d = default_cache_dir()
    assert d == tmp_path / "xdg" / "stitch"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o777)  # loosened by someone: tightened again, not trusted as it is
    assert stat.S_IMODE(default_cache_dir().stat().st_mode) == 0o700


async def _planted(tmp_path, board, key: str):
    """A victim file, and a symlink to it where the download's temporary file goes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dest = tmp_path / "cache" / "obj.bin"
    dest.parent.mkdir(parents=True)
    os.symlink(victim, part_path(dest))
    await board.get_file(key, dest)
    return victim, dest


async def test_a_planted_part_symlink_is_not_followed_local(tmp_path):
    board = LocalBoard(tmp_path / "board")
    await board.put("r/versions/000000/obj.bin", b"payload")
    victim, dest = await _planted(tmp_path, board, "r/versions/000000/obj.bin")
    assert victim.read_text() == "precious"
    assert dest.read_bytes() == b"payload" and not dest.is_symlink()


async def test_a_planted_part_symlink_is_not_followed_http(tmp_path):
    root = tmp_path / "board"
    await LocalBoard(root).put("r/versions/000000/obj.bin", b"payload over http")
    server = serve(root, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        board = HttpBoard(f"http://127.0.0.1:{server.server_port}")
        victim, dest = await _planted(tmp_path, board, "r/versions/000000/obj.bin")
        await board.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert victim.read_text() == "precious"
    assert dest.read_bytes() == b"payload over http"


def test_two_writers_of_one_key_cannot_both_be_told_stored(tmp_path):
    board = LocalBoard(tmp_path / "board")
    import asyncio

    results: dict[int, str] = {}
    go = threading.Barrier(8)

    def writer(i: int) -> None:
        go.wait()
        try:
            asyncio.run(board.put("r/versions/000001/patch.stp", f"writer {i}".encode() * 1000))
            results[i] = "stored"
        except BoardError:
            results[i] = "refused"

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = [i for i, r in results.items() if r == "stored"]
    assert len(stored) == 1, results
    data = (tmp_path / "board" / "r/versions/000001/patch.stp").read_bytes()
    assert data == f"writer {stored[0]}".encode() * 1000
    leftovers = [p.name for p in (tmp_path / "board" / "r/versions/000001").iterdir()
                 if p.name != "patch.stp"]
    assert leftovers == []  # no temporary files left behind


async def test_the_same_bytes_again_are_accepted(tmp_path):
    board = LocalBoard(tmp_path / "board")
    await board.put("r/versions/000000/x", b"same")
    await board.put("r/versions/000000/x", b"same")  # a retried upload
    with pytest.raises(BoardError, match="already exists"):
        await board.put("r/versions/000000/x", b"other")
