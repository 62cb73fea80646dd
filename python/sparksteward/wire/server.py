"""The agents' TCP server: it authenticates every connection (:meth:`Connection.answer_handshake`)
and dispatches its requests to handlers, within the bounds described in
:mod:`sparksteward.wire.connection`."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from sparksteward.errors import (
    AgentUnavailableError,
    AuthenticationError,
    MessageTooLargeError,
    ProtocolError,
    StewardError,
)
from sparksteward.wire.connection import Connection, shutdown_socket
from sparksteward.wire.messages import OPS, Message

__all__ = ["AgentServer", "Handler"]

log = logging.getLogger("sparksteward.wire")

Handler = Callable[[Connection, dict[str, Any]], "dict[str, Any] | None"]


class AgentServer:
    """A TCP server that authenticates every connection and dispatches requests to handlers.

    ``handlers`` maps an op name to ``handler(conn, request) -> reply dict``. A handler that streams
    raw bytes itself returns None after sending its reply frame. See the module docstring for the
    bounds (``max_connections`` authenticated, ``max_handshakes`` pending, ``handshake_timeout``).
    """

    def __init__(self, bind_host: str, port: int, secret: str, handlers: dict[str, Handler], *,
                 max_message: int = 16 << 20, max_connections: int = 64, timeout: float = 120.0,
                 handshake_timeout: float = 10.0, max_handshakes: int = 64) -> None:
        if not secret:
            raise AuthenticationError("refusing to start an agent socket without an application secret")
        self._secret = secret
        self._handlers = dict(handlers)
        self._max_message = max_message
        self._timeout = timeout
        self._handshake_timeout = handshake_timeout
        self._max_handshakes = max(1, max_handshakes)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._pending: dict[socket.socket, float] = {}  # unauthenticated, oldest first
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.auth_failures = 0
        self.handshakes_dropped = 0
        self.handshakes = 0   # connections authenticated
        self.requests: Counter[str] = Counter()   # requests received, by op
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind_host, port))
        self._sock.listen(512)
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="steward-accept", daemon=True)
        self._thread.start()

    def request_counts(self) -> dict[str, int]:
        """Requests received so far, by op."""
        with self._lock:
            return dict(self.requests)

    def add_handler(self, op: str, handler: Handler) -> None:
        """Serve ``op`` with ``handler(conn, request dict) -> reply dict``; prefer :meth:`serve`."""
        self._handlers[op] = handler

    def serve(self, request: type[Message], handler: Callable[[Connection, Any], Message | None], *,
              body: bool = False) -> None:
        """Serve ``request``'s op (registered in :data:`~sparksteward.wire.messages.OPS`) with
        ``handler(conn, typed request) -> reply message`` (or None when the handler streamed its reply
        itself): the request is parsed and checked once, here, before the handler runs. ``body``: a
        body follows the request (:meth:`Connection.expect_body` is declared before the parse, so a
        refused request closes the connection rather than read its body as requests)."""
        if OPS.get(request.OP) is None or OPS[request.OP].request is not request:
            raise RuntimeError(f"{request.__name__} is not a registered request (decorate it with wire.messages.op)")

        parse = request.from_wire

        def run(conn: Connection, raw: dict[str, Any]) -> dict[str, Any] | None:
            if body and conn is not None:
                conn.expect_body()
            reply = handler(conn, parse(raw))
            return None if reply is None else reply.to_wire()
        self._handlers[request.OP] = run

    def handler(self, op: str) -> Handler | None:
        """The handler of ``op``, for requests that arrive by another channel (the shim's pipes)."""
        return self._handlers.get(op)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                while len(self._pending) >= self._max_handshakes:  # evict the oldest, never refuse the new
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    self.handshakes_dropped += 1
                    shutdown_socket(oldest)
                self._pending[sock] = time.monotonic()
                self._conns.add(sock)
                t = threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                                     name="steward-conn", daemon=True)
                self._threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        slot = False
        sock.settimeout(self._timeout)
        conn = Connection(sock, self._max_message, peer, server_side=True)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ok = self._authenticate(conn)
            with self._lock:
                evicted = self._pending.pop(sock, None) is None
            if not ok or evicted or self._closed:
                return
            if not self._slots.acquire(timeout=self._timeout):
                conn.send({"ok": False, "error": AgentUnavailableError(
                    "the agent already serves its maximum number of connections; retry later").to_wire()})
                return
            slot = True
            while not self._closed:
                try:
                    req = conn.recv()
                except ProtocolError as exc:
                    if isinstance(exc, AuthenticationError):
                        log.warning("closing the connection from %s: %s", peer, exc)
                    return  # peer went away between requests, or sent a frame that does not verify
                if not self._dispatch(conn, req):
                    return
        except (OSError, StewardError) as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        finally:
            with self._lock:
                self._pending.pop(sock, None)
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())
            conn.close()
            if slot:
                self._slots.release()

    def _authenticate(self, conn: Connection) -> bool:
        try:
            conn.answer_handshake(self._secret, self._handshake_timeout)
            with self._lock:
                self.handshakes += 1
        except StewardError as exc:  # before OSError: AuthenticationError is a PermissionError too
            self._refuse(conn, exc)
            return False
        except OSError as exc:  # too slow, evicted, or gone
            log.debug("handshake with %s dropped: %s", conn.peer, exc)
            return False
        return True

    def _refuse(self, conn: Connection, exc: StewardError) -> None:
        if isinstance(exc, AuthenticationError):
            self.auth_failures += 1
        log.warning("refused connection from %s: %s", conn.peer, exc)
        with contextlib.suppress(OSError):
            conn.send({"ok": False, "error": exc.to_wire()})

    def _dispatch(self, conn: Connection, req: dict[str, Any]) -> bool:
        """Run one request; return False if the connection must close."""
        op = req.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is not None and isinstance(op, str):
            with self._lock:
                self.requests[op] += 1
        conn.unread_body = False
        try:
            if handler is None:
                raise ProtocolError(f"unknown request op {op!r}; known: {', '.join(sorted(self._handlers))}")
            reply = handler(conn, req)
        except StewardError as exc:
            if conn.broken:  # the stream in is untrusted; still say why on the way out, then close
                if isinstance(exc, AuthenticationError):
                    with contextlib.suppress(OSError):
                        conn.send({"ok": False, "error": exc.to_wire()})
                return False
            conn.send({"ok": False, "error": exc.to_wire()})
            return not isinstance(exc, ProtocolError) and not conn.unread_body
        except Exception as exc:  # a bug in a handler must not take the agent down
            log.exception("request %r from %s failed", op, conn.peer)
            if conn.broken:
                return False
            conn.send({"ok": False, "error": {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}})
            return not conn.unread_body
        if reply is not None:
            try:
                conn.send({"ok": True, **reply})
            except MessageTooLargeError as exc:
                conn.send({"ok": False, "error": MessageTooLargeError(
                    f"the reply to {op} was not sent: {exc}. Ask for less (a smaller limit; list and "
                    f"events replies page with a cursor) or raise the setting").to_wire()})
        return True

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        shutdown_socket(self._sock)
        self._sock.close()
        with self._lock:
            for s in list(self._conns):
                shutdown_socket(s)
            threads = list(self._threads)
        self._thread.join(timeout=5)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=5)

    def __enter__(self) -> AgentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

