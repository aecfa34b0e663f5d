"""The local state of `stitch publish`: the served view it last published, so that the next
publish diffs against it instead of materialising the run's `latest` from the board.

Layout, under the cache directory (private to the user, like the cache itself)::

    <cache>/<run>/published/             mode 0700
        state.json                       {"format", "run", "version", "view", "digest", "file",
                                          "size", "fingerprints"}: the commit point
        view-<token>.safetensors         the view itself (mode 0600)

A publish whose base was the state moves the state forward in place (`advance`): once the new
version is on the board, its patch is applied to the view file through a shared mapping (the
same apply, and the same proof, as a follower's: every tensor's fingerprint must come out as the
manifest's), then `state.json` is rewritten (temporary file, fsync, rename) to name the new
version. Only the changed elements are written: no second copy of the view is made. A publish
without a usable state (or a snapshot, or a patch that adds, drops or reshapes a tensor) writes
the whole view to a new file instead, in two steps: the view file under a temporary name,
renamed to its final name (`begin`, in a background thread, while the version is being
published), then `state.json` (`commit`); only then are older view files removed.

Nothing in the state is trusted as it is: `load` uses it only for the version the board's
`latest` names, only if its fingerprints and digest are the board manifest's for that version,
and only once every tensor read from the view file has exactly those fingerprints (and the
manifest's names, dtypes and shapes). So a stale, damaged, truncated or foreign state, a view
file the disk lost after a power loss (the view file is not fsynced: this check replaces it), or
one a crash left half-advanced (its `state.json` still names the old version, whose fingerprints
the file no longer has) makes the caller rebuild the base from the board; it never yields a base
the board does not hold. The fingerprint pass is the one `stitch diff` makes over its base
anyway (run while the patch is made: `defer_proof`). Two publishes of one run sharing a cache
take the directory's lock to read or advance a state; the board's compare-and-set on `latest`
refuses the later of two made from one base.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from stitch_core.errors import StitchError
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import CheckpointError, map_file, populate_writable
from stitch_core.format.patch import PatchError, PatchReader, apply
from stitch_core.versions.board.local import fsync_dir
from stitch_core.versions.manifest import Manifest, check_run

__all__ = ["STATE_DIR", "Loaded", "PendingState", "advance", "begin", "load", "state_dir"]

STATE_DIR = "published"
STATE_FILE = "state.json"
FORMAT = "stitch-publish-state"
MAX_STATE_BYTES = 64 << 20  # as a manifest: it lists every tensor's fingerprint


class StateUnusableError(StitchError, ValueError):
    """Why a local state cannot be the base of the next publish (one line); `load` returns it as
    a string, never raises it."""


@dataclass
class Loaded:
    """A verified local state: the view of `version` (tensors over a shared mapping of its
    `file`: `advance` writes through them) and its fingerprints (the board's)."""

    version: int
    view: dict[str, torch.Tensor]
    fingerprints: dict[str, int]
    file: Path | None = None
    _warm: threading.Thread | None = None
    _proof: threading.Thread | None = None  # a deferred proof (`load(..., defer_proof=True)`)
    _bad: str | None = None

    def prove(self) -> None:
        """Wait for the deferred proof of the view's fingerprints; StateUnusableError if the view
        file does not hold them (then nothing made from it may reach the board). Returns at
        once for a state proven when loaded."""
        if self._proof is not None:
            self._proof.join()
        if self._bad is not None:
            raise StateUnusableError(self._bad)

    def _check(self, manifest: Manifest) -> None:
        try:
            _prove(self.view, manifest)
        except StateUnusableError as e:
            self._bad = str(e)
        except BaseException as e:  # noqa: BLE001 - a failed proof is no proof
            self._bad = f"its view file could not be read ({e})"

    def warm(self) -> None:
        """Fault the view file's pages in for writing on a background thread (`advance` writes
        into nearly every page at ~1% changed elements), while the caller diffs against it."""
        if self.file is not None and self._warm is None:
            self._warm = threading.Thread(target=populate_writable, args=(self.view,),
                                          daemon=True, name="stitch-publish-state-warm")
            self._warm.start()


def state_dir(cache: Path, run: str) -> Path:
    """The state directory of `run` under the cache directory `cache`."""
    return Path(cache) / check_run(run) / STATE_DIR


def _private_dir(d: Path, create: bool) -> None:
    """`d` exists (created 0700 when `create`), is ours, and is private (tightened if loosened);
    StateUnusableError otherwise."""
    if create:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        st = d.stat()
    except FileNotFoundError:
        raise StateUnusableError("no local state") from None
    if st.st_uid != os.getuid():
        raise StateUnusableError(f"{d} belongs to another user")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)


