"""The JobResultStore (FLIP-194): durable job results, dirty until their cleanup commits.

Two implementations share one contract (``tests/test_jrs_contract.py``):

- :class:`InMemoryJobResultStore`, for tests and ``spark.steward.jrs.storage-path=memory``;
- :class:`FileSystemJobResultStore`, on any fsspec URL, laid out as::

      <path>/<cluster-id>/<job>_DIRTY.json   created once and never overwritten by a create;
                                             rewritten (stage, then rename) as cleanup steps progress
      <path>/<cluster-id>/<job>.json         after the commit (or deleted, with delete-on-commit)
      <path>/<cluster-id>/quarantine/        unreadable files moved aside by ``quarantine``

Job ids are encoded into file names reversibly (:func:`sparksteward.ids.job_id_to_filename`); ids that
could escape the directory, or whose encoded name is too long for a file system, are rejected with
:class:`~sparksteward.errors.InvalidIdError`. The base directory is created lazily by the first
write, and a missing directory lists as empty (FLINK-26494).

An object store's rename is a copy followed by a delete. If a commit dies between the two, both files
exist: the clean one wins everywhere (``get``, ``list``), the listing reports the job in
``Listing.stale``, and the next ``mark_clean`` (which recovery runs) removes the stale dirty file.

Unreadable files (partial, unparsable, unknown version) raise
:class:`~sparksteward.errors.CorruptRecordError` naming the file from ``get``; ``list`` reports them in
``Listing.corrupt`` and carries on, and ``quarantine`` moves them aside.

Thread-safety: every store serializes its operations with a re-entrant lock, so calls may come from
any thread. They do block on I/O: callers that must stay responsive (the driver agent, FLINK-27204)
call them from their own worker threads, as :class:`~sparksteward.jobs.service.JobService` does.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sparksteward.errors import (CorruptRecordError, InvalidIdError, InvalidRecordError, JobResultExistsError,
                                 JobResultNotFoundError, StorageError)
from sparksteward.ids import job_id_from_filename, job_id_to_filename, validate_id
from sparksteward.jobs.result import JobResult, JobResultEntry, JobStatus
from sparksteward.storage import Location, open_location

__all__ = ["FileSystemJobResultStore", "InMemoryJobResultStore", "JobResultStore", "JobResultView",
           "JobResultWriter", "Listing", "MAX_STEM_BYTES", "job_file_stem", "open_store"]

log = logging.getLogger("sparksteward.jobs.store")

DIRTY_SUFFIX = "_DIRTY.json"
CLEAN_SUFFIX = ".json"
QUARANTINE = "quarantine"
MAX_STEM_BYTES = 200
"""Longest encoded job id, in bytes: file names stay under the usual 255-byte limit with room for a
quarantine suffix."""


def job_file_stem(job_id: str) -> str:
    """The file-name stem of ``job_id``; rejects ids that are unsafe or encode too long."""
    stem = job_id_to_filename(job_id)
    if len(stem.encode()) > MAX_STEM_BYTES:
        raise InvalidIdError(f"job id {job_id[:40]!r}... is too long: it encodes to a {len(stem.encode())}-byte file "
                             f"name and the limit is {MAX_STEM_BYTES} (non-ASCII characters take 6 to 12 bytes "
                             f"each). Use a shorter id")
    return stem


@dataclass(frozen=True)
class Listing:
    """What a store holds.

    Attributes
    ----------
    entries
        Readable entries, sorted by job id (one per job; a clean file wins over a stale dirty one).
    corrupt
        ``(file, reason)`` for every file that could not be read as a job result.
    stale
        Job ids that have a clean file and a leftover dirty file (a commit interrupted on an object
        store); ``mark_clean`` removes the dirty file.
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

    def dirty_entries(self) -> list[JobResultEntry]:
        """Every dirty entry: the results whose cleanup has not committed."""
        ...


