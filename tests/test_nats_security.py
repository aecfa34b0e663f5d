"""NATS with TLS, client certificates, credentials files and least-privilege users.

Real nats-server processes; the certificates (a CA, the server's, one per user, and a rogue CA's)
and the JWT credentials are made here. The users have exactly the rights docs/nats-security.md
gives: a publisher (the trainer), a read-only follower (an engine: announcements, object and KV
reads, its own heartbeats) and an admin. The follower follows a trainer bit for bit over mutual
TLS without one refused request, and cannot write the board; clients without the CA, without a
certificate or with the wrong one are refused with a message that says what to set.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import os
import re
import threading
import time
from pathlib import Path

import nats.errors
import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stitch_core.versions import nats_conn
from stitch_core.versions.announce import announce, fleet, publish_heartbeat
from stitch_core.versions.board.base import BoardError
from stitch_core.versions.board.nats import NatsBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import Announcement, Heartbeat, Latest
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.nats_conn import (
    ENV_CREDS,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    NatsConfigError,
    NatsConnectionError,
    NatsPermissionError,
    connect,
    denied_since,
)
from stitch_core.versions.natsserver import NatsServer
from stitch_core.versions.streams import ensure_streams

from .test_follow_nats import Trainer, same

RUN, BUCKET, ENGINE = "secure", "stitch", "eng-a"
DOC = Path(__file__).resolve().parents[1] / "docs" / "nats-security.md"


# ------------------------------------------------------------------ the documented rights

def publisher_rights(run: str, bucket: str) -> dict:
    """A trainer: announce, create (and update) its run's streams, create the board's buckets,
    write objects and its run's `latest`."""
    obj, kv = f"OBJ_{bucket}", f"KV_{bucket}_latest"
    runs = (f"STITCH_{run}_VERSIONS", f"STITCH_{run}_ENGINES")
    return {"publish": {"allow": [
        f"stitch.{run}.versions",
        *(f"$JS.API.STREAM.{op}.{s}" for s in runs for op in ("INFO", "CREATE", "UPDATE")),
        *(f"$JS.API.STREAM.{op}.{s}" for s in (obj, kv) for op in ("INFO", "CREATE")),
        f"$JS.API.STREAM.MSG.GET.{obj}", f"$JS.API.STREAM.PURGE.{obj}",
        f"$JS.API.STREAM.MSG.GET.{kv}", f"$JS.API.DIRECT.GET.{kv}.>",
        f"$O.{bucket}.C.>", f"$O.{bucket}.M.>", f"$KV.{bucket}_latest.{run}"]},
        "subscribe": {"allow": ["_INBOX.>"]}}


def follower_rights(run: str, bucket: str, engine: str) -> dict:
    """An engine: read announcements, objects and `latest`; publish its own heartbeats."""
    obj, kv, ann = f"OBJ_{bucket}", f"KV_{bucket}_latest", f"STITCH_{run}_VERSIONS"
    return {"publish": {"allow": [
        f"$JS.API.STREAM.INFO.{ann}", f"$JS.API.CONSUMER.CREATE.{ann}", f"$JS.FC.{ann}.>",
        f"$JS.API.STREAM.INFO.STITCH_{run}_ENGINES", f"stitch.{run}.engines.{engine}",
        f"$JS.API.STREAM.INFO.{obj}", f"$JS.API.STREAM.MSG.GET.{obj}",
        f"$JS.API.CONSUMER.CREATE.{obj}", f"$JS.FC.{obj}.>",
        f"$JS.API.STREAM.INFO.{kv}", f"$JS.API.STREAM.MSG.GET.{kv}",
        f"$JS.API.DIRECT.GET.{kv}.>"]},
        "subscribe": {"allow": ["_INBOX.>"]}}


def status_rights(run: str) -> dict:
    """`stitch status`: read the engines' last heartbeats."""
    return {"publish": {"allow": [f"$JS.API.STREAM.INFO.STITCH_{run}_ENGINES",
                                  f"$JS.API.STREAM.MSG.GET.STITCH_{run}_ENGINES"]},
            "subscribe": {"allow": ["_INBOX.>"]}}