def load(cache: Path, run: str, board_manifest: Manifest, *,
         defer_proof: bool = False) -> Loaded | str:
    """The local state of `run` if it holds exactly `board_manifest`'s version (read from the
    board: the run's `latest`), else the reason it cannot be used (one line).

    The proof (every tensor's fingerprint read from the view file) is a pass over the whole
    view; `defer_proof=True` runs it on a background thread and returns once the cheap checks
    pass (the state's record, the file's size, header, names, dtypes and shapes), so the caller
    can diff against the view meanwhile: it must call `Loaded.prove()` before anything made
    from the view leaves the process."""
    d = state_dir(cache, run)
    try:
        _private_dir(d, create=False)
        with _locked(d):  # not while another publish advances it
            got = _load(d, run, board_manifest)
            if not defer_proof:
                _prove(got.view, board_manifest)
                return got
        got._proof = threading.Thread(target=got._check, args=(board_manifest,), daemon=True,
                                      name="stitch-publish-state-proof")
        got._proof.start()
        return got
    except StateUnusableError as e:
        return str(e)
    except OSError as e:  # the lock file (a read-only cache)
        return f"cannot lock {d} ({e.strerror})"


def _read_doc(d: Path, run: str) -> dict:
    p = d / STATE_FILE
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        raise StateUnusableError("no local state") from None
    except OSError as e:
        raise StateUnusableError(f"cannot read {p} ({e.strerror})") from None
    try:
        if len(raw) > MAX_STATE_BYTES:
            raise ValueError("too large")
        doc = json.loads(raw)
        ok = (isinstance(doc, dict) and doc.get("format") == FORMAT
              and isinstance(doc.get("version"), int) and isinstance(doc.get("file"), str)
              and isinstance(doc.get("size"), int) and isinstance(doc.get("fingerprints"), dict)
              and isinstance(doc.get("digest"), str) and isinstance(doc.get("view"), str))
        if not ok:
            raise ValueError("not a publish state")
        if doc.get("run") != run:
            raise ValueError(f"it names run {doc.get('run')!r}")
        name = doc["file"]
        if "/" in name or "\\" in name or not name.startswith("view-") or \
                not name.endswith(".safetensors"):
            raise ValueError(f"unsafe file name {name!r}")
        doc["fingerprints"] = {str(k): fpr.parse(v) for k, v in doc["fingerprints"].items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise StateUnusableError(f"unreadable {p} ({e})") from None
    return doc


def _load(d: Path, run: str, m: Manifest) -> Loaded:
    doc = _read_doc(d, run)
    if doc["version"] != m.version:
        raise StateUnusableError(f"it holds v{doc['version']}, the board's latest is v{m.version}")
    if doc["view"] != m.view or doc["digest"] != m.digest or doc["fingerprints"] != m.fingerprints:
        raise StateUnusableError(f"its v{m.version} is not the board's (fingerprints differ "
                                 "from the board's manifest)")
    path = d / doc["file"]
    try:
        size = path.stat().st_size
    except OSError:
        raise StateUnusableError(f"its view file {path.name} is missing") from None
    if size != doc["size"]:
        raise StateUnusableError(f"its view file is {size} bytes, not {doc['size']} (truncated?)")
    try:
        view = map_file(path, writable=True)
    except (CheckpointError, OSError, RuntimeError) as e:  # RuntimeError: torch's mmap
        raise StateUnusableError(f"unreadable view file {path.name} ({e})") from None
    want = {t.name: t for t in m.tensors}
    if set(view) != set(want):
        raise StateUnusableError(f"its view file does not list v{m.version}'s tensors")
    for name, t in view.items():
        if dtypes.info(t.dtype).name != want[name].dtype or list(t.shape) != want[name].shape:
            raise StateUnusableError(f"its view file is damaged ({name} is not v{m.version}'s "
                                     "dtype and shape)")
    return Loaded(m.version, view, m.fingerprints, path)


def _prove(view: Mapping[str, torch.Tensor], m: Manifest) -> None:
    """Every tensor of `view` has `m`'s fingerprint; StateUnusableError otherwise."""
    fps = m.fingerprints
    for name, t in view.items():
        if fpr.fingerprint(name, t) != fps[name]:
            raise StateUnusableError(f"its view file is damaged ({name} does not match the board's "
                                     f"v{m.version})")


# ---------------------------------------------------------------- advancing in place


class NotInPlaceError(StitchError, ValueError):
    """A patch `advance` cannot apply to the state's file as it is (a tensor added, dropped or
    reshaped): the caller writes the whole view instead."""


def advance(cache: Path, run: str, base: Loaded, patch: bytes, m: Manifest) -> str | None:
    """Move the state `base` (the view `patch` was made from) to `m`, the version just published:
    `patch` applied in place to the view file, proven against `m`'s fingerprints, then
    `state.json` names `m`. None, or why not (a warning's line; the next publish rebuilds its
    base). NotInPlaceError: the patch changes the tensor set or shapes (nothing written)."""
    d = state_dir(cache, run)
    if base.file is None:
        raise NotInPlaceError("the state is not a mapped view file")
    if base._warm is not None:
        base._warm.join()
    try:
        base.prove()
    except StateUnusableError as e:
        return str(e)
    try:  # checked once here (its checksum), and applied from the same reader
        reader = PatchReader(patch)
    except PatchError as e:
        return f"cannot advance the local state ({e})"
    entries = reader.header.tensors
    if {e.name for e in entries} != set(base.view) or any(e.kind != "patch" for e in entries):
        raise NotInPlaceError("the patch adds, drops or reshapes a tensor")
    if {e.name: e.target_fp for e in entries} != {t.name: t.fingerprint for t in m.tensors}:
        return f"the patch does not make v{m.version} as the board lists it"
    try:
        with _locked(d):
            doc = _read_doc(d, run)
            if doc["version"] != base.version or doc["file"] != base.file.name:
                return "the local state changed while this version was published"
            try:  # proves every tensor's fingerprint (the patch's, checked above to be m's)
                apply(base.view, reader, base_fingerprints=base.fingerprints,
                      base_version=base.version, run=run, inplace=True)
            except PatchError as e:  # undone: the file still holds base.version
                return f"cannot advance the local state ({e})"
            except Exception as e:  # noqa: BLE001 - published: said; the next load's proof judges
                return f"cannot advance the local state ({type(e).__name__}: {e})"
            _write_doc(d, m, base.file)
            return None
    except (OSError, StateUnusableError) as e:
        return f"cannot advance the local state in {d} ({e})"


# ---------------------------------------------------------------- writing


class PendingState:
    """A view being written to the state directory (`begin`); `commit` makes it the state once
    its version is on the board, `abort` drops it. Neither ever raises: a state that cannot be
    written only costs the next publish a rebuild (the failure is returned, for a warning)."""

    def __init__(self, cache: Path, run: str, view: Mapping[str, torch.Tensor]):
        self.dir = state_dir(cache, run)
        self._view = dict(view)
        self._token = secrets.token_hex(4)
        self._file: Path | None = None  # the view file once written under its final name
        self._error: str | None = None
        self._thread = threading.Thread(target=self._write, daemon=True,
                                        name="stitch-publish-state")
        self._thread.start()

    def _write(self) -> None:
        tmp = None
        try:
            _private_dir(self.dir, create=True)
            name = f"view-{self._token}.safetensors"
            tmp = self.dir / f".{name}.tmp-{os.getpid()}"
            save_file({k: v.contiguous() for k, v in self._view.items()}, str(tmp))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.dir / name)  # a complete file, named by no state.json yet
            self._file = self.dir / name
        except Exception as e:  # noqa: BLE001 - reported by commit (a full disk, another owner)
            self._error = f"cannot write the local state in {self.dir} ({e})"
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        finally:
            self._view = {}

    def commit(self, m: Manifest) -> str | None:
        """Make the written view the state of `m`'s version (the version just published; its
        fingerprints are the view's). None, or why the state could not be written."""
        self._thread.join()
        if self._error is not None or self._file is None:
            return self._error or "the local state was not written"
        try:
            with _locked(self.dir):
                try:
                    _write_doc(self.dir, m, self._file)
                except OSError:
                    self.abort()
                    raise
                _drop_others(self.dir, keep=self._file.name)
        except OSError as e:
            return f"cannot write the local state in {self.dir} ({e})"
        return None

    def abort(self) -> None:
        """Drop the view written for a version that did not make it to the board."""
        self._thread.join()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.unlink()
            self._file = None


