"""ResultDelivery: gets the results a :class:`~sparksteward.jobs.service.JobService` finishes into the
store, through store outages.

:meth:`~ResultDelivery.store_dirty` writes a result dirty, retrying a failing store (``StorageError``,
``OSError``) under the cleanup retry policy for at most the time it is given, and ending early when
the service stops. If the store still fails, the result is spooled locally (see
:mod:`sparksteward.jobs.spool`) and returned dirty with the spool file as its source; without a
spool, :class:`~sparksteward.errors.JobStoreError` is raised. A write whose reply was lost (the
entry is there, with this run's id) counts as done. An entry of a run that a forced run replaced,
committed late by that run's cleanup (possible on object stores, where a commit and the forced delete
do not share a lock), is deleted again, up to :data:`LATE_COMMITS` times.

:meth:`~ResultDelivery.flush` writes the spooled results to the store (the next JobService on this
host does it first thing in ``recover``); a result whose job already has another run's entry is
dropped, one the store still refuses stays spooled. :meth:`~ResultDelivery.spooled` finds a job's
spooled results (``begin`` refuses the job, or a forced run drops them).

Thread-safety: it holds no lock and no state of its own, and the store and the spool may be used from
any thread, so every method may be called from any thread. The service calls it without holding its
own lock.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any

from sparksteward.errors import CorruptRecordError, JobResultExistsError, JobStoreError, StewardError, StorageError
from sparksteward.jobs.cleanup import CleanupRunner
from sparksteward.jobs.result import JobResult, JobResultEntry
from sparksteward.jobs.spool import ResultSpool

__all__ = ["ResultDelivery"]

log = logging.getLogger("sparksteward.jobs.delivery")

LATE_COMMITS = 3
"""How many times :meth:`ResultDelivery.store_dirty` deletes a replaced run's late commit before giving up."""


class ResultDelivery:
    """Stores the results of one job service, retrying, else spooling them.

    Parameters
    ----------
    store
        The JobResultStore.
    runner
        The service's cleanup runner: its retry policy, clock and ``wait`` (which ends when the
        service stops).
    spool
        Where results the store would not take are kept (None: nowhere; :meth:`store_dirty` raises).
    cluster_id
        The results' cluster id; :meth:`flush` leaves spooled results of other clusters alone.
    """

    def __init__(self, store: Any, runner: CleanupRunner, spool: ResultSpool | None, cluster_id: str) -> None:
        self.store = store
        self.runner = runner
        self.spool = spool
        self.cluster_id = cluster_id

    def __repr__(self) -> str:
        return f"ResultDelivery({self.store!r}, spool={self.spool!r})"

    def store_dirty(self, result: JobResult, replaced: Set[str | None] = frozenset(), *,
                    within: float) -> tuple[JobResultEntry, bool]:
        """Write ``result`` dirty, retrying store failures under the retry policy for at most ``within``
        seconds, then spool it. Returns ``(entry, spooled)``. ``replaced``: the run ids a forced run
        superseded, whose late commits are deleted again (see the module docstring)."""
        policy = self.runner.policy
        clock = self.runner.clock
        deadline = clock.now() + within
        failures = 0
        late_commits = 0
        while True:
            try:
                return self.store.create_dirty(result), False
            except JobResultExistsError:
                mine = self._own_entry(result)  # an earlier attempt got through, but its reply did not
                if mine is not None:
                    return mine, False
                try:
                    existing = self.store.get(result.job_id)
                except StewardError:
                    existing = None
                if existing is None or existing.result.run_id not in replaced or late_commits >= LATE_COMMITS:
                    raise
                late_commits += 1
                log.warning("job %s: run %s, which this forced run replaced, committed late (%s); deleting it again",
                            result.job_id, existing.result.run_id, existing.source)
                self.store.delete(result.job_id)
            except CorruptRecordError:
                raise
            except (StorageError, OSError) as exc:
                failures += 1
                left = deadline - clock.now()
                if policy.exhausted(failures) or left <= 0 or self.runner.stop.is_set():
                    return self._spool(result, exc, failures), True
                delay = min(policy.delay(failures), left)
                log.warning("job %s: could not store its result (attempt %d), retrying in %.3g s: %s",
                            result.job_id, failures, delay, exc)
                self.runner.wait(delay)

    def _own_entry(self, result: JobResult) -> JobResultEntry | None:
        try:
            entry = self.store.get(result.job_id)
        except StewardError:
            return None
        return entry if entry is not None and entry.result.run_id == result.run_id else None

    def _spool(self, result: JobResult, exc: BaseException, failures: int) -> JobResultEntry:
        if self.spool is None:
            raise JobStoreError(f"job {result.job_id!r}: could not store its result after {failures} attempts, and "
                                f"no spool dir is configured: {exc}") from exc
        try:
            path = self.spool.put(result)
        except StewardError as spool_exc:
            raise JobStoreError(f"job {result.job_id!r}: could not store its result ({exc}) nor spool it locally "
                                f"({spool_exc})") from spool_exc
        log.error("job %s: the store failed %d times (%s); result spooled to %s for the next driver", result.job_id,
                  failures, exc, path)
        return JobResultEntry(result, False, path)

    def spooled(self, job_id: str) -> list[tuple[str, JobResult]]:
        """``(path, result)`` of the readable spooled results of ``job_id``; none without a spool."""
        return [] if self.spool is None else self.spool.for_job(job_id)

    def drop_spooled(self, path: str) -> None:
        """Delete the spooled result in ``path``, one of :meth:`spooled` (a forced re-run replaces it)."""
        assert self.spool is not None  # spooled() is empty without a spool
        self.spool.remove(path)

    def flush(self) -> list[str]:
        """Write the spooled results to the store (dirty; recovery then runs their cleanup and commits).
        A result whose job already has another run's entry is dropped, with a warning. Returns the job
        ids written; a store that still fails leaves the files for later."""
        written: list[str] = []
        if self.spool is None:
            return written
        for path, result in self.spool.results():
            if isinstance(result, StewardError):
                log.error("unreadable spooled job result %s, left in place: %s", path, result)
                continue
            if result.cluster_id != self.cluster_id:
                continue
            try:
                self.store.create_dirty(result)
                written.append(result.job_id)
                log.info("job %s: stored the result spooled at %s", result.job_id, path)
            except JobResultExistsError:
                if self._own_entry(result) is None:
                    log.warning("job %s: the store holds another run's result; dropping the spooled result %s of "
                                "run %s", result.job_id, path, result.run_id)
            except StewardError as exc:
                log.warning("job %s: the store still fails, keeping its spooled result %s: %s", result.job_id, path,
                            exc)
                continue
            self.spool.remove(path)
        return written
