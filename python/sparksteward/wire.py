"""Authenticated, size-bounded local sockets between clients and agents.

Frames are a 4-byte big-endian length followed by one orjson object. A connection starts with a
challenge: the server sends a random nonce, the client answers ``HMAC-SHA256(secret, nonce)``, and the
server compares it in constant time (``hmac.compare_digest``). The secret itself never crosses the
socket. Until a peer is authenticated its frames are bounded to :data:`PRE_AUTH_LIMIT` bytes; after
that to ``max_message`` bytes. Bulk data (blob bodies) follows a frame as raw bytes of a length the
frame announced.

Requests are ``{"op": name, ...}``; replies are ``{"ok": true, ...}`` or
``{"ok": false, "error": {"code", "message"}}``. A handler error never kills the server: it becomes
an error reply and, for protocol violations, a closed connection.

Thread-safety: :class:`AgentServer` runs one daemon thread per connection, bounded by
``max_connections``; handlers must be thread-safe. A :class:`Connection` is not thread-safe; use one
per thread.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
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

__all__ = ["AgentServer", "Connection", "Handler", "PRE_AUTH_LIMIT", "RawReader", "parse_endpoint"]

log = logging.getLogger("sparksteward.wire")

WIRE_VERSION = 1
PRE_AUTH_LIMIT = 1024
_LEN = struct.Struct(">I")
_CHUNK = 1 << 20

Handler = Callable[["Connection", dict[str, Any]], "dict[str, Any] | None"]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port``; raise ProtocolError naming the endpoint if it is malformed."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _mac(secret: str, nonce: bytes) -> str:
    return hmac.new(secret.encode(), nonce, "sha256").hexdigest()


class Connection:
    """One framed socket; used by both sides."""

    def __init__(self, sock: socket.socket, max_message: int, peer: str = "") -> None:
        self.sock = sock
        self.max_message = max_message
        self.peer = peer
        self._limit = PRE_AUTH_LIMIT

    # --- framing -----------------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        body = orjson.dumps(msg)
        if len(body) > self.max_message:
            raise MessageTooLargeError(
                f"message of {len(body)} bytes exceeds spark.steward.rpc.max-message-size ({self.max_message})")
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def recv(self) -> dict[str, Any]:
        (length,) = _LEN.unpack(self.recv_exact(_LEN.size))
        if length > self._limit:
            raise MessageTooLargeError(
                f"peer {self.peer} announced a {length}-byte message; the limit is {self._limit} bytes")
        body = self.recv_exact(length)
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"peer {self.peer} sent a message that is not JSON") from exc
        if not isinstance(msg, dict):
            raise ProtocolError(f"peer {self.peer} sent a JSON {type(msg).__name__}, not an object")
        return msg

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ProtocolError(f"peer {self.peer} closed the connection after {got} of {n} bytes")
            got += k
        return bytes(buf)

    def recv_into_file(self, f: BinaryIO, n: int, on_chunk: Callable[[bytes], None] | None = None) -> None:
        """Copy exactly ``n`` raw bytes from the socket into ``f``; ``on_chunk`` sees each chunk."""
        buf = bytearray(min(_CHUNK, max(n, 1)))
        view = memoryview(buf)
        left = n
        while left:
            k = self.sock.recv_into(view, min(left, len(buf)))
            if k == 0:
                raise ProtocolError(f"peer {self.peer} closed the connection with {left} of {n} bytes unsent")
            chunk = view[:k]
            f.write(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
            left -= k

    def send_file(self, f: BinaryIO, n: int) -> None:
        """Send exactly ``n`` bytes of ``f`` from its current offset, with ``sendfile`` where possible."""
        sent = self.sock.sendfile(f, offset=f.tell(), count=n)
        if sent != n:
            raise ProtocolError(f"sent {sent} of {n} bytes to {self.peer}")

    # --- client side -------------------------------------------------------------------------
    @classmethod
    def connect(cls, endpoint: str, secret: str, *, timeout: float = 120.0,
                max_message: int = 16 << 20) -> Connection:
        """Connect to an agent and authenticate; raise AgentUnavailableError or AuthenticationError."""
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise AgentUnavailableError(
                f"cannot reach the spark-steward agent at {endpoint}: {exc}. Is the plugin enabled "
                f"(spark.plugins=sparksteward.shim.StewardPlugin) and the session running?") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = cls(sock, max_message, endpoint)
        try:
            challenge = conn.recv()
            nonce = bytes.fromhex(str(challenge.get("nonce", "")))
            conn.send({"v": WIRE_VERSION, "op": "auth", "mac": _mac(secret, nonce)})
            reply = conn.recv()
            conn._check(reply)
        except (OSError, ValueError) as exc:
            sock.close()
            if isinstance(exc, StewardError):
                raise
            raise AgentUnavailableError(f"handshake with the agent at {endpoint} failed: {exc}") from exc
        conn._limit = max_message
        return conn

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply; an error reply raises the matching StewardError."""
        self.send({"op": op, **fields})
        return self._check(self.recv())

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("ok"):
            return reply
        err = reply.get("error") or {}
        raise error_from_code(str(err.get("code", "REMOTE")), str(err.get("message", "unknown error")))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawReader:
    """A file-like ``read(n)`` over exactly ``size`` raw bytes of a connection, into one reused
    4 MiB buffer (the returned view is valid until the next read)."""

    def __init__(self, conn: Connection, size: int) -> None:
        self.conn, self.left = conn, size
        self._buf = bytearray(min(4 << 20, max(size, 1)))

    def read(self, n: int) -> memoryview | bytes:
        if self.left <= 0:
            return b""
        view = memoryview(self._buf)[: min(n, self.left, len(self._buf))]
        got = 0
        while got < len(view):
            k = self.conn.sock.recv_into(view[got:])
            if not k:
                raise ProtocolError(f"peer {self.conn.peer} closed the connection with {self.left - got} bytes unsent")
            got += k
        self.left -= got
        return view[:got]