# ------------------------------------------------------------------ certificates

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(d: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{stem}-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


def _cert(subject: str, issuer: tuple | None, *, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    b = (x509.CertificateBuilder().subject_name(_name(subject))
         .issuer_name(issuer_cert.subject if issuer_cert else _name(subject))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem, server.pem and <who>.pem (+ -key.pem) for the users; rogue/ has another CA and
    a 'stitch-follower' certificate it signed."""
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("stitch test CA", None, ca=True)
    _write(d, "ca", *ca)
    _write(d, "server", *_cert("localhost", ca, server=True))
    for who in ("admin", "publisher", "follower", "status", "stranger"):
        _write(d, who, *_cert(f"stitch-{who}", ca))
    (d / "rogue").mkdir()
    rogue = _cert("rogue CA", None, ca=True)
    _write(d / "rogue", "ca", *rogue)
    _write(d / "rogue", "follower", *_cert("stitch-follower", rogue))
    return d


def use(monkeypatch, pki: Path, who: str | None, *, ca: Path | None = None,
        creds: Path | None = None) -> None:
    """Set $STITCH_NATS_* as the process of `who` would (None: the CA only)."""
    monkeypatch.setenv(ENV_TLS_CA, str(ca or pki / "ca.pem"))
    for var in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_CREDS):
        monkeypatch.delenv(var, raising=False)
    if who is not None:
        base = pki / who if (pki / who).is_dir() else pki
        name = "follower" if base != pki else who
        monkeypatch.setenv(ENV_TLS_CERT, str(base / f"{name}.pem"))
        monkeypatch.setenv(ENV_TLS_KEY, str(base / f"{name}-key.pem"))
    if creds is not None:
        monkeypatch.setenv(ENV_CREDS, str(creds))


def two_identities(monkeypatch, pki: Path, creds: dict[str, Path] | None = None) -> None:
    """One process, two identities, as two processes would have them: this (the main) thread
    connects as the follower, any other thread (the publisher's I/O loop) as the publisher."""
    tls, files = {}, {}
    for who in ("follower", "publisher"):
        use(monkeypatch, pki, who, creds=creds[who] if creds else None)
        tls[who], files[who] = nats_conn.tls_context(), nats_conn.creds_file()

    def who() -> str:
        return "follower" if threading.current_thread() is threading.main_thread() else "publisher"

    monkeypatch.setattr(nats_conn, "tls_context", lambda: tls[who()])
    monkeypatch.setattr(nats_conn, "creds_file", lambda: files[who()])


def _tls_block(pki: Path, *, map_users: bool) -> str:
    return f"""tls {{
  cert_file: "{pki / 'server.pem'}"
  key_file: "{pki / 'server-key.pem'}"
  ca_file: "{pki / 'ca.pem'}"
  {'verify_and_map' if map_users else 'verify'}: true
  timeout: 5
}}
"""


@pytest.fixture
def mtls_server(pki, tmp_path):
    """Users are their client certificates (verify_and_map: the user is the certificate's
    subject), in one JetStream account."""
    users = [{"user": "CN=stitch-admin"},
             {"user": "CN=stitch-publisher", "permissions": publisher_rights(RUN, BUCKET)},
             {"user": "CN=stitch-follower",
              "permissions": follower_rights(RUN, BUCKET, ENGINE)},
             {"user": "CN=stitch-status", "permissions": status_rights(RUN)}]
    conf = tmp_path / "nats.conf"
    conf.write_text(_tls_block(pki, map_users=True) + "accounts {\n  STITCH {\n"
                    "    jetstream: enabled\n"
                    f"    users: {json.dumps(users, indent=2)}\n  }}\n}}\n")
    with NatsServer(tmp_path / "store", port=0, config=conf) as server:
        assert server.url.startswith("tls://")
        yield server


# ------------------------------------------------------------------ JWT credentials

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _jwt(signer: nkeys.KeyPair, subject: nkeys.KeyPair, name: str, claims: dict) -> str:
    body = {"jti": _b64(os.urandom(16)), "iat": int(time.time()),
            "iss": signer.public_key.decode(), "sub": subject.public_key.decode(),
            "name": name, "nats": {"version": 2, **claims}}
    signing_input = (_b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "."
                     + _b64(json.dumps(body).encode()))
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def _creds(path: Path, account: nkeys.KeyPair, name: str, rights: dict | None) -> Path:
    """A credentials file as `nsc generate creds` writes it: a user JWT and the user's seed."""
    user = _key(nkeys.PREFIX_BYTE_USER)
    perms = {} if rights is None else {"pub": rights["publish"], "sub": rights["subscribe"]}
    jwt = _jwt(account, user, name, {"type": "user", "subs": -1, "data": -1, "payload": -1,
                                     **perms})
    path.write_text(f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
                    "************************* IMPORTANT *************************\n"
                    "NKEY Seed printed below can be used to sign and prove identity.\n\n"
                    f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
                    "------END USER NKEY SEED------\n")
    return path


@pytest.fixture
def jwt_server(pki, tmp_path):
    """Decentralized auth (an operator, a JetStream account, users in JWTs, as `nsc` makes
    them) and TLS with client certificates; yields (server, {who: creds file})."""
    operator, system = _key(nkeys.PREFIX_BYTE_OPERATOR), _key(nkeys.PREFIX_BYTE_ACCOUNT)
    account, stranger = _key(nkeys.PREFIX_BYTE_ACCOUNT), _key(nkeys.PREFIX_BYTE_ACCOUNT)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                 "wildcards": True, "conn": -1, "leaf": -1}
    js = {**unlimited, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    conf = tmp_path / "nats.conf"
    conf.write_text(
        _tls_block(pki, map_users=False)
        + f'operator: "{_jwt(operator, operator, "op", {"type": "operator"})}"\n'
        + f"system_account: {system.public_key.decode()}\n"
        + "resolver: MEMORY\nresolver_preload: {\n"
        + f'  {system.public_key.decode()}: '
          f'"{_jwt(operator, system, "SYS", {"type": "account", "limits": unlimited})}"\n'
        + f'  {account.public_key.decode()}: '
          f'"{_jwt(operator, account, "STITCH", {"type": "account", "limits": js})}"\n}}\n')
    creds = {"admin": _creds(tmp_path / "admin.creds", account, "admin", None),
             "publisher": _creds(tmp_path / "publisher.creds", account, "publisher",
                                 publisher_rights(RUN, BUCKET)),
             "follower": _creds(tmp_path / "follower.creds", account, "follower",
                                follower_rights(RUN, BUCKET, ENGINE)),
             # signed by an account the operator never signed: refused
             "stranger": _creds(tmp_path / "stranger.creds", stranger, "stranger", None)}
    with NatsServer(tmp_path / "store", port=0, config=conf) as server:
        yield server, creds


# ------------------------------------------------------------------ helpers

def _denials(*conns) -> list[str]:
    return [msg for nc in conns if nc is not None for _, msg in getattr(nc, "denied", ())]


async def _follow(t: Trainer, board: str, nats_url: str, tmp: Path, steps: int):
    """A follower of `board` (the current env's identity) through `steps` more versions."""
    rep = MemoryReplica()
    f = Follower(board, RUN, rep, nats=nats_url, cache_dir=tmp / "cache",
                 reconcile_interval=3600, heartbeat_interval=0.2, engine_id=ENGINE)
    await f.start()
    try:
        assert await f.wait_for(max(t.views), 30), f"stuck at {f.version}: {f.last_error}"
        for _ in range(steps):
            v = await asyncio.to_thread(t.step)
            assert await f.wait_for(v, 30), f"follower stuck at {f.version}, wanted {v}"
            assert same(rep, t.views[v])
        await asyncio.sleep(0.5)  # a heartbeat after the last step
        assert f.nats_connected and f.health == "ok", f.status()
        denied = _denials(f._nc, f.board._nc)
    finally:
        await f.stop()
    return f, denied


# ------------------------------------------------------------------ tests

async def test_read_only_follower_follows_over_mutual_tls(mtls_server, pki, tmp_path,
                                                          monkeypatch):
    board = f"{mtls_server.url}/{BUCKET}"
    two_identities(monkeypatch, pki)
    t = Trainer(board, RUN, mtls_server.url)
    try:
        await asyncio.to_thread(t.step)  # v0: creates the streams and buckets
        f, denied = await _follow(t, board, mtls_server.url, tmp_path, steps=7)  # v6: snapshot
        assert f.applied == list(range(8))
        assert denied == []  # the documented rights are enough: nothing was even tried
        assert _denials(t.pub._nc, t.pub.board._nc) == []
    finally:
        await asyncio.to_thread(t.pub.close)
    monkeypatch.undo()
    use(monkeypatch, pki, "status")
    nc = await connect(mtls_server.url)
    try:  # the heartbeats the follower published, read with the rights of `stitch status`
        assert [(h.id, h.version) for h in await fleet(nc, RUN)] == [(ENGINE, 7)]
        assert _denials(nc) == []
    finally:
        await nc.close()


async def test_read_only_follower_started_before_the_trainer(mtls_server, pki, tmp_path,
                                                             monkeypatch, caplog):
    """Nothing exists yet and the follower may create nothing: it polls the (absent) board,
    retries NATS, and follows once the trainer made the streams and buckets."""
    board = f"{mtls_server.url}/{BUCKET}"
    two_identities(monkeypatch, pki)
    rep = MemoryReplica()
    f = Follower(board, RUN, rep, nats=mtls_server.url, cache_dir=tmp_path / "cache",
                 reconcile_interval=0.5, engine_id=ENGINE)
    await f.start()
    try:
        await asyncio.sleep(1)
        assert f.version is None and f.last_error is None  # an empty board is no error
        assert not f.nats_connected
        t = Trainer(board, RUN, mtls_server.url)
        try:
            for _ in range(2):
                v = await asyncio.to_thread(t.step)
            assert await f.wait_for(v, 30) and same(rep, t.views[v])
        finally:
            await asyncio.to_thread(t.pub.close)
        for _ in range(300):  # NATS retries back off: 1 s, 2 s, ...
            if f.nats_connected:
                break
            await asyncio.sleep(0.1)
        assert f.nats_connected
    finally:
        await f.stop()
    assert "refused by the NATS server" in caplog.text  # why NATS was not up, said clearly


async def test_read_only_follower_cannot_write(mtls_server, pki, monkeypatch):
    board = f"{mtls_server.url}/{BUCKET}"
    latest = Latest(run=RUN, version=0, kind="snapshot", updated="2026-01-01T00:00:00Z")
    use(monkeypatch, pki, "publisher")
    async with NatsBoard(board) as pub:
        await pub.put(f"{RUN}/versions/0/model.safetensors", b"weights")
        await pub.move_latest(RUN, None, latest)
    nc = await connect(mtls_server.url)
    await ensure_streams(nc, RUN)
    await nc.close()

    use(monkeypatch, pki, "follower")
    async with NatsBoard(board, timeout=1) as b:  # a refused request: no reply, 1 s
        assert await b.read_latest(RUN) == latest
        assert await b.get(f"{RUN}/versions/0/model.safetensors") == b"weights"
        with pytest.raises(BoardError, match=r"put .* refused by the server: permissions "
                           r"violation for publish to \"\$o\.stitch\.c\."):
            await b.put(f"{RUN}/versions/1/model.safetensors", b"forged")
        newer = latest.model_copy(update={"version": 1})
        with pytest.raises(BoardError, match=r"move latest of secure refused by the server: "
                           r".*\$kv\.stitch_latest\.secure"):
            await b.move_latest(RUN, 0, newer)
        assert await b.read_latest(RUN) == latest
        assert not await b.exists(f"{RUN}/versions/1/model.safetensors")

    nc = await connect(mtls_server.url)
    js = nc.jetstream(timeout=1)
    try:
        ann = Announcement(run=RUN, version=5, parent=4, kind="patch", board=board,
                           manifest=f"{RUN}/versions/5/manifest.json")
        with pytest.raises(NatsPermissionError, match=r"stitch\.secure\.versions"):
            await announce(js, ann)
        with pytest.raises(NatsPermissionError, match=r"stream\.create\.stitch_other_versions"
                           r"|stream\.info\.stitch_other_versions"):
            await ensure_streams(js, "other")
        with pytest.raises(NatsPermissionError, match=r"stitch\.secure\.engines\.eng-b"):
            await publish_heartbeat(js, Heartbeat(id="eng-b", run=RUN, version=0,
                                                  state="serving", time=time.time()))
        await publish_heartbeat(js, Heartbeat(id=ENGINE, run=RUN, version=0, state="serving",
                                              time=time.time()))  # its own: allowed
        t0 = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):  # no admin: cannot delete the board
            await js.delete_stream(f"OBJ_{BUCKET}")
        assert "stream.delete.obj_stitch" in (denied_since(nc, t0) or "")
    finally:
        await nc.close()


async def test_read_only_follower_downloads_a_large_object(mtls_server, pki, monkeypatch):
    """Big enough for JetStream flow control: the follower answers it ($JS.FC.<stream>.>)."""
    board, key = f"{mtls_server.url}/{BUCKET}", f"{RUN}/versions/0/model.safetensors"
    data = os.urandom(32 << 20)
    use(monkeypatch, pki, "publisher")
    async with NatsBoard(board) as b:
        await b.put(key, data)
    use(monkeypatch, pki, "follower")
    async with NatsBoard(board, stall_timeout=10) as b:
        assert await b.get(key) == data
        assert _denials(b._nc) == []


@pytest.mark.parametrize("who, ca, why", [
    (None, "none", r"certificate verify failed.*set \$STITCH_NATS_TLS_CA"),
    (None, "ca", r"certificate required.*set \$STITCH_NATS_TLS_CERT and \$STITCH_NATS_TLS_KEY"),
    ("rogue", "ca", r"unknown ca.*set \$STITCH_NATS_TLS_CERT"),
    ("follower", "rogue", r"certificate verify failed.*\$STITCH_NATS_TLS_CA"),
    ("stranger", "ca", r"(?i)authorization violation"),  # a good certificate, but no such user
])
async def test_clients_without_the_ca_or_a_known_certificate_are_refused(
        mtls_server, pki, monkeypatch, who, ca, why):
    use(monkeypatch, pki, who, ca=pki / "rogue" / "ca.pem" if ca == "rogue" else None)
    if ca == "none":
        monkeypatch.delenv(ENV_TLS_CA)
    t0 = time.monotonic()
    with pytest.raises(NatsConnectionError, match=why):
        await connect(mtls_server.url, connect_timeout=10)
    assert time.monotonic() - t0 < 5  # refused at once, not after the connect timeout
    with pytest.raises(BoardError, match=why):
        async with NatsBoard(f"{mtls_server.url}/{BUCKET}", timeout=10) as b:
            await b.read_latest(RUN)


async def test_tls_is_never_downgraded(nats_server, pki, monkeypatch):
    """A server offering plain text only (or a man in the middle stripping TLS) gets no
    credentials when TLS was asked for, by a tls:// URL or by the TLS variables."""
    use(monkeypatch, pki, "follower")
    with pytest.raises(NatsConnectionError, match="does not offer TLS"):
        await connect(nats_server.url)
    for var in (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY):
        monkeypatch.delenv(var)
    with pytest.raises(NatsConnectionError, match="does not offer TLS"):
        await connect(nats_server.url.replace("nats://", "tls://"))
    nc = await connect(nats_server.url)  # plain text asked for: plain text
    await nc.close()


async def test_tls_and_creds_settings_errors(pki, tmp_path, monkeypatch):
    url = "tls://127.0.0.1:1"  # never reached: the settings are refused first
    use(monkeypatch, pki, "follower")
    monkeypatch.setenv(ENV_TLS_CA, str(tmp_path / "missing.pem"))
    with pytest.raises(NatsConfigError, match=r"\$STITCH_NATS_TLS_CA=.*missing\.pem.*no such"):
        await connect(url)
    use(monkeypatch, pki, "follower")
    monkeypatch.delenv(ENV_TLS_KEY)
    with pytest.raises(NatsConfigError, match=r"\$STITCH_NATS_TLS_CERT is set but "
                                              r"\$STITCH_NATS_TLS_KEY is not"):
        await connect(url)
    use(monkeypatch, pki, "follower")
    monkeypatch.delenv(ENV_TLS_CERT)
    with pytest.raises(NatsConfigError, match=r"\$STITCH_NATS_TLS_KEY is set but "
                                              r"\$STITCH_NATS_TLS_CERT is not"):
        await connect(url)
    use(monkeypatch, pki, None)
    monkeypatch.setenv(ENV_TLS_CERT, str(pki / "follower.pem"))
    monkeypatch.setenv(ENV_TLS_KEY, str(pki / "publisher-key.pem"))  # not its key
    with pytest.raises(NatsConfigError, match="not a usable certificate and key"):
        await connect(url)
    use(monkeypatch, pki, None)
    monkeypatch.setenv(ENV_TLS_CA, str(pki / "follower-key.pem"))  # not a certificate
    with pytest.raises(NatsConfigError, match="not a usable CA file"):
        await connect(url)
    use(monkeypatch, pki, None, creds=tmp_path / "missing.creds")
    with pytest.raises(NatsConfigError, match=r"\$STITCH_NATS_CREDS=.*no such file"):
        await connect(url)
    use(monkeypatch, pki, None, creds=pki / "ca.pem")  # nats-py would loop forever on it
    with pytest.raises(NatsConfigError, match="not a NATS credentials file"):
        await connect(url)
    with pytest.raises(BoardError, match="not a NATS credentials file"):
        async with NatsBoard(f"{url}/{BUCKET}") as b:
            await b.read_latest(RUN)


async def test_creds_files_and_mutual_tls(jwt_server, pki, tmp_path, monkeypatch):
    """JWT credentials ($STITCH_NATS_CREDS) carry the same rights: the follower follows, reads
    only, and an unknown account's user is refused."""
    server, creds = jwt_server
    board = f"{server.url}/{BUCKET}"
    two_identities(monkeypatch, pki, creds)
    t = Trainer(board, RUN, server.url)
    try:
        await asyncio.to_thread(t.step)
        f, denied = await _follow(t, board, server.url, tmp_path, steps=2)
        assert f.applied == [0, 1, 2] and denied == []
        async with NatsBoard(board, timeout=2) as b:
            latest = await b.read_latest(RUN)
            assert latest is not None and latest.version == 2
            with pytest.raises(BoardError, match=r"refused by the server.*\$kv\.stitch_latest"):
                await b.move_latest(RUN, 2, latest.model_copy(update={"version": 3}))
    finally:
        await asyncio.to_thread(t.pub.close)
    monkeypatch.undo()
    use(monkeypatch, pki, "follower", creds=creds["stranger"])
    with pytest.raises(NatsConnectionError, match="(?i)authorization violation"):
        await connect(server.url)
    use(monkeypatch, pki, "follower")  # a certificate but no credentials
    with pytest.raises(NatsConnectionError, match="(?i)authorization violation"):
        await connect(server.url)


def test_the_documented_rights_are_the_tested_ones():
    """docs/nats-security.md lists every subject these tests grant (for run `myrun`, bucket
    `stitch`, engine `eng-a`)."""
    text = DOC.read_text()
    for rights in (publisher_rights("myrun", "stitch"),
                   follower_rights("myrun", "stitch", "eng-a"), status_rights("myrun")):
        for subject in rights["publish"]["allow"] + rights["subscribe"]["allow"]:
            assert re.search(rf'"{re.escape(subject)}"', text), f"{subject} not in {DOC.name}"
