"""Authenticated, size-bounded sockets between clients and agents (wire version 2).

- :mod:`~sparksteward.wire.connection`: :class:`Connection` (the handshake, frame and body MACs and
  the bounds are described there) and :class:`RawReader`;
- :mod:`~sparksteward.wire.server`: :class:`AgentServer`, which authenticates and dispatches;
- :mod:`~sparksteward.wire.fields`: :class:`Fields`, typed access to a request's fields.
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
from sparksteward.wire.server import AgentServer, Handler

__all__ = ["AgentServer", "BODY_MACS", "Connection", "Fields", "Handler", "PRE_AUTH_LIMIT", "RawReader",
           "TAG_SIZE", "new_secret", "parse_endpoint"]
