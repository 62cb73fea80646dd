"""The JobResultStore (FLIP-194): durable job results, dirty until their cleanup commits.

This module holds the contract, read and write sides apart (:class:`JobResultView`,
:class:`JobResultWriter`, both: :class:`JobResultStore`), what the implementations share
(:class:`StoreBase`) and the in-memory store (:func:`~sparksteward.jobs.fs_store.open_store` picks one). Two implementations share one
contract (``tests/jobs/test_contract.py``):

- :class:`InMemoryJobResultStore`, for tests and ``spark.steward.jrs.storage-path=memory``;
- :class:`~sparksteward.jobs.fs_store.FileSystemJobResultStore`, on any fsspec URL (its module
  describes the file layout).

Runs. Each run of a job id has a ``run_id`` stored in its record. ``update_dirty`` and ``mark_clean``
are compare-and-swap on it (:mod:`sparksteward.jobs.lease` says how a local store locks and how an
object store writes conditionally). A write for another run raises
:class:`~sparksteward.errors.RunConflictError`. A commit never replaces a clean file: if a clean
entry is already there, the dirty one is deleted instead. A live run holds a lease (:meth:`lease`,
a :class:`~sparksteward.jobs.lease.Lease`); recovery skips leased jobs (:meth:`is_leased`). Object
stores report no leases.

Thread-safety: every store serializes its operations with a re-entrant lock, so calls may come from
any thread. They do block on I/O: callers that must stay responsive (the driver agent, FLINK-27204)
call them from their own worker threads, as :class:`~sparksteward.jobs.service.JobService` does.
"""

from __future__ import annotations

import builtins
import logging
import threading
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from sparksteward.errors import (
    InvalidRecordError,
    JobResultExistsError,
    JobResultNotFoundError,
    JobStoreError,
    RunConflictError,
)
from sparksteward.ids import MAX_STEM_BYTES, job_id_to_filename, validate_id
from sparksteward.jobs.lease import Lease
from sparksteward.jobs.result import JobResult, JobResultEntry, JobStatus

__all__ = ["InMemoryJobResultStore", "JobResultStore", "JobResultView", "JobResultWriter", "Listing", "MAX_STEM_BYTES",
           "StoreBase", "job_file_stem"]

log = logging.getLogger("sparksteward.jobs.store")

DIRTY_SUFFIX = "_DIRTY.json"
CLEAN_SUFFIX = ".json"


def job_file_stem(job_id: str) -> str:
    """The file-name stem of ``job_id`` (at most :data:`MAX_STEM_BYTES` bytes); rejects unsafe ids."""
    return job_id_to_filename(job_id)


@dataclass(frozen=True)
class Listing:
    """What a store holds.

    Attributes
    ----------
    entries
        Readable entries, sorted by job id (one per job; a clean file wins over a stale dirty one).
    corrupt
        ``(file, reason)`` for every file that could not be read as a job result; one bad file never
        fails the whole listing.
    stale
        Job ids that have a clean file and a leftover dirty file (an interrupted commit); recovery,
        ``mark_clean`` and ``prune`` delete the dirty file.
    """

    entries: tuple[JobResultEntry, ...] = ()
    corrupt: tuple[tuple[str, str], ...] = ()
    stale: tuple[str, ...] = ()


@runtime_checkable
class JobResultView(Protocol):
    """The read side of a JobResultStore."""

    cluster_id: str

    def get(self, job_id: str) -> JobResultEntry | None:
        """The entry of ``job_id`` (clean if both files exist), or None. Corrupt file: CorruptRecordError."""
        ...

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        """Entries matching every given filter (``state`` is ``dirty`` or ``clean``)."""
        ...

    def dirty_entries(self) -> builtins.list[JobResultEntry]:
        """Every dirty entry: the results whose cleanup has not committed."""
        ...

    def is_leased(self, job_id: str) -> bool:
        """True if a live run holds ``job_id``'s lease."""
        ...


