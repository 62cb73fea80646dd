"""Broadcast handles: ``h = st.broadcast(obj)``, then ``h.value`` in tasks and on the driver.

A handle pickles to its key, job and size only (well under 1 KB in a closure). In a Python worker,
``h.value`` asks the executor agent to open the blob for the running task attempt (fetching it into
the executor's cache once) and loads it with :func:`~sparksteward.blob.payload.load_payload`: numpy
and arrow buffers are views of a read-only memory map of the cached file, shared by every worker of
the executor. A worker keeps at most :data:`MAX_LOADED` loaded values (and :data:`MAX_LOADED_BYTES`
of payload), least recently used first out: a dropped value's memory map is closed as soon as user
code holds no view of it, so a file the executor cache evicted frees its disk blocks instead of
staying mapped for the worker's lifetime. On the driver, ``h.value`` is the object itself. The blob is released by ``destroy()``, when the handle is garbage-collected on the driver,
or when its job ends (its job directory is deleted).
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import Any

__all__ = ["MAX_LOADED", "MAX_LOADED_BYTES", "BroadcastHandle"]

#: Loaded broadcast values a worker keeps (each a view of a memory-mapped cache file).
MAX_LOADED = 8
#: Total payload bytes a worker keeps mapped; the most recent value is kept whatever its size.
MAX_LOADED_BYTES = 4 << 30
_MAX_OPENED = 4096

_loaded: collections.OrderedDict[tuple[str | None, str], tuple[Any, int]] = collections.OrderedDict()
_opened: collections.OrderedDict[tuple[int | None, str], None] = collections.OrderedDict()  # (task, key)
_lock = threading.Lock()


def _shrink() -> None:
    """Drop least recently used values beyond the bounds (their maps close once unreferenced)."""
    total = sum(size for _, size in _loaded.values())
    while len(_loaded) > 1 and (len(_loaded) > MAX_LOADED or total > MAX_LOADED_BYTES):
        _, (_, size) = _loaded.popitem(last=False)
        total -= size
    while len(_opened) > _MAX_OPENED:
        _opened.popitem(last=False)


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

    from sparksteward.blob.key import BlobKey
    from sparksteward.blob.messages import BlobOpenRequest
    from sparksteward.blob.payload import load_payload
    from sparksteward.wire.messages import ask
    from sparksteward.worker import executor_connection

    tc = TaskContext.get()
    tid = tc.taskAttemptId() if tc is not None else None
    ref = (job_id, key)
    with _lock:
        if (tid, key) not in _opened or ref not in _loaded:
            # registers the task attempt's reference (the cache never evicts it while the task runs)
            path = ask(executor_connection(), BlobOpenRequest(BlobKey.parse(key), job_id, tid)).path
            _opened[(tid, key)] = None
            if ref not in _loaded:
                _loaded[ref] = (load_payload(path), _file_size(path))
        _loaded.move_to_end(ref)
        _opened.move_to_end((tid, key))
        value = _loaded[ref][0]
        _shrink()
        return value


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
