"""Inside Python workers: the connection to this executor's agent.

Workers find their agent through the rendezvous file under ``SparkFiles.getRootDirectory()``. The
connection is cached per process (PySpark forks workers from a daemon, so the cache is keyed by pid).
"""

from __future__ import annotations

import os
import threading

from sparksteward.rendezvous import Rendezvous
from sparksteward.wire import Connection

__all__ = ["executor_connection"]

_lock = threading.Lock()
_cached: tuple[int, Connection] | None = None


def executor_connection(root: str | None = None) -> Connection:
    """Return this process's authenticated connection to its executor agent."""
    global _cached
    with _lock:
        if _cached is not None and _cached[0] == os.getpid():
            if not _cached[1].is_stale():
                return _cached[1]
            _cached[1].close()  # the agent dropped it while idle, or a stream broke: connect again
        if root is None:
            from pyspark import SparkFiles

            root = SparkFiles.getRootDirectory()
        rec = Rendezvous(root).read()
        timeout = rec.get("timeout")
        conn = Connection.connect(str(rec["endpoint"]), str(rec["secret"]),
                                  timeout=float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 120.0)
        _cached = (os.getpid(), conn)
        return conn
