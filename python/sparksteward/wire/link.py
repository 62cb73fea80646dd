"""AgentLink: the reused, authenticated connections from one process to one agent (an executor agent
to the driver agent), instead of a new handshake for every message.

A request takes an idle connection from the link's pool, or opens one; after the reply the connection
goes back to the pool. Several threads may send at once (each on its own connection), so the pool
holds as many as were in use together, up to ``max_pooled`` (each idle one holds a connection slot
of the agent: ``spark.steward.rpc.max-connections``). A connection idle for longer than ``max_idle``
(well under the server's idle timeout), or one the peer closed or that broke, is never reused: it is
closed and replaced, and idle ones past ``max_idle`` are closed whenever the link is used. So a request is never sent on a connection the server is closing,
and none is sent twice: a request whose connection breaks mid-way raises, except for ops the caller
declares safe to repeat (``retry=True``), which are sent once more on a new connection.

Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sparksteward.errors import StewardError
from sparksteward.wire.connection import Connection
from sparksteward.wire.messages import OPS, Message, read_reply

__all__ = ["AgentLink"]

T = TypeVar("T")


class AgentLink:
    """Pooled connections to the agent at ``endpoint``; see the module docstring."""

    def __init__(self, endpoint: str, secret: str, *, timeout: float = 120.0, max_idle: float = 30.0,
                 max_pooled: int = 4) -> None:
        self.endpoint = endpoint
        self._secret = secret
        self._timeout = timeout
        self._max_idle = max_idle
        self._max_pooled = max_pooled
        self._lock = threading.Lock()
        self._idle: list[tuple[Connection, float]] = []   # most recently used last
        self._closed = False
        self.handshakes = 0   # connections opened (each one handshake)

    def _take(self) -> tuple[Connection, bool]:
        """An idle connection that can be used (and True), or a new one (and False)."""
        stale = []
        conn = None
        with self._lock:
            while self._idle:
                c, used = self._idle.pop()
                if time.monotonic() - used < self._max_idle and not c.is_stale():
                    conn = c
                    break
                stale.append(c)
            if conn is None:
                self.handshakes += 1
        for c in stale:
            c.close()
        if conn is not None:
            return conn, True
        return Connection.connect(self.endpoint, self._secret, timeout=self._timeout), False

    def _give_back(self, conn: Connection) -> None:
        """Pool ``conn`` again; close the pooled connections idle past ``max_idle`` (each holds one of
        the agent's connection slots)."""
        now = time.monotonic()
        with self._lock:
            close = [c for c, used in self._idle if now - used >= self._max_idle]
            self._idle = [(c, used) for c, used in self._idle if now - used < self._max_idle]
            if not self._closed and not conn.broken and len(self._idle) < self._max_pooled:
                self._idle.append((conn, now))
            else:
                close.append(conn)
        for c in close:
            c.close()

    def request(self, op: str, *, retry: bool = False, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply; an error reply raises the matching StewardError.
        ``retry``: ``op`` may be applied twice, so a connection that breaks before the reply is
        replaced and the request sent once more. ``timeout``: this round trip's socket timeout."""
        return self.run(lambda conn: conn.call(op, fields, timeout), retry=retry)

    def run(self, exchange: Callable[[Connection], T], *, retry: bool = False) -> T:
        """Run ``exchange(conn)`` on a pooled connection and return what it returns: for an op whose
        body the caller sends or reads itself. ``exchange`` marks the connection broken if it leaves it
        mid-body (``conn.broken = True``); a broken connection is closed, never pooled. ``retry``: as
        for :meth:`request` (a reused connection that breaks is replaced and ``exchange`` run once more)."""
        for attempt in (1, 2):
            conn, reused = self._take()
            try:
                reply = exchange(conn)
            except (OSError, StewardError):
                if not conn.broken:   # the agent's answer (an error reply): the connection is fine
                    self._give_back(conn)
                    raise
                conn.close()
                if not (retry and reused and attempt == 1):
                    raise
                continue
            except BaseException:
                conn.close()   # interrupted (or a bug) at an unknown point of the exchange
                raise
            self._give_back(conn)
            return reply
        raise AssertionError("unreachable")

    def ask(self, request: Message, *, timeout: float | None = None) -> Any:
        """Send a typed request and return its op's typed reply; a connection that breaks before the
        reply is replaced and the request sent once more only for an op registered as repeatable."""
        name = type(request).OP
        return read_reply(request, self.request(name, retry=OPS[name].repeatable, timeout=timeout,
                                                **request.to_wire()))

    def close(self) -> None:
        """Close the idle connections; the ones in use are closed when their request ends. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()
