"""Authenticated, size-bounded sockets between clients and agents (wire version 2).

- :mod:`~sparksteward.wire.connection`: :class:`Connection` (frames and their MACs; the bounds are
  described there), with the handshake in :mod:`~sparksteward.wire.handshake` and body streams in
  :mod:`~sparksteward.wire.body` (:class:`RawReader`);
- :mod:`~sparksteward.wire.server`: :class:`AgentServer`, which authenticates and dispatches;
- :mod:`~sparksteward.wire.fields`: :class:`Fields`, typed access to a request's fields;
- :mod:`~sparksteward.wire.messages`: :class:`Message`, the typed requests and replies, and
  :data:`OPS`, the one registry of ops.
"""

from sparksteward.wire.connection import (
    BODY_MACS,
    PRE_AUTH_LIMIT,
    TAG_SIZE,
    Connection,
    RawReader,
    new_secret,
    parse_endpoint,
)
from sparksteward.wire.fields import Fields
from sparksteward.wire.messages import MAX_CHECKPOINT_ID, MAX_PARALLELISM, OPS, Message, Op, ask, op
from sparksteward.wire.server import AgentServer, Handler

__all__ = ["MAX_CHECKPOINT_ID", "MAX_PARALLELISM", "OPS", "AgentServer", "BODY_MACS", "Connection", "Fields", "Handler",
           "Message", "Op", "PRE_AUTH_LIMIT", "RawReader", "TAG_SIZE", "ask", "new_secret", "op", "parse_endpoint"]
