"""Broadcast handles: ``h = st.broadcast(obj)``, then ``h.value`` in tasks and on the driver.

A handle pickles to its key, job and size only (well under 1 KB in a closure). In a Python worker,
``h.value`` asks the executor agent to open the blob for the running task attempt (fetching it into
the executor's cache once) and loads it with :func:`~sparksteward.blob.payload.load_payload`: numpy
and arrow buffers are views of a read-only memory map of the cached file, shared by every worker of
the executor. The loaded value is kept per worker process. On the driver, ``h.value`` is the object
itself. The blob is released by ``destroy()``, when the handle is garbage-collected on the driver,
or when its job ends (its job directory is deleted).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["BroadcastHandle"]

_loaded: dict[tuple[str | None, str], Any] = {}
_opened: set[tuple[int, str]] = set()
_lock = threading.Lock()


def _restore(key: str, job_id: str | None, size: int) -> BroadcastHandle:
    return BroadcastHandle(key, job_id, size)


class BroadcastHandle:
    """A content-addressed broadcast. See the module docstring."""

    __slots__ = ("key", "job_id", "size", "_value", "_local", "_finalizer", "__weakref__")

    def __init__(self, key: str, job_id: str | None, size: int, value: Any = None, local: bool = False,
                 release: Any = None) -> None:
        self.key, self.job_id, self.size = key, job_id, size
        self._value, self._local = value, local
        self._finalizer = weakref.finalize(self, release) if release is not None else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self.key, self.job_id, self.size))

    def __repr__(self) -> str:
        return f"BroadcastHandle(key={self.key!r}, job_id={self.job_id!r}, size={self.size})"

    @property
    def value(self) -> Any:
        """The broadcast object (zero-copy for protocol-5 buffers in workers)."""
        if self._local:
            return self._value
        return _worker_value(self.key, self.job_id)

    def destroy(self) -> None:
        """Release the blob now (idempotent); staged cleanup deletes it after the retention interval."""
        self._value, self._local = None, False
        if self._finalizer is not None:
            self._finalizer()


def _worker_value(key: str, job_id: str | None) -> Any:
    from pyspark import TaskContext

    from sparksteward.blob.payload import load_payload
    from sparksteward.worker import executor_connection

    tc = TaskContext.get()
    tid = tc.taskAttemptId() if tc is not None else None
    with _lock:
        need_open = (tid, key) not in _opened or (job_id, key) not in _loaded
        if need_open:
            reply = executor_connection().request("blob.open", key=key, job_id=job_id, task_attempt_id=tid)
            _opened.add((tid, key))
            if (job_id, key) not in _loaded:
                _loaded[(job_id, key)] = load_payload(reply["path"])
        return _loaded[(job_id, key)]
