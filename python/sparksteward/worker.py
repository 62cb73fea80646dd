"""Inside Python workers: the connection to this executor's agent, and the worker's heap.

Workers find their agent through the rendezvous file under ``SparkFiles.getRootDirectory()`` (its parent
in a Spark Connect session's task, whose files dir is the session's own). The
connection is cached per process (PySpark forks workers from a daemon, so the cache is keyed by pid).

:func:`settle_heap`: PySpark's daemon runs a full ``gc.collect()`` after every task of a reused worker,
and a task that allocates much runs more on its own. Each one walks every object the worker holds:
about 85k once pandas, pyarrow and our modules are imported, 13-17 ms a collection in a forked child
(it also writes to every page it walks, so the child copies the daemon's pages). Our daemon freezes
its objects before it forks (:mod:`sparksteward.daemon`), and a keyed-state task freezes those its
worker imported, once per worker; a collection then walks only what tasks made since (0.3-0.6 ms).
Frozen objects are still freed when their last reference goes; only reference cycles among them are
never collected.
"""

from __future__ import annotations

import gc
import os
import re
import threading

from sparksteward.rendezvous import Rendezvous
from sparksteward.wire import Connection

__all__ = ["agent_secret", "executor_connection", "settle_heap"]

_lock = threading.Lock()
_cached: tuple[int, Connection] | None = None
_settled: int | None = None   # the pid that froze its heap


def settle_heap() -> None:
    """Once per worker process: move the objects alive now (the modules its first task imported)
    out of the cyclic garbage collector's walks (``gc.freeze``)."""
    global _settled
    if _settled != os.getpid():
        _settled = os.getpid()
        gc.freeze()


def executor_connection(root: str | None = None) -> Connection:
    """Return this process's authenticated connection to its executor agent."""
    global _cached
    with _lock:
        if _cached is not None and _cached[0] == os.getpid():
            if not _cached[1].is_stale():
                return _cached[1]
            _cached[1].close()  # the agent dropped it while idle, or a stream broke: connect again
        rec = Rendezvous(agent_root(root)).read()
        timeout = rec.get("timeout")
        conn = Connection.connect(str(rec["endpoint"]), str(rec["secret"]),
                                  timeout=float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 120.0)
        _cached = (os.getpid(), conn)
        return conn


_SESSION_DIR = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def agent_root(root: str | None = None) -> str:
    """The directory of this executor's rendezvous: ``SparkFiles.getRootDirectory()``, or its parent when
    that is a Spark Connect session's own files dir (``<root>/<session uuid>``: Connect isolates each
    session's files, while the agent publishes in the executor's root)."""
    if root is None:
        from pyspark import SparkFiles

        root = SparkFiles.getRootDirectory()
    root = root.rstrip("/") or "/"
    if _SESSION_DIR.fullmatch(os.path.basename(root)) and not os.path.exists(Rendezvous(root).path):
        return os.path.dirname(root)
    return root


def agent_secret() -> str:
    """The application's secret from this executor's rendezvous (the agent's, waited for): what a Spark
    Connect client authenticates with (decision 0030)."""
    return str(Rendezvous(agent_root()).read()["secret"])
