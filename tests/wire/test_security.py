"""Socket security against real peers (issue 7 items 4 and 5): slowloris, mutual authentication,
frames and bodies bound to the connection by a session key.

Every attacker here is a real socket: trickling peers, a fake agent without the secret, and a TCP
relay thread that passes one real handshake through and then injects, replays or tampers.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import time

import orjson
import pytest
from sparksteward.blob.client import BlobClient
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import VoidBlobStore
from sparksteward.errors import AuthenticationError, ProtocolError, StewardError
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import AgentServer, Connection, new_secret
from sparksteward.wire import connection as wire

from tests.helpers import wait_until
from tests.helpers.blob import staged_bytes, staged_fds


# --- slowloris (item 4, must-show 5) ------------------------------------------------------------
def _tricklers(endpoint: str, n: int) -> list[socket.socket]:
    host, port = endpoint.rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall((1000).to_bytes(4, "big"))  # announce a 1000-byte frame (allowed before auth) ...
        socks.append(s)
    return socks


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        for s in socks:
            try:
                s.send(b" ", socket.MSG_DONTWAIT)  # ... and send it one byte at a time
            except OSError:
                pass


def _timed_health(endpoint: str, secret: str) -> float:
    t = time.monotonic()
    with Connection.connect(endpoint, secret, timeout=1.0) as conn:
        assert conn.request("health")["state"] == "running"
    return time.monotonic() - t


@pytest.mark.parametrize("count", [64, 500])
def test_health_answers_within_1s_while_slow_unauthenticated_peers_trickle(tmp_path, count):
    with AgentProcess("driver", {"spark.steward.state-dir": str(tmp_path / "state")}) as agent:
        assert agent.ready, agent.first
        socks = _tricklers(agent.endpoint, count)
        stop = threading.Event()
        feeder = threading.Thread(target=_trickle, args=(socks, stop), daemon=True)
        feeder.start()
        try:
            for _ in range(3):
                assert _timed_health(agent.endpoint, agent.secret) < 1.0
        finally:
            stop.set()
            feeder.join()
            for s in socks:
                s.close()


def test_handshake_has_a_hard_deadline_even_for_a_peer_that_keeps_trickling():
    secret = new_secret()
    with AgentServer("127.0.0.1", 0, secret, {}, handshake_timeout=0.5) as server:
        host, port = server.endpoint.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
        s.recv(4096)  # the challenge
        s.sendall((1000).to_bytes(4, "big"))
        t = time.monotonic()
        closed = False
        while time.monotonic() - t < 5:
            try:
                s.send(b" ")  # a byte every 50 ms completes the 1000-byte frame after 50 s
                s.settimeout(0.05)
                if s.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - t < 2.0
        s.close()


# --- mutual authentication (item 5) -----------------------------------------------------------
class _FakeAgent:
    """Listens like an agent and answers every handshake with ``ok`` without knowing the secret."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _frame(msg: dict) -> bytes:
        body = orjson.dumps(msg)
        return len(body).to_bytes(4, "big") + body

    def _run(self) -> None:
        c, _ = self.sock.accept()
        with c:
            c.sendall(self._frame({"v": 2, "op": "challenge", "nonce": os.urandom(32).hex()}))
            c.recv(4096)
            c.sendall(self._frame({"ok": True, "mac": "00" * 32}))
            c.recv(4096)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def test_client_refuses_an_agent_that_cannot_prove_the_secret():
    fake = _FakeAgent()
    try:
        with pytest.raises(AuthenticationError, match="secret"):
            Connection.connect(fake.endpoint, new_secret(), timeout=5)
    finally:
        fake.close()


