"""Authenticated, size-bounded sockets between clients and agents (wire version 2).

**Handshake** (both sides prove the per-application secret; it never crosses the socket)::

    server -> client   {"v": 2, "op": "challenge", "nonce": Ns}
    client -> server   {"v": 2, "op": "auth", "nonce": Nc, "mac": HMAC(secret, "client proof" | Ns | Nc)}
    server -> client   {"ok": true, "mac": HMAC(secret, "server proof" | Ns | Nc)}

The server compares the client's proof, the client compares the server's, both in constant time;
a peer without the secret is refused either way with :class:`AuthenticationError`. Both then derive
the session key ``K = HMAC(secret, "session key" | Ns | Nc)`` (distinct labels; nonces of 32 random
bytes from each side, so a key is never reused across connections).

**Frames** are a 4-byte big-endian length, one orjson object and, after the handshake, a 32-byte
``HMAC-SHA256(K, direction | "F" | seq | payload)``. Each direction counts its own sequence numbers
from 0, so a relay that passed one real handshake through can neither inject, replay, reorder nor
reflect frames: the receiver closes the connection on the first tag that does not verify.
**Bodies** (raw blob bytes of a length a frame announced) are followed by a 32-byte tag under a
key of their own, ``Kb = HMAC(K, direction | "B" | seq | size)``: Poly1305 under the one-time key
``Kb`` when both sides have ``cryptography`` (negotiated in the handshake, inside both proofs), else
``HMAC-SHA256`` keyed the same way (decision 0007). Under ``poly1305-large``, the first choice, bodies
under 64 KiB take the HMAC-SHA256 form, whose keyed state is copied rather than set up per body. Senders hash each 1 MiB chunk of a file right
after ``sendfile`` handed it to the kernel, from a read-only memory map (no copies); readers hash
each chunk as it arrives and verify the tag before they hand the last chunk over, so a tampered or
truncated body is never accepted. Bodies and frames share the sequence counter. A frame and a small
body that follows it go out in one write, and after the handshake a receive takes up to 64 KiB the
peer sent already (so a request or reply with a small body costs one system call each way); those
bytes are verified when they are consumed, and an idle connection holding any is stale. Same-host
blob copies hand over a file path and stay free of per-byte cost.

**Bounds.** Until a peer is authenticated its frames are bounded to :data:`PRE_AUTH_LIMIT` bytes and
the whole handshake to ``handshake_timeout`` seconds. Unauthenticated connections never hold one of
the ``max_connections`` request slots: at most ``max_handshakes`` may be pending, and when that bound
is full a new connection evicts the oldest pending one, so slow or silent peers cannot lock clients
out. The accept loop never reads from a peer. Authenticated frames are bounded to ``max_message``;
a reply over that bound becomes a ``TOO_LARGE`` error reply on a connection that stays usable.

Requests are ``{"op": name, ...}``; replies are ``{"ok": true, ...}`` or
``{"ok": false, "error": {"code", "message"}}``. Handlers read their fields through :class:`Fields`,
which refuses a wrong type with ``INVALID_REQUEST`` naming the op, the field, the value and what was
expected. A handler error never kills the server; protocol violations, and errors of a request whose
announced body was not read (:meth:`Connection.expect_body`), close the connection.

Thread-safety: :class:`AgentServer` runs one daemon thread per connection; handlers must be
thread-safe. A :class:`Connection` is not thread-safe; use one per thread.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import orjson

from sparksteward.errors import (
    AgentUnavailableError,
    AuthenticationError,
    MessageTooLargeError,
    ProtocolError,
    StewardError,
    error_from_code,
)

try:  # a declared dependency; if it cannot be imported, bodies fall back to HMAC-SHA256
    from cryptography.hazmat.primitives.poly1305 import Poly1305
    _Poly1305: type[Poly1305] | None = Poly1305
except ImportError:  # pragma: no cover - depends on the environment
    _Poly1305 = None

__all__ = ["BODY_MACS", "Connection", "PRE_AUTH_LIMIT", "RawReader", "TAG_SIZE", "new_secret", "parse_endpoint", "write_all",
           "shutdown_socket"]

log = logging.getLogger("sparksteward.wire")

WIRE_VERSION = 2
PRE_AUTH_LIMIT = 1024
TAG_SIZE = 32
NONCE_SIZE = 32
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_CHUNK = 1 << 20  # a body's bytes move in chunks this big: each stays in cache while it is hashed and written
_PARALLEL_MAC = 1 << 20  # HMAC-SHA256 bodies this big are hashed on a helper thread
_READ_AHEAD = 64 << 10  # after the handshake, a short read asks the socket for up to this much
_CLIENT_PROOF = b"sparksteward wire v2 client proof\0"
_SERVER_PROOF = b"sparksteward wire v2 server proof\0"
_SESSION_KEY = b"sparksteward wire v2 session key\0"

#: Bodies under this size take HMAC-SHA256 under ``poly1305-large``: a keyed HMAC copy costs about
#: 2 µs where setting up a Poly1305 context costs about 15, more than hashing 64 KiB.
_SMALL_BODY = 64 << 10
#: Body MACs this process can compute, preferred first. The client offers them, the server picks.
#: ``poly1305-large``: Poly1305 for bodies of :data:`_SMALL_BODY` bytes or more, HMAC-SHA256 below.
BODY_MACS: tuple[str, ...] = (("poly1305-large", "poly1305") if _Poly1305 is not None else ()) + ("hmac-sha256",)



def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port``; raise ProtocolError naming the endpoint if it is malformed."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _derive(secret: str, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(secret.encode(), label + server_nonce + client_nonce, "sha256")


def _nonce(value: object, peer: str) -> bytes:
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_SIZE:
        raise ProtocolError(f"peer {peer} sent no valid {NONCE_SIZE}-byte nonce in its handshake")
    return nonce


class _PolyMac:
    """Poly1305 under a one-time key (each body's own key, derived from the session key, direction
    and sequence number), padded to :data:`TAG_SIZE`."""

    def __init__(self, key: bytes) -> None:
        assert _Poly1305 is not None  # poly1305 is offered (BODY_MACS), so negotiated, only when it imported
        self._p = _Poly1305(key)

    def update(self, data: bytes | memoryview) -> None:
        self._p.update(data)

    def digest(self) -> bytes:
        return self._p.finalize() + bytes(TAG_SIZE - 16)


def _offer_text(offer: list[str]) -> bytes:
    return ",".join(offer).encode()


class Connection:
    """One framed socket; used by both sides. See the module docstring.

    ``broken`` turns true when a send or receive failed part-way (timeout, reset, bad tag): the
    stream can no longer be trusted, so clients drop the connection and open a new one.
    """

    def __init__(self, sock: socket.socket, max_message: int, peer: str = "", *, server_side: bool = False) -> None:
        self.sock = sock
        self.max_message = max_message
        self.peer = peer
        self.broken = False
        self.unread_body = False
        self._limit = PRE_AUTH_LIMIT
        self._key: Any = None  # an HMAC object keyed with the session key, copied per frame or body
        self.body_mac = "hmac-sha256"
        self._out, self._in = (b"S", b"C") if server_side else (b"C", b"S")
        self._send_seq = self._recv_seq = 0
        self._deadline: float | None = None
        self._timeout = sock.gettimeout()
        self._ahead = bytearray()  # bytes received beyond what was asked for (authenticated only)
        self._scratch: bytearray | None = None
        self._poller: Any = None  # is_stale's, made on its first call

    # --- session ---------------------------------------------------------------------------------
    def _start_session(self, secret: str, server_nonce: bytes, client_nonce: bytes, body_mac: str) -> None:
        key = hmac.new(_derive(secret, _SESSION_KEY, server_nonce, client_nonce), digestmod="sha256")
        # OpenSSL's HMAC object itself when hmac wraps one: copy, update and digest in C, six Python
        # calls fewer for each frame and small body
        self._key = getattr(key, "_hmac", None) or key
        self.body_mac = body_mac
        self._limit = self.max_message
        self._deadline = None
        self.sock.settimeout(self._timeout)

    def _mac(self, direction: bytes, kind: bytes, seq: int, size: int = -1) -> Any:
        h = self._key.copy()
        h.update(direction + kind + _SEQ.pack(seq) + (_SEQ.pack(size) if size >= 0 else b""))
        return h

    def _fail(self, exc: BaseException) -> BaseException:
        self.broken = True
        return exc

    # --- framing ---------------------------------------------------------------------------------
    def _frame(self, body: bytes) -> bytes:
        """Length prefix, ``body`` and (after the handshake) its tag; advances the send sequence."""
        if self._key is None:
            return _LEN.pack(len(body)) + body
        h = self._mac(self._out, b"F", self._send_seq)
        h.update(body)
        self._send_seq += 1
        return b"".join((_LEN.pack(len(body)), body, h.digest()))

    def _sendall(self, data: bytes | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self._fail(exc) from None

    def send(self, msg: dict[str, Any]) -> None:
        """Send one frame; a message over ``max_message`` raises MessageTooLargeError and sends nothing."""
        self._sendall(self._encode(msg))

    def _encode(self, msg: dict[str, Any]) -> bytes:
        body = orjson.dumps(msg)
        if len(body) > self.max_message:
            raise MessageTooLargeError(
                f"message of {len(body)} bytes exceeds spark.steward.rpc.max-message-size ({self.max_message})")
        return self._frame(body)

    def recv(self) -> dict[str, Any]:
        """Receive one frame, verify its tag and parse it."""
        (length,) = _LEN.unpack(self.recv_exact(_LEN.size))
        if length > self._limit:
            raise self._fail(MessageTooLargeError(
                f"peer {self.peer} announced a {length}-byte message; the limit is {self._limit} bytes"))
        data = self.recv_exact(length + (TAG_SIZE if self._key is not None else 0))
        body = memoryview(data)[:length]
        if self._key is not None:
            h = self._mac(self._in, b"F", self._recv_seq)
            h.update(body)
            if not hmac.compare_digest(h.digest(), data[length:]):
                raise self._fail(AuthenticationError(
                    f"peer {self.peer} sent a frame whose tag does not verify (injected, replayed, reordered "
                    f"or corrupted in transit); closing the connection"))
            self._recv_seq += 1
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise self._fail(ProtocolError(f"peer {self.peer} sent a message that is not JSON")) from exc
        if not isinstance(msg, dict):
            raise self._fail(ProtocolError(f"peer {self.peer} sent a JSON {type(msg).__name__}, not an object"))
        return msg

    def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes. After the handshake a short read takes what the peer sent already, up
        to :data:`_READ_AHEAD` bytes, and keeps the rest for the next read (one system call for a
        frame and a small body); the bytes are verified by whoever consumes them, as ever."""
        ahead = self._ahead
        if len(ahead) < n and self._key is not None and n < _READ_AHEAD:
            if self._scratch is None:
                self._scratch = bytearray(_READ_AHEAD)
            view = memoryview(self._scratch)
            while len(ahead) < n:
                ahead += view[:self._recv_into(view, _READ_AHEAD, n)]
        if len(ahead) >= n:
            out = bytes(ahead[:n])
            del ahead[:n]
            return out
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            got += self._read_into(view[got:], n - got, n)
        return bytes(buf)

    def _read_into(self, view: memoryview, want: int, total: int) -> int:
        """Up to ``want`` bytes into ``view``: read-ahead bytes first, else one receive."""
        ahead = self._ahead
        if ahead:
            k = min(want, len(ahead))
            view[:k] = ahead[:k]
            del ahead[:k]
            return k
        return self._recv_into(view, want, total)

    def _recv_into(self, view: memoryview, want: int, total: int) -> int:
        try:
            if self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the handshake with {self.peer} did not finish in time")
                self.sock.settimeout(left)
            k = self.sock.recv_into(view, want)
        except OSError as exc:
            raise self._fail(exc) from None
        if k == 0:
            raise self._fail(ProtocolError(f"peer {self.peer} closed the connection in the middle of "
                                           f"{total} bytes"))
        return k

    # --- bodies ----------------------------------------------------------------------------------
    def expect_body(self) -> None:
        """Declare (server side, first thing in a handler) that this request is followed by a body:
        if the handler fails before reading it, the server closes the connection rather than parse
        the body as requests."""
        self.unread_body = True

    def _body_mac(self, direction: bytes, size: int) -> Any:
        if self._key is None:
            raise ProtocolError("bodies are only sent on authenticated connections")
        seq = self._send_seq if direction == self._out else self._recv_seq
        if direction == self._out:
            self._send_seq += 1
        else:
            self._recv_seq += 1
        h = self._mac(direction, b"B", seq, size)
        if self.body_mac == "poly1305" or (self.body_mac == "poly1305-large" and size >= _SMALL_BODY):
            return _PolyMac(h.digest())
        return h

    def _verify_body(self, h: Any, size: int, tag: bytes | memoryview | None = None) -> None:
        self.unread_body = False
        if not hmac.compare_digest(h.digest(), self.recv_exact(TAG_SIZE) if tag is None else tag):
            raise self._fail(AuthenticationError(
                f"the {size}-byte body from peer {self.peer} does not match its tag (tampered or corrupted "
                f"in transit); it was discarded and the connection closed"))

    def send_body(self, data: bytes | memoryview, head: dict[str, Any] | None = None) -> None:
        """Send ``data`` as a body (then its tag). ``head``: a frame to send just before it (small
        bodies go out in the same write)."""
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, len(data))
        h.update(data)
        if len(data) < _PARALLEL_MAC:
            self._sendall(b"".join((framed, data, h.digest())))
        else:
            if framed:
                self._sendall(framed)
            self._sendall(data)
            self._sendall(h.digest())

    def send_file(self, f: BinaryIO | int, n: int, head: dict[str, Any] | None = None) -> None:
        """Send exactly ``n`` bytes of ``f`` as a body: from a file's current offset, or from the start
        of a file descriptor. ``sendfile`` for the bytes, a tag computed
        over a read-only memory map of the same range (no copies) on a helper thread meanwhile. Bodies
        under 1 MiB go out as one read and one write instead. ``head``: a frame to send just before
        the body (small bodies go out in the same write)."""
        if isinstance(f, int):
            if n < _PARALLEL_MAC:
                self._send_range(f, 0, n, head)
            else:
                with open(f, "rb", buffering=0, closefd=False) as wrapped:
                    wrapped.seek(0)
                    self.send_file(wrapped, n, head)
            return
        start = f.tell()
        if n < _PARALLEL_MAC:
            self._send_range(f.fileno(), start, n, head, getattr(f, "name", None))
            f.seek(start + n)
            return
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, n)
        if framed:
            self._sendall(framed)
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    end = start + n
                    if end > len(view):
                        raise ProtocolError(f"cannot send {n} bytes from offset {start} of a {len(view)}-byte file")
                    if isinstance(h, _PolyMac):  # cheap: each chunk right after the kernel took it
                        sent = 0
                        while sent < n:
                            k = self.sock.sendfile(f, offset=start + sent, count=min(_CHUNK, n - sent))
                            if k <= 0:
                                break
                            h.update(view[start + sent:start + sent + k])
                            sent += k
                    else:  # HMAC on a second thread while the kernel sends (both release the GIL)
                        hasher = threading.Thread(target=h.update, args=(view[start:end],), name="steward-mac")
                        hasher.start()
                        try:
                            sent = self.sock.sendfile(f, offset=start, count=n)
                        finally:
                            hasher.join()
                    if sent != n:
                        raise ProtocolError(f"sent {sent} of {n} bytes to {self.peer}")
                finally:
                    view.release()
        except (OSError, ProtocolError) as exc:
            raise self._fail(exc) from None
        self._sendall(h.digest())

    def _send_range(self, fd: int, start: int, n: int, head: dict[str, Any] | None, name: object = None) -> None:
        """A small body: one read, and one write with its head frame and tag."""
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, n)
        try:
            data = os.pread(fd, n, start)
        except OSError as exc:
            raise self._fail(exc) from None
        if len(data) != n:
            raise self._fail(ProtocolError(f"cannot send {n} bytes from offset {start} of "
                                           f"{name or 'a file'!r}: it is shorter"))
        h.update(data)
        self._sendall(b"".join((framed, data, h.digest())))

    def recv_into_file(self, f: BinaryIO | int, n: int, on_chunk: Callable[[bytes | memoryview], None] | None = None) -> None:
        """Copy exactly ``n`` body bytes from the socket into ``f``, a file or a file descriptor
        (``on_chunk`` sees each chunk); the body's tag is verified before the last chunk is written
        (AuthenticationError if it fails). A small body and its tag are taken in one receive."""
        if n + TAG_SIZE < _READ_AHEAD:
            body = self._recv_whole_body(self._body_mac(self._in, n), n)
            write_all(f, body)
            if on_chunk is not None:
                on_chunk(body)
            return
        reader = RawReader(self, n)
        while len(chunk := reader.read(_CHUNK)):
            write_all(f, chunk)
            if on_chunk is not None:
                on_chunk(chunk)

    def _recv_whole_body(self, h: Any, n: int) -> memoryview:
        """A small body and its tag in one receive, ``h`` (its MAC) verified: the body's bytes."""
        data = memoryview(self.recv_exact(n + TAG_SIZE))
        h.update(data[:n])
        self._verify_body(h, n, data[n:])
        return data[:n]

    # --- client side -----------------------------------------------------------------------------
    @classmethod
    def connect(cls, endpoint: str, secret: str, *, timeout: float = 120.0,
                max_message: int = 16 << 20) -> Connection:
        """Connect to an agent and authenticate both ways (the whole handshake within ``timeout``);
        raise AgentUnavailableError, or AuthenticationError if either side lacks the secret."""
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise AgentUnavailableError(
                f"cannot reach the spark-steward agent at {endpoint}: {exc}. Is the plugin enabled "
                f"(spark.plugins=sparksteward.shim.StewardPlugin) and the session running?") from exc
        conn = cls(sock, max_message, endpoint)
        conn._deadline = time.monotonic() + timeout
        try:
            challenge = conn.recv()
            if challenge.get("op") != "challenge" or challenge.get("v") != WIRE_VERSION:
                raise ProtocolError(
                    f"the agent at {endpoint} speaks wire version {challenge.get('v')!r}, this client "
                    f"{WIRE_VERSION}: use the same spark-steward version on the driver, executors and clients")
            server_nonce = _nonce(challenge.get("nonce"), endpoint)
            client_nonce = secrets.token_bytes(NONCE_SIZE)
            offer = list(BODY_MACS)
            conn.send({"v": WIRE_VERSION, "op": "auth", "nonce": client_nonce.hex(), "body_macs": offer,
                       "mac": _derive(secret, _CLIENT_PROOF + _offer_text(offer), server_nonce, client_nonce).hex()})
            reply = conn._check(conn.recv())
            proof, body_mac = reply.get("mac"), reply.get("body_mac")
            body_mac = body_mac if body_mac in offer else offer[-1]  # a bad choice fails the proof below
            expected = _derive(secret, _SERVER_PROOF + body_mac.encode(), server_nonce, client_nonce).hex()
            if (not isinstance(proof, str) or reply.get("body_mac") not in offer
                    or not hmac.compare_digest(proof.encode(), expected.encode())):
                raise AuthenticationError(
                    f"the peer at {endpoint} did not prove that it knows the application secret, so it is "
                    f"not this application's agent (a wrong endpoint or an impostor); refusing to use it")
            conn._start_session(secret, server_nonce, client_nonce, body_mac)
        except (OSError, ValueError) as exc:
            sock.close()
            if isinstance(exc, StewardError):
                raise
            raise AgentUnavailableError(f"handshake with the agent at {endpoint} failed: {exc}") from exc
        return conn

    def answer_handshake(self, secret: str, timeout: float) -> None:
        """The server side of the handshake (see the module docstring), within ``timeout`` seconds:
        challenge, check the client's proof, pick a body MAC, prove the secret back. Raises
        AuthenticationError or ProtocolError for the caller to send back; OSError when the peer is
        too slow or gone."""
        self._deadline = time.monotonic() + timeout
        server_nonce = secrets.token_bytes(NONCE_SIZE)
        self.send({"v": WIRE_VERSION, "op": "challenge", "nonce": server_nonce.hex()})
        msg = self.recv()
        mac = msg.get("mac")
        if msg.get("op") != "auth" or msg.get("v") != WIRE_VERSION or not isinstance(mac, str):
            raise ProtocolError(f"peer {self.peer} sent no wire-version-{WIRE_VERSION} auth message; "
                                f"use the same spark-steward version everywhere")
        client_nonce = _nonce(msg.get("nonce"), self.peer)
        offer = msg.get("body_macs")
        if not isinstance(offer, list) or not all(isinstance(m, str) for m in offer) or len(offer) > 8:
            raise ProtocolError(f"peer {self.peer} sent no list of body MACs in its handshake")
        expected = _derive(secret, _CLIENT_PROOF + _offer_text(offer), server_nonce, client_nonce).hex()
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            raise AuthenticationError("authentication failed: the peer does not know this application's secret")
        body_mac = next((m for m in BODY_MACS if m in offer), None)
        if body_mac is None:
            raise ProtocolError(f"peer {self.peer} offers body MACs {offer}; this agent knows {list(BODY_MACS)}")
        self.send({"ok": True, "body_mac": body_mac,
                   "mac": _derive(secret, _SERVER_PROOF + body_mac.encode(), server_nonce, client_nonce).hex()})
        self._start_session(secret, server_nonce, client_nonce, body_mac)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply; an error reply raises the matching StewardError."""
        return self.call(op, fields)

    def call(self, op: str, fields: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """:meth:`request` with an explicit socket ``timeout`` for this round trip."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            self.send({"op": op, **fields})
            return self._check(self.recv())
        finally:
            if timeout is not None and not self.broken:
                self.sock.settimeout(self._timeout)

    def is_stale(self) -> bool:
        """True if this idle connection cannot be used: it broke, the peer closed it, or the peer sent
        something unasked. Never blocks; call it before reusing a cached connection."""
        if self.broken or self.sock.fileno() < 0 or self._ahead:
            return True
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(self._poller.poll(0))

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("ok"):
            return reply
        err = reply.get("error") or {}
        raise error_from_code(str(err.get("code", "REMOTE")), str(err.get("message", "unknown error")))

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawReader:
    """A file-like ``read(n)`` over exactly ``size`` body bytes of a connection (the returned view is
    valid until the next read). The body's tag is verified before the last chunk is returned, so a
    tampered body raises AuthenticationError instead of ending.

    Chunks are at most 1 MiB, so one stays in the CPU cache while it is received, MAC'd, checksummed
    and written by the caller. Poly1305 hashes each chunk at once; under the HMAC-SHA256 fallback two
    reused buffers alternate and a chunk's MAC is computed on a helper thread while the caller writes
    it and the next one arrives (hashing releases the GIL).
    """

    def __init__(self, conn: Connection, size: int) -> None:
        self.conn, self.size, self.left = conn, size, size
        self._bufs: list[bytearray] = []  # made on the first read that needs them
        self._turn = 0
        self._mac = conn._body_mac(conn._in, size)
        self._hasher: threading.Thread | None = None
        self._verified = False

    def _join(self) -> None:
        if self._hasher is not None:
            self._hasher.join()
            self._hasher = None

    def _finish(self) -> None:
        self._join()
        if not self._verified:
            self._verified = True
            self.conn._verify_body(self._mac, self.size)

    def read(self, n: int) -> memoryview | bytes:
        if self.left <= 0:
            self._finish()
            return b""
        if self.left == self.size < min(n, _PARALLEL_MAC):  # small: body and tag in one receive
            self.left, self._verified = 0, True
            return self.conn._recv_whole_body(self._mac, self.size)
        if not self._bufs:
            cap = min(_CHUNK, max(self.size, 1))
            self._bufs = [bytearray(cap)] + ([bytearray(cap)] if self.size > cap else [])
        buf = self._bufs[self._turn]
        self._turn = (self._turn + 1) % len(self._bufs)
        view = memoryview(buf)[: min(n, self.left, len(buf))]
        got = 0
        try:
            while got < len(view):
                got += self.conn._read_into(view[got:], len(view) - got, self.size)
        finally:
            self._join()  # the previous chunk is hashed (in order) before this one starts
        chunk = view[:got]
        self.left -= got
        if got >= _PARALLEL_MAC and not isinstance(self._mac, _PolyMac):
            self._hasher = threading.Thread(target=self._mac.update, args=(chunk,), name="steward-mac")
            self._hasher.start()
        else:
            self._mac.update(chunk)
        if self.left == 0:
            self._finish()
        return chunk


def write_all(f: BinaryIO | int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``f``, an unbuffered file or a file descriptor: one write may take part
    of it (write(2) on a disk that fills up, or past RLIMIT_FSIZE, returns a short count without an
    error)."""
    view = memoryview(data)
    while len(view):
        k = os.write(f, view) if isinstance(f, int) else f.write(view)
        if not k:  # None: a non-blocking file took nothing
            raise OSError(f"writing {len(view)} bytes to {getattr(f, 'name', 'a file')!r} made no progress")
        view = view[k:]


def shutdown_socket(sock: socket.socket) -> None:
    """Shut a socket down both ways; a socket that is gone already is left alone."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def new_secret() -> str:
    """A fresh application secret (used by tests and by agents started without the shim)."""
    return os.urandom(32).hex()
