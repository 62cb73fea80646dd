"""Authenticated, size-bounded sockets between clients and agents (wire version 2): :class:`Connection`.

**Handshake** (:mod:`sparksteward.wire.handshake`): both sides prove the per-application secret, which
never crosses the socket, and derive a session key ``K`` unique to the connection; a peer without the
secret is refused either way with :class:`AuthenticationError`.

**Frames** are a 4-byte big-endian length, one orjson object and, after the handshake, a 32-byte
``HMAC-SHA256(K, direction | "F" | seq | payload)``. Each direction counts its own sequence numbers
from 0, so a relay that passed one real handshake through can neither inject, replay, reorder nor
reflect frames: the receiver closes the connection on the first tag that does not verify.
**Bodies** (:mod:`sparksteward.wire.body`: raw blob bytes of a length a frame announced) are followed
by a 32-byte tag under a key of their own; bodies and frames share the sequence counter. A frame and
a small body that follows it go out in one write, and after the handshake a receive takes up to 64 KiB
the peer sent already (so a request or reply with a small body costs one system call each way); those
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

import contextlib
import hmac
import logging
import os
import select
import socket
import struct
import time
from typing import Any

import orjson

from sparksteward.errors import (
    AgentUnavailableError,
    AuthenticationError,
    MessageTooLargeError,
    ProtocolError,
    error_from_code,
)
from sparksteward.wire.body import _READ_AHEAD, BODY_MACS, TAG_SIZE, BodyStreams, RawReader, write_all
from sparksteward.wire.handshake import client_handshake, server_handshake, session_key

__all__ = ["BODY_MACS", "Connection", "PRE_AUTH_LIMIT", "RawReader", "TAG_SIZE", "new_secret", "parse_endpoint", "write_all",
           "shutdown_socket"]

log = logging.getLogger("sparksteward.wire")

PRE_AUTH_LIMIT = 1024
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
#: is_stale does not poll a connection whose peer answered ok this recently (seconds)
_FRESH = 0.001


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port``; raise ProtocolError naming the endpoint if it is malformed."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class Connection(BodyStreams):
    """One framed socket; used by both sides. See the module docstring; the body methods
    (:meth:`send_body`, :meth:`send_file`, :meth:`recv_into_file`, :meth:`expect_body`) come from
    :class:`~sparksteward.wire.body.BodyStreams`.

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
        self._answered = -1.0     # when the last ok reply arrived (monotonic)

    # --- session ---------------------------------------------------------------------------------
    def _start_session(self, secret: str, server_nonce: bytes, client_nonce: bytes, body_mac: str) -> None:
        self._key = session_key(secret, server_nonce, client_nonce)
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
        if msg.get("ok") is True:   # an agent closes a connection only after an error reply
            self._answered = time.monotonic()
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
        # this module's BODY_MACS, read at each call: a test or benchmark narrows it here
        client_handshake(conn, secret, timeout, BODY_MACS)
        return conn

    def answer_handshake(self, secret: str, timeout: float) -> None:
        """The server side of the handshake (:func:`~sparksteward.wire.handshake.server_handshake`),
        within ``timeout`` seconds: challenge, check the client's proof, pick a body MAC, prove the
        secret back. Raises AuthenticationError or ProtocolError for the caller to send back; OSError
        when the peer is too slow or gone."""
        server_handshake(self, secret, timeout, BODY_MACS)

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
        if time.monotonic() - self._answered < _FRESH:
            # the peer answered on it a moment ago: no agent closes or restarts that fast, and a peer
            # that died since fails the next request as it would a moment after the poll
            return False
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
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shutdown_socket(sock: socket.socket) -> None:
    """Shut a socket down both ways; a socket that is gone already is left alone."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def new_secret() -> str:
    """A fresh application secret (used by tests and by agents started without the shim)."""
    return os.urandom(32).hex()
