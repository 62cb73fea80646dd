"""Drops finished jobs' blobs from an executor's BlobCache.

The BlobServer deletes a job's blobs when the job's cleanup runs (``delete_job``), but the copies that
executors cached live in other processes, often on other hosts. Each executor agent runs one
:class:`CacheJobSweeper`: every ``interval`` seconds, if its cache holds blobs of any job, it asks the
driver's BlobServer which of those jobs were deleted (``blob.deleted_jobs``, one small request on a
pooled connection of an :class:`~sparksteward.wire.link.AgentLink`) and drops their copies (:meth:`BlobCache.drop_job`, which keeps copies a running
task still references).

Thread-safety: one daemon thread; :meth:`sweep_once` may also be called directly. ``close`` is
idempotent and joins the thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sparksteward.blob.messages import BlobDeletedJobsRequest
from sparksteward.errors import ProtocolError, StewardError
from sparksteward.wire.link import AgentLink

__all__ = ["CacheJobSweeper"]

log = logging.getLogger("sparksteward.blob.job_sweeper")


class CacheJobSweeper:
    """See the module docstring. A context manager."""

    def __init__(self, cache: Any, endpoint: str, secret: str, *, interval: float = 1.0, start: bool = True,
                 timeout: float = 30.0) -> None:
        if interval <= 0:
            raise ValueError(f"the cache sweep interval must be positive, not {interval!r}")
        self.cache = cache
        self.endpoint = endpoint
        self._secret = secret
        self._timeout = timeout
        self.interval = interval
        self._link = AgentLink(endpoint, secret, timeout=timeout, max_pooled=1)
        self._lock = threading.Lock()  # one sweep at a time, on one connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steward-cache-sweeper", daemon=True)
        if start:
            self._thread.start()

    def sweep_once(self) -> list[str | None]:
        """Drop the cached blobs of every job the server deleted; return those jobs."""
        with self._lock:
            jobs = sorted(self.cache.job_ids(), key=lambda j: (j is not None, j or ""))
            if not jobs or self._stop.is_set():
                return []
            deleted = self._link.ask(BlobDeletedJobsRequest(jobs)).deleted
        for job_id in deleted:
            n = self.cache.drop_job(job_id)
            if n:
                log.info("job %s is finished: dropped %d cached blob(s)", job_id, n)
        return list(deleted)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
                failures = 0
            except ProtocolError as exc:
                log.warning("the BlobServer at %s cannot say which jobs finished (%s); finished jobs' blobs "
                            "leave this cache only by LRU eviction", self.endpoint, exc)
                return
            except (StewardError, OSError, KeyError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("cannot ask the BlobServer at %s which jobs finished: %s (will retry)",
                                self.endpoint, exc)

    def close(self) -> None:
        """Stop the thread and close the connection. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._link.close()

    def __enter__(self) -> CacheJobSweeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