class Relay:
    """A real TCP proxy thread between a client and a server that can inject and tamper."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.c2s = bytearray()
        self.upstream: socket.socket | None = None
        self.lock = threading.Lock()
        self.flip_c2s_at: int | None = None  # flip one byte at this offset of the client's stream
        self.flip_s2c_at: int | None = None
        self.cut_c2s_at: int | None = None  # pass the client's stream up to this offset, then hang up
        self.cut_s2c_at: int | None = None
        self.s2c_count = 0
        self.threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        down, _ = self.listener.accept()
        self.upstream = socket.create_connection(self.target)
        for args in ((down, self.upstream, True), (self.upstream, down, False)):
            t = threading.Thread(target=self._pump, args=args, daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, c2s: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                data = bytearray(data)
                with self.lock:
                    if c2s:
                        start, flip, cut = len(self.c2s), self.flip_c2s_at, self.cut_c2s_at
                        self.c2s += data
                    else:
                        start, flip, cut = self.s2c_count, self.flip_s2c_at, self.cut_s2c_at
                        self.s2c_count += len(data)
                    if flip is not None and start <= flip < start + len(data):
                        data[flip - start] ^= 0x01
                    if cut is not None and cut < start + len(data):
                        dst.sendall(data[:max(0, cut - start)])
                        return
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def inject(self, data: bytes) -> None:
        with self.lock:
            assert self.upstream is not None
            self.upstream.sendall(data)

    def close(self) -> None:
        self.listener.close()
        if self.upstream is not None:
            with contextlib.suppress(OSError):
                self.upstream.shutdown(socket.SHUT_RDWR)
        for t in self.threads:
            t.join(5)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, conn: Connection, req: dict) -> dict:
        self.calls.append(req)
        return {"n": len(self.calls)}


@pytest.fixture()
def served():
    secret = new_secret()
    rec = Recorder()
    with AgentServer("127.0.0.1", 0, secret, {"record": rec}) as server:
        relay = Relay(server.endpoint)
        yield secret, rec, relay
        relay.close()


def _plain_frame(msg: dict) -> bytes:
    body = orjson.dumps(msg)
    return len(body).to_bytes(4, "big") + body


def test_relay_cannot_inject_a_frame_after_a_real_handshake(served):
    secret, rec, relay = served
    conn = Connection.connect(relay.endpoint, secret, timeout=5)
    assert conn.request("record", who="client")["n"] == 1
    relay.inject(_plain_frame({"op": "record", "who": "relay"}) + os.urandom(32))
    with pytest.raises((ProtocolError, OSError)):
        conn.request("record", who="client")
    assert [c["who"] for c in rec.calls] == ["client"]
    conn.close()


def test_relay_cannot_replay_a_frame(served):
    secret, rec, relay = served
    conn = Connection.connect(relay.endpoint, secret, timeout=5)
    before = len(relay.c2s)
    assert conn.request("record", who="client")["n"] == 1
    with relay.lock:
        replay = bytes(relay.c2s[before:])
    relay.inject(replay)
    with pytest.raises((ProtocolError, OSError)):
        conn.request("record", who="client")
    assert len(rec.calls) == 1, "the replayed request was executed"
    conn.close()


@pytest.fixture(params=getattr(wire, "BODY_MACS", ("hmac-sha256",)))
def body_mac(request, monkeypatch):
    """Each body MAC this process knows: Poly1305 (with ``cryptography``) and the HMAC fallback."""
    monkeypatch.setattr(wire, "BODY_MACS", (request.param,), raising=False)
    return request.param


def _blob_rig(tmp_path):
    secret = new_secret()
    blobs = BlobServer(tmp_path / "server", VoidBlobStore(), timer=False)
    server = AgentServer("127.0.0.1", 0, secret, {})
    blobs.register_handlers(server)
    return secret, blobs, server


def test_a_tampered_upload_body_byte_is_rejected(tmp_path, body_mac):
    secret, blobs, server = _blob_rig(tmp_path)
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        client = BlobClient(lambda: conn)
        data = os.urandom(1 << 20)
        with relay.lock:
            relay.flip_c2s_at = len(relay.c2s) + 300 + (1 << 19)  # inside the body, after the header
        with pytest.raises((StewardError, OSError)):
            client.put_bytes(data, "job-t")
        assert not (blobs.dir / "job-t").exists() or not list((blobs.dir / "job-t").iterdir())
        wait_until(lambda: not list(blobs.incoming.iterdir()), what="the upload's temp file is removed")
    finally:
        relay.close()
        server.close()
        blobs.close()


def test_a_tampered_download_body_byte_is_rejected(tmp_path, body_mac):
    secret, blobs, server = _blob_rig(tmp_path)
    with Connection.connect(server.endpoint, secret) as direct:
        key = BlobClient(lambda: direct).put_bytes(os.urandom(1 << 20), "job-d")
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        with relay.lock:
            relay.flip_s2c_at = relay.s2c_count + 200 + (1 << 19)
        dest = tmp_path / "out"
        with pytest.raises((StewardError, OSError)):
            BlobClient(lambda: conn).get_to_file(key, dest, "job-d")
        assert not dest.exists()
    finally:
        relay.close()
        server.close()
        blobs.close()


def test_frames_and_bodies_still_flow_through_an_honest_relay(tmp_path, body_mac):
    secret, blobs, server = _blob_rig(tmp_path)
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        assert getattr(conn, "body_mac", body_mac) == body_mac
        client = BlobClient(lambda: conn)
        data = os.urandom(3 << 20)
        key = client.put_bytes(data, "job-h")
        assert client.get_bytes(key, "job-h") == data
        src = tmp_path / "src"
        src.write_bytes(data[:12345])
        key2 = client.put_file(src, "job-h")
        client.get_to_file(key2, tmp_path / "back", "job-h")
        assert (tmp_path / "back").read_bytes() == data[:12345]
        for size in (0, 1, (1 << 20) - 1, 1 << 20):  # empty, small and large paths on both sides
            src.write_bytes(data[:size])
            k = client.put_file(src, "job-h")
            assert client.get_bytes(k, "job-h") == data[:size] == client.get_bytes(client.put_bytes(data[:size]))
        assert client.list()  # the connection is still in step after every kind of body
    finally:
        relay.close()
        server.close()
        blobs.close()


# --- bodies of every size: tampered, truncated, wrong secret (issue 22 item 4) --------------------
_SIZES = [4096, 9 << 20]  # one write with its frame; several chunks, hashed beside the transfer
_WHERE = {"first byte": lambda size: 0, "last byte": lambda size: size - 1, "tag": lambda size: size + 5}


def _body_start(msg: dict) -> int:
    """Offset of a body after the authenticated frame ``msg`` that announces it."""
    return 4 + len(orjson.dumps(msg)) + wire.TAG_SIZE


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("where", list(_WHERE))
def test_a_download_tampered_anywhere_is_refused_and_never_lands(tmp_path, body_mac, size, where):
    secret, blobs, server = _blob_rig(tmp_path)
    with Connection.connect(server.endpoint, secret) as direct:
        key = BlobClient(lambda: direct).put_bytes(os.urandom(size), "job-d")
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        with relay.lock:
            relay.flip_s2c_at = relay.s2c_count + _body_start({"ok": True, "size": size}) + _WHERE[where](size)
        with pytest.raises(AuthenticationError, match="does not match its tag"):
            BlobClient(lambda: conn).get_to_file(key, tmp_path / "out" / "blob", "job-d")
        assert conn.broken
        assert not list((tmp_path / "out").iterdir()), "a tampered body left a file"
    finally:
        relay.close()
        server.close()
        blobs.close()


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("where", list(_WHERE))
def test_an_upload_tampered_anywhere_is_refused_with_the_reason_and_stores_nothing(tmp_path, body_mac, size,
                                                                                   where):
    secret, blobs, server = _blob_rig(tmp_path)
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        head = {"op": "blob.put", "job_id": "job-u", "size": size, "type": "t"}
        with relay.lock:
            relay.flip_c2s_at = len(relay.c2s) + _body_start(head) + _WHERE[where](size)
        with pytest.raises(AuthenticationError, match="does not match its tag"):
            BlobClient(lambda: conn).put_bytes(os.urandom(size), "job-u")
        assert not (blobs.dir / "job-u").exists()
        wait_until(lambda: not list(blobs.incoming.iterdir()) and not staged_bytes(blobs)
                   and len(staged_fds(blobs)) == len(blobs.staging.spare), what="the upload's staged file is removed")
    finally:
        relay.close()
        server.close()
        blobs.close()


@pytest.mark.parametrize("size", _SIZES)
def test_a_truncated_download_is_refused_and_never_lands(tmp_path, body_mac, size):
    secret, blobs, server = _blob_rig(tmp_path)
    with Connection.connect(server.endpoint, secret) as direct:
        key = BlobClient(lambda: direct).put_bytes(os.urandom(size), "job-t")
    for cut in (size // 2, size + wire.TAG_SIZE - 1):  # inside the body; only the tag's last byte missing
        relay = Relay(server.endpoint)
        try:
            conn = Connection.connect(relay.endpoint, secret, timeout=5)
            with relay.lock:
                relay.cut_s2c_at = relay.s2c_count + _body_start({"ok": True, "size": size}) + cut
            with pytest.raises(ProtocolError, match="closed the connection in the middle"):
                BlobClient(lambda c=conn: c).get_to_file(key, tmp_path / "out" / "blob", "job-t")
            assert not list((tmp_path / "out").iterdir()), "a truncated body left a file"
        finally:
            relay.close()
    server.close()
    blobs.close()


@pytest.mark.parametrize("size", _SIZES)
def test_a_truncated_upload_stores_nothing_and_the_server_keeps_serving(tmp_path, body_mac, size):
    secret, blobs, server = _blob_rig(tmp_path)
    relay = Relay(server.endpoint)
    try:
        conn = Connection.connect(relay.endpoint, secret, timeout=5)
        head = {"op": "blob.put", "job_id": "job-t", "size": size, "type": "t"}
        with relay.lock:
            relay.cut_c2s_at = len(relay.c2s) + _body_start(head) + size + wire.TAG_SIZE - 1
        with pytest.raises((StewardError, OSError)):
            BlobClient(lambda: conn).put_bytes(os.urandom(size), "job-t")
        wait_until(lambda: not list(blobs.incoming.iterdir()), what="the upload's staged file is removed")
        assert not (blobs.dir / "job-t").exists()
        with Connection.connect(server.endpoint, secret) as direct:
            client = BlobClient(lambda: direct)
            assert client.get_bytes(client.put_bytes(b"still serving")) == b"still serving"
    finally:
        relay.close()
        server.close()
        blobs.close()


def test_a_wrong_secret_is_refused_both_ways_before_any_blob_moves(tmp_path):
    secret, blobs, server = _blob_rig(tmp_path)
    try:
        with pytest.raises(AuthenticationError, match="secret"):
            Connection.connect(server.endpoint, new_secret(), timeout=5)
        assert server.auth_failures == 1
        with pytest.raises(AuthenticationError, match="secret"):  # an agent without the client's secret
            with AgentServer("127.0.0.1", 0, new_secret(), {}) as other:
                Connection.connect(other.endpoint, secret, timeout=5)
        assert blobs.stats["uploads"] == blobs.stats["served"] == 0
    finally:
        server.close()
        blobs.close()


def _session_pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    client, server = Connection(a, 1 << 20, "server"), Connection(b, 1 << 20, "client", server_side=True)
    nonces = os.urandom(32), os.urandom(32)
    for conn in (client, server):
        conn._start_session("s" * 64, *nonces, "hmac-sha256")
    return client, server


def test_bytes_read_ahead_are_verified_when_used_and_unasked_ones_make_the_connection_stale():
    client, server = _session_pair()
    try:
        # one write: a real frame, then a forged one; the first receive reads both
        server._sendall(server._frame(b'{"ok":true,"n":1}') + _plain_frame({"ok": True, "n": 2}) + bytes(32))
        assert client.recv() == {"ok": True, "n": 1}
        assert client.is_stale(), "bytes nobody asked for are waiting: the connection must not be reused"
        with pytest.raises(AuthenticationError, match="does not verify"):
            client.recv()
        assert client.broken
    finally:
        client.close()
        server.close()


def test_a_connection_closed_after_an_error_reply_is_stale_at_once_and_after_an_ok_reply_soon():
    """``is_stale`` skips its poll for a moment after an ok reply (a get's hot path), never after an
    error reply: an agent closes a connection right after some errors, and the next request must
    reconnect, not fail on the closed socket."""
    client, server = _session_pair()
    try:
        server._sendall(server._frame(b'{"ok":false,"error":{"code":"PROTOCOL","message":"no"}}'))
        assert client.recv()["ok"] is False
        server.close()
        assert client.is_stale(), "closed after an error reply: the next request must reconnect"
    finally:
        client.close()
    client, server = _session_pair()
    try:
        server._sendall(server._frame(b'{"ok":true}'))
        assert client.recv() == {"ok": True}
        server.close()
        time.sleep(2 * wire._FRESH)
        assert client.is_stale(), "the peer closed the connection: it must not be reused"
    finally:
        client.close()


class _ShortWrites(io.FileIO):
    """A file whose ``write`` takes only part of what it is given, as write(2) may (a disk that fills
    up mid-write, RLIMIT_FSIZE): the count it returns is all that landed."""

    def write(self, b):
        view = memoryview(b)
        return super().write(view[:max(1, len(view) // 2)])


@pytest.mark.parametrize("size", [4096, 3 << 20])
def test_an_upload_whose_staged_file_takes_short_writes_stores_every_byte_or_nothing(tmp_path, monkeypatch, size):
    """A short write into the staged file must not be ignored: the blob stored under its key (and
    marked verified) would then be shorter than the bytes the key was computed from."""
    from sparksteward.blob import server as blob_server
    from sparksteward.hashing import hash_file

    monkeypatch.setattr(blob_server, "open", lambda path, mode="r", **kw: _ShortWrites(path, mode), raising=False)
    secret, blobs, server = _blob_rig(tmp_path)
    try:
        data = os.urandom(size)
        with Connection.connect(server.endpoint, secret) as conn:
            try:
                key = BlobClient(lambda: conn).put_bytes(data, "job-w")
            except StewardError:
                key = None
        if key is not None:
            stored = blobs.local_path("job-w", key)
            assert stored.stat().st_size == size, "a staged file that missed bytes was renamed into place"
            assert hash_file(stored) == key.digest
    finally:
        server.close()
        blobs.close()


def test_a_raw_reader_returns_at_most_the_bytes_asked_for():
    client, server = _session_pair()
    try:
        server.send_body(bytes(range(100)))
        reader = wire.RawReader(client, 100)
        got = []
        while len(chunk := reader.read(10)):
            assert len(chunk) <= 10
            got.append(bytes(chunk))
        assert b"".join(got) == bytes(range(100))
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("size", [4096, 3 << 20])
def test_a_download_whose_temp_file_takes_short_writes_lands_whole_or_not_at_all(tmp_path, monkeypatch, size):
    """verified_copy hashes the chunks it was given: a short write it ignored would rename a file
    shorter than its key into place."""
    from sparksteward.blob import store

    secret, blobs, server = _blob_rig(tmp_path)
    try:
        data = os.urandom(size)
        with Connection.connect(server.endpoint, secret) as conn:
            key = BlobClient(lambda: conn).put_bytes(data, "job-w")
        monkeypatch.setattr(store, "open", lambda path, mode="r", **kw: _ShortWrites(path, mode) if "w" in mode
                            else open(path, mode, **kw), raising=False)
        dest = tmp_path / "out" / "blob"
        with Connection.connect(server.endpoint, secret) as conn, contextlib.suppress(StewardError, OSError):
            BlobClient(lambda: conn).get_to_file(key, dest, "job-w")
        assert not dest.exists() or dest.read_bytes() == data, "a short copy was renamed into place"
    finally:
        server.close()
        blobs.close()