def _write_doc(d: Path, m: Manifest, file: Path) -> None:
    """Make `file` (in `d`) the state of `m`'s version: `state.json` written to a temporary file,
    fsynced, renamed over the old one (the commit point), the directory fsynced. Raises OSError
    (the old `state.json`, if any, then still stands)."""
    doc = {"format": FORMAT, "run": m.run, "version": m.version, "view": m.view,
           "digest": m.digest, "file": file.name, "size": file.stat().st_size,
           "fingerprints": {t.name: t.fingerprint for t in m.tensors}}
    tmp = d / f".{STATE_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / STATE_FILE)  # the commit point
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # committed: a failed directory sync costs a rebuild
        fsync_dir(d)


def begin(cache: Path, run: str, view: Mapping[str, torch.Tensor]) -> PendingState:
    """Start writing `view` as the next local state of `run` (in a background thread; the
    tensors must not change until `commit` or `abort`)."""
    return PendingState(cache, run, view)


@contextlib.contextmanager
def _locked(d: Path):
    """An exclusive lock on the state directory while a state is committed and old view files
    are removed (two publishes sharing a cache never remove each other's committed file)."""
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _drop_others(d: Path, keep: str) -> None:
    """Remove the view files `state.json` does not name (earlier states, an aborted write) and
    the temporary files of writers that died; a write under way in a live process is left
    alone."""
    for p in d.glob("view-*.safetensors"):
        if p.name != keep:
            with contextlib.suppress(OSError):
                p.unlink()
    for p in d.glob(".*.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