@runtime_checkable
class JobResultWriter(Protocol):
    """The write side of a JobResultStore."""

    delete_on_commit: bool

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        """Store ``result`` as dirty; JobResultExistsError if the job has any entry."""
        ...

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        """Replace a dirty entry (cleanup progress); JobResultNotFoundError unless it is dirty."""
        ...

    def mark_clean(self, job_id: str) -> JobResultEntry | None:
        """Commit; no-op when already clean; None with delete-on-commit; JobResultNotFoundError if missing."""
        ...

    def delete(self, job_id: str) -> bool:
        """Remove every file of ``job_id``; False if there was none."""
        ...

    def prune(self, older_than: float, now: float) -> list[str]:
        """Delete clean entries that ended more than ``older_than`` seconds before ``now``."""
        ...

    def quarantine(self, name: str) -> list[str]:
        """Move a file (by name) or a job's files aside; return where they went."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class JobResultStore(JobResultView, JobResultWriter, Protocol):
    """A JobResultStore: both sides."""


def _status_filter(status: JobStatus | str | None) -> JobStatus | None:
    return None if status is None else JobStatus.parse(status)


def _matches(entry: JobResultEntry, state: str | None, status: JobStatus | None, ended_before: float | None) -> bool:
    return ((state is None or entry.state == state) and (status is None or entry.status is status)
            and (ended_before is None or entry.result.end_time < ended_before))


def _check_state(state: str | None) -> None:
    if state not in (None, "dirty", "clean"):
        raise InvalidRecordError(f"state filter {state!r} is not 'dirty' or 'clean'")


def _exists_error(job_id: str, entry: JobResultEntry) -> JobResultExistsError:
    return JobResultExistsError(f"job {job_id!r} already has a {entry.state} result ({entry.status.value}) at "
                                f"{entry.source}; delete it first to store a new one")


class _StoreBase:
    """What both stores share: filters, pruning, the context-manager protocol."""

    cluster_id: str
    delete_on_commit: bool
    _lock: threading.RLock

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        raise NotImplementedError

    def _delete_clean(self, job_id: str) -> bool:
        raise NotImplementedError

    def _check_cluster(self, result: JobResult) -> None:
        if result.cluster_id != self.cluster_id:
            raise InvalidRecordError(f"job result {result.job_id!r} belongs to cluster {result.cluster_id!r}, but "
                                     f"this store holds cluster {self.cluster_id!r}")

    def dirty_entries(self) -> list[JobResultEntry]:
        return list(self.list(state="dirty").entries)

    def prune(self, older_than: float, now: float) -> list[str]:
        """Delete clean entries whose end time is more than ``older_than`` seconds before ``now``.

        Dirty entries are never pruned: their cleanup has not finished.
        """
        if older_than < 0:
            raise InvalidRecordError(f"prune: older_than must be >= 0 seconds, not {older_than!r}")
        with self._lock:
            victims = [e.job_id for e in self.list(state="clean", ended_before=now - older_than).entries]
            pruned = [job_id for job_id in victims if self._delete_clean(job_id)]
        if pruned:
            log.info("pruned %d clean job results that ended more than %.0f s ago", len(pruned), older_than)
        return pruned

    def close(self) -> None:
        """Nothing to release (file systems are shared fsspec instances); idempotent."""

    def __enter__(self):  # noqa: ANN204 - returns the concrete store
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InMemoryJobResultStore(_StoreBase):
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
        _check_state(state)
        want = _status_filter(status)
        with self._lock:
            entries = [e for e in self._entries.values() if _matches(e, state, want, ended_before)]
        return Listing(tuple(sorted(entries, key=lambda e: e.job_id)))

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        self._check_cluster(result)
        source = self._source(result.job_id, False)
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is not None:
                raise _exists_error(result.job_id, existing)
            entry = self._entries[result.job_id] = JobResultEntry(result, False, source)
            return entry

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        self._check_cluster(result)
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is None or existing.clean:
                raise JobResultNotFoundError(f"job {result.job_id!r} has no dirty result to update "
                                             f"({'it is already clean' if existing else 'there is none'})")
            entry = self._entries[result.job_id] = JobResultEntry(result, False, existing.source)
            return entry

    def mark_clean(self, job_id: str) -> JobResultEntry | None:
        job_file_stem(job_id)
        with self._lock:
            existing = self._entries.get(job_id)
            if existing is None:
                raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean in {self!r}")
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

    def quarantine(self, name: str) -> list[str]:
        raise JobResultNotFoundError(f"{name!r}: an in-memory store has no files to quarantine")


class FileSystemJobResultStore(_StoreBase):
    """A JobResultStore in a directory of any fsspec file system. See the module docstring.

    Parameters
    ----------
    url
        The store's root: a local path or any fsspec URL (``s3://bucket/steward/job-results``).
        Results live under ``<url>/<cluster_id>/``.
    cluster_id
        The namespace of the stored results.
    delete_on_commit
        Delete a result's file when it commits instead of renaming it to ``<job>.json``.
    location
        An already opened root (for tests and shared file systems); overrides ``url``.
    """

    def __init__(self, url: str, cluster_id: str = "default", delete_on_commit: bool = False,
                 location: Location | None = None) -> None:
        self.cluster_id = validate_id(cluster_id, "cluster id")
        self.delete_on_commit = delete_on_commit
        self.base = (location or open_location(url)).child(self.cluster_id)
        self.url = self.base.url
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"FileSystemJobResultStore({self.url!r})"

    def _paths(self, job_id: str) -> tuple[str, str]:
        stem = job_file_stem(job_id)
        return self.base.path(stem + DIRTY_SUFFIX), self.base.path(stem + CLEAN_SUFFIX)

    def _read(self, path: str) -> JobResultEntry | None:
        try:
            data = self.base.read_bytes(path)
        except FileNotFoundError:
            return None
        source = self.base.display(path)
        return JobResultEntry(JobResult.from_json(data, source), not path.endswith(DIRTY_SUFFIX), source)

    def _read_many(self, paths: list[str]) -> dict[str, bytes | Exception]:
        if not self.base.is_local:
            return self.base.read_many(paths)  # one concurrent batch on object stores
        out: dict[str, bytes | Exception] = {}
        for path in paths:  # plain reads: several times faster than fsspec's per-file open
            try:
                with open(path, "rb") as f:
                    out[path] = f.read()
            except OSError as exc:
                out[path] = exc
        return out

    # --- reads -------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobResultEntry | None:
        dirty, clean = self._paths(job_id)
        with self._lock:
            return self._read(clean) or self._read(dirty)

    def _scan(self) -> tuple[dict[str, dict[bool, str]], list[tuple[str, str]]]:
        """``{job_id: {clean?: path}}`` from one directory listing, and names that encode no job id."""
        files: dict[str, dict[bool, str]] = {}
        bad: list[tuple[str, str]] = []
        for info in self.base.listdir():
            path = info["name"].rstrip("/")
            name = posixpath.basename(path)
            if info.get("type") == "directory" or name.startswith(".") or not name.endswith(CLEAN_SUFFIX):
                continue  # quarantine/, staged temp files, foreign files
            is_dirty = name.endswith(DIRTY_SUFFIX)
            stem = name[: -len(DIRTY_SUFFIX if is_dirty else CLEAN_SUFFIX)]
            try:
                job_id = job_id_from_filename(stem)
            except (InvalidIdError, UnicodeDecodeError):
                bad.append((self.base.display(path), f"the file name {name!r} does not encode a job id"))
                continue
            files.setdefault(job_id, {})[not is_dirty] = path
        return files, bad

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        """Entries matching the filters; one directory listing, then one batch read (concurrent on
        object stores) of just the files the ``state`` filter needs."""
        _check_state(state)
        want = _status_filter(status)
        with self._lock:
            files, corrupt = self._scan()
            stale = sorted(job_id for job_id, f in files.items() if len(f) == 2)
            wanted: dict[str, tuple[str, bool]] = {}  # path -> (job id, clean)
            for job_id, f in files.items():
                clean = True in f
                if state is None or (state == "clean") == clean:
                    wanted[f[clean]] = (job_id, clean)
            blobs = self._read_many(sorted(wanted)) if wanted else {}
        entries = []
        for path, (job_id, clean) in sorted(wanted.items()):
            data, source = blobs.get(path), self.base.display(path)
            if isinstance(data, FileNotFoundError):
                continue  # removed since the listing (committed, pruned or deleted)
            if isinstance(data, Exception):
                raise StorageError(f"cannot read {source} while listing {self.url}: {data}. Retry; if it "
                                   f"persists, check the store's permissions") from data
            try:
                result = JobResult.from_json(data, source)  # type: ignore[arg-type]
            except CorruptRecordError as exc:
                corrupt.append((source, str(exc)))
                continue
            if result.job_id != job_id:
                corrupt.append((source, f"the file holds job {result.job_id!r}, not {job_id!r} as its name says"))
                continue
            entry = JobResultEntry(result, clean, source)
            if _matches(entry, None, want, ended_before):
                entries.append(entry)
        return Listing(tuple(entries), tuple(sorted(corrupt)), tuple(stale))

    # --- writes ------------------------------------------------------------------------------
    # Each write does as few requests as it can: on an object store, a missing key costs a HEAD and
    # a LIST, so existence is checked once, and only where the answer changes what is written.
    def _existing(self, job_id: str, path: str) -> JobResultExistsError:
        try:
            existing = self._read(path)
        except CorruptRecordError as exc:
            return JobResultExistsError(f"job {job_id!r} already has a result file that cannot be read: {exc}")
        if existing is None:  # gone again since we looked
            return JobResultExistsError(f"job {job_id!r}: {self.base.display(path)} was created concurrently by "
                                        f"another writer")
        return _exists_error(job_id, existing)

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        """Create ``<job>_DIRTY.json`` (staged, then linked without overwrite; a conditional PUT on
        object stores). JobResultExistsError if the job has any file, readable or not."""
        self._check_cluster(result)
        dirty, clean = self._paths(result.job_id)
        data = result.to_json()
        with self._lock:
            if self.base.exists(clean):
                raise self._existing(result.job_id, clean)
            self.base.makedirs()
            if not self.base.create_exclusive(dirty, data):
                raise self._existing(result.job_id, dirty)
        log.debug("created %s", self.base.display(dirty))
        return JobResultEntry(result, False, self.base.display(dirty))

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        """Rewrite a dirty entry (stage, then rename; one PUT on object stores)."""
        self._check_cluster(result)
        dirty, clean = self._paths(result.job_id)
        with self._lock:
            if not self.base.exists(dirty):
                if self.base.exists(clean):
                    raise JobResultNotFoundError(f"job {result.job_id!r} is already clean at "
                                                 f"{self.base.display(clean)}; its dirty result cannot be updated")
                raise JobResultNotFoundError(f"job {result.job_id!r} has no dirty result to update at "
                                             f"{self.base.display(dirty)}")
            self.base.write_atomic(dirty, result.to_json())
        return JobResultEntry(result, False, self.base.display(dirty))

    def mark_clean(self, job_id: str) -> JobResultEntry | None:
        """Commit: rename ``_DIRTY.json`` to ``.json`` (or delete it, with delete-on-commit).

        Already clean: a no-op. Missing: JobResultNotFoundError. A stale dirty file next to a clean
        one (an interrupted object-store rename) holds the same bytes, so committing it again
        simply completes that rename.
        """
        dirty, clean = self._paths(job_id)
        with self._lock:
            try:
                entry = self._read(dirty)  # a corrupt dirty file is not committed: it raises here
            except CorruptRecordError:
                committed = self._read(clean)
                if committed is None:
                    raise
                log.warning("job %s: removing the unreadable stale %s; the committed %s wins", job_id,
                            self.base.display(dirty), committed.source)
                self.base.delete(dirty)
                return committed
            if entry is None:
                committed = self._read(clean)
                if committed is None:
                    raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean in {self.url}")
                return committed
            if self.delete_on_commit:
                self.base.delete(dirty)
                return None
            self.base.rename(dirty, clean)
        return JobResultEntry(entry.result, True, self.base.display(clean))

    def delete(self, job_id: str) -> bool:
        paths = self._paths(job_id)
        with self._lock:  # object stores delete missing keys silently: ask first, for the return value
            present = [p for p in paths if self.base.exists(p)]
            for path in present:
                self.base.delete(path)
        return bool(present)

    def _delete_clean(self, job_id: str) -> bool:
        _, clean = self._paths(job_id)
        with self._lock:
            return self.base.delete(clean)

    def quarantine(self, name: str) -> list[str]:
        """Move files to ``<cluster-id>/quarantine/``, so listings stop reporting them.

        ``name`` is a file name in the store (``x_DIRTY.json``) or a job id (all of its files).
        Returns the new locations.
        """
        with self._lock:
            paths: list[str] = []
            if name.endswith(CLEAN_SUFFIX) and "/" not in name and not name.startswith("."):
                candidate = self.base.path(name)
                if self.base.exists(candidate):
                    paths = [candidate]
            if not paths:
                try:
                    paths = [p for p in self._paths(name) if self.base.exists(p)]
                except InvalidIdError as exc:
                    raise InvalidIdError(f"{name!r} is neither a file of {self.url} nor a job id: {exc}") from exc
            if not paths:
                raise JobResultNotFoundError(f"no file or job {name!r} in {self.url}")
            target = self.base.child(QUARANTINE)
            target.makedirs()
            moved = []
            for src in paths:
                base = posixpath.basename(src)
                dst = target.path(base)
                if target.exists(dst):
                    dst = target.path(f"{base}.{uuid.uuid4().hex[:8]}")
                self.base.rename(src, dst)
                log.warning("quarantined %s to %s", self.base.display(src), self.base.display(dst))
                moved.append(self.base.display(dst))
            return moved


def open_store(url: str, cluster_id: str = "default",
               delete_on_commit: bool = False) -> InMemoryJobResultStore | FileSystemJobResultStore:
    """``memory`` gives an in-memory store; any other path or URL a filesystem store there."""
    if url == "memory":
        return InMemoryJobResultStore(cluster_id, delete_on_commit)
    return FileSystemJobResultStore(url, cluster_id, delete_on_commit)