class AgentServer:
    """A TCP server that authenticates every connection and dispatches requests to handlers.

    ``handlers`` maps an op name to ``handler(conn, request) -> reply dict``. A handler that streams
    raw bytes itself returns None after sending its reply frame.
    """

    def __init__(self, bind_host: str, port: int, secret: str, handlers: dict[str, Handler], *,
                 max_message: int = 16 << 20, max_connections: int = 64, timeout: float = 120.0) -> None:
        if not secret:
            raise AuthenticationError("refusing to start an agent socket without an application secret")
        self._secret = secret
        self._handlers = dict(handlers)
        self._max_message = max_message
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.auth_failures = 0
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind_host, port))
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="steward-accept", daemon=True)
        self._thread.start()

    def add_handler(self, op: str, handler: Handler) -> None:
        self._handlers[op] = handler

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(timeout=self._timeout):
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="steward-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        with self._lock:
            self._conns.add(sock)
        conn = Connection(sock, self._max_message, peer)
        try:
            sock.settimeout(self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._authenticate(conn):
                return
            while not self._closed:
                try:
                    req = conn.recv()
                except ProtocolError:
                    return  # peer went away between requests
                if not self._dispatch(conn, req):
                    return
        except (OSError, StewardError) as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            conn.close()
            self._slots.release()

    def _authenticate(self, conn: Connection) -> bool:
        nonce = secrets.token_bytes(32)
        conn.send({"v": WIRE_VERSION, "op": "challenge", "nonce": nonce.hex()})
        try:
            msg = conn.recv()
        except StewardError as exc:
            self._refuse(conn, exc)
            return False
        mac = msg.get("mac")
        if msg.get("op") != "auth" or not isinstance(mac, str) or not hmac.compare_digest(
                mac.encode(), _mac(self._secret, nonce).encode()):
            self._refuse(conn, AuthenticationError(
                "authentication failed: the peer does not know this application's secret"))
            return False
        conn._limit = self._max_message
        conn.send({"ok": True})
        return True

    def _refuse(self, conn: Connection, exc: StewardError) -> None:
        self.auth_failures += 1
        log.warning("refused connection from %s: %s", conn.peer, exc)
        try:
            conn.send({"ok": False, "error": exc.to_wire()})
        except OSError:
            pass

    def _dispatch(self, conn: Connection, req: dict[str, Any]) -> bool:
        """Run one request; return False if the connection must close."""
        op = req.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise ProtocolError(f"unknown request op {op!r}; known: {', '.join(sorted(self._handlers))}")
            reply = handler(conn, req)
        except StewardError as exc:
            conn.send({"ok": False, "error": exc.to_wire()})
            return not isinstance(exc, ProtocolError)
        except Exception as exc:  # a bug in a handler must not take the agent down
            log.exception("request %r from %s failed", op, conn.peer)
            conn.send({"ok": False, "error": {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}})
            return True
        if reply is not None:
            conn.send({"ok": True, **reply})
        return True

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop accepting, close every connection and join the accept thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for s in list(self._conns):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=5)

    def __enter__(self) -> AgentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_secret() -> str:
    """A fresh application secret (used by tests and by agents started without the shim)."""
    return os.urandom(32).hex()