@runtime_checkable
class JobResultWriter(Protocol):
    """The write side of a JobResultStore."""

    delete_on_commit: bool

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        """Store ``result`` as dirty; JobResultExistsError if the job has any entry."""
        ...

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        """Replace the dirty entry of ``result.run_id``; RunConflictError if another run's; JobResultNotFoundError
        unless it is dirty."""
        ...

    def mark_clean(self, job_id: str, run_id: str | None = None) -> JobResultEntry | None:
        """Commit (for ``run_id`` only, if given); no-op when already clean; None with delete-on-commit;
        JobResultNotFoundError if missing; RunConflictError if the dirty entry is another run's."""
        ...

    def delete(self, job_id: str) -> bool:
        """Remove every file of ``job_id``; False if there was none."""
        ...

    def prune(self, older_than: float, now: float) -> list[str]:
        """Delete clean entries that ended more than ``older_than`` seconds before ``now``, and stale dirty files."""
        ...

    def quarantine(self, name: str) -> list[str]:
        """Move a file (by name) or a job's files aside; return where they went."""
        ...

    def lease(self, job_id: str, run_id: str) -> Lease:
        """Hold ``job_id`` for a live run; JobStoreError if another live run holds it."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class JobResultStore(JobResultView, JobResultWriter, Protocol):
    """A JobResultStore: both sides."""


_Store = TypeVar("_Store", bound="StoreBase")

class StoreBase:
    """What both stores share: filters, pruning, run checks, the context-manager protocol."""

    cluster_id: str
    delete_on_commit: bool
    _lock: threading.RLock

    @staticmethod
    def _status_filter(status: JobStatus | str | None) -> JobStatus | None:
        return None if status is None else JobStatus.parse(status)

    @staticmethod
    def _matches(entry: JobResultEntry, state: str | None, status: JobStatus | None,
                 ended_before: float | None) -> bool:
        return ((state is None or entry.state == state) and (status is None or entry.status is status)
                and (ended_before is None or entry.result.end_time < ended_before))

    @staticmethod
    def _check_state(state: str | None) -> None:
        if state not in (None, "dirty", "clean"):
            raise InvalidRecordError(f"state filter {state!r} is not 'dirty' or 'clean'")

    @staticmethod
    def _exists_error(job_id: str, entry: JobResultEntry) -> JobResultExistsError:
        return JobResultExistsError(f"job {job_id!r} already has a {entry.state} result ({entry.status.value}) at "
                                    f"{entry.source}; delete it first to store a new one")

    @staticmethod
    def _conflict(job_id: str, what: str, mine: str | None, theirs: str | None, where: str) -> RunConflictError:
        return RunConflictError(f"job {job_id!r}: refusing to {what} for run {mine!r}: {where} belongs to run "
                                f"{theirs!r} (a newer, forced run of the same job id replaced it). Nothing was "
                                f"written")

    @staticmethod
    def _same_run(stored: JobResult, run_id: str | None) -> bool:
        return run_id is None or stored.run_id is None or stored.run_id == run_id

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        raise NotImplementedError

    def _delete_clean(self, job_id: str) -> bool:
        raise NotImplementedError

    def _delete_stale(self, job_id: str) -> bool:
        return False

    def _check_cluster(self, result: JobResult) -> None:
        if result.cluster_id != self.cluster_id:
            raise InvalidRecordError(f"job result {result.job_id!r} belongs to cluster {result.cluster_id!r}, but "
                                     f"this store holds cluster {self.cluster_id!r}")

    def dirty_entries(self) -> builtins.list[JobResultEntry]:
        return list(self.list(state="dirty").entries)

    def prune(self, older_than: float, now: float) -> builtins.list[str]:
        """Delete clean entries whose end time is more than ``older_than`` seconds before ``now``, and
        every stale dirty file lying next to a clean one.

        Dirty entries are never pruned: their cleanup has not finished.
        """
        if older_than < 0:
            raise InvalidRecordError(f"prune: older_than must be >= 0 seconds, not {older_than!r}")
        with self._lock:
            listing = self.list(state="clean", ended_before=now - older_than)
            for job_id in listing.stale:
                if self._delete_stale(job_id):
                    log.info("job %s: deleted a stale dirty file next to its committed result", job_id)
            pruned = [e.job_id for e in listing.entries if self._delete_clean(e.job_id)]
        if pruned:
            log.info("pruned %d clean job results that ended more than %.0f s ago", len(pruned), older_than)
        return pruned

    def close(self) -> None:
        """Nothing to release (file systems are shared fsspec instances); idempotent."""

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InMemoryJobResultStore(StoreBase):
    """A JobResultStore in this process's memory; results are lost with the process.

    Parameters
    ----------
    cluster_id
        The namespace of the stored results.
    delete_on_commit
        Forget a result when it commits instead of keeping it clean.
    """

    def __init__(self, cluster_id: str = "default", delete_on_commit: bool = False) -> None:
        self.cluster_id = validate_id(cluster_id, "cluster id")
        self.delete_on_commit = delete_on_commit
        self.url = "memory"
        self._entries: dict[str, JobResultEntry] = {}
        self._leases: dict[str, str] = {}
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"InMemoryJobResultStore(cluster_id={self.cluster_id!r})"

    def _source(self, job_id: str, clean: bool) -> str:
        return f"memory://{self.cluster_id}/{job_file_stem(job_id)}{CLEAN_SUFFIX if clean else DIRTY_SUFFIX}"

    def get(self, job_id: str) -> JobResultEntry | None:
        job_file_stem(job_id)
        with self._lock:
            return self._entries.get(job_id)

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        self._check_state(state)
        want = self._status_filter(status)
        with self._lock:
            entries = [e for e in self._entries.values() if self._matches(e, state, want, ended_before)]
        return Listing(tuple(sorted(entries, key=lambda e: e.job_id)))

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        self._check_cluster(result)
        source = self._source(result.job_id, False)
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is not None:
                raise self._exists_error(result.job_id, existing)
            entry = self._entries[result.job_id] = JobResultEntry(result, False, source)
            return entry

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        self._check_cluster(result)
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is None or existing.clean:
                raise JobResultNotFoundError(f"job {result.job_id!r} has no dirty result to update "
                                             f"({'it is already clean' if existing else 'there is none'})")
            if not self._same_run(existing.result, result.run_id):
                raise self._conflict(result.job_id, "update the dirty result", result.run_id, existing.result.run_id,
                                existing.source)
            entry = self._entries[result.job_id] = JobResultEntry(result, False, existing.source)
            return entry

    def mark_clean(self, job_id: str, run_id: str | None = None) -> JobResultEntry | None:
        job_file_stem(job_id)
        with self._lock:
            existing = self._entries.get(job_id)
            if existing is None:
                raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean in {self!r}")
            if not self._same_run(existing.result, run_id):
                raise self._conflict(job_id, "commit", run_id, existing.result.run_id, existing.source)
            if existing.clean:
                return existing
            if self.delete_on_commit:
                del self._entries[job_id]
                return None
            entry = self._entries[job_id] = JobResultEntry(existing.result, True, self._source(job_id, True))
            return entry

    def delete(self, job_id: str) -> bool:
        job_file_stem(job_id)
        with self._lock:
            return self._entries.pop(job_id, None) is not None

    def _delete_clean(self, job_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is None or not entry.clean:
                return False
            del self._entries[job_id]
            return True

    def quarantine(self, name: str) -> builtins.list[str]:
        raise JobResultNotFoundError(f"{name!r}: an in-memory store has no files to quarantine")

    def lease(self, job_id: str, run_id: str) -> Lease:
        job_file_stem(job_id)
        with self._lock:
            holder = self._leases.get(job_id)
            if holder is not None:
                raise JobStoreError(f"job {job_id!r} is running (run {holder!r}); a job id runs once at a time")
            self._leases[job_id] = run_id

        def release() -> None:
            with self._lock:
                if self._leases.get(job_id) == run_id:
                    del self._leases[job_id]

        return Lease(job_id, release)

    def is_leased(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._leases
