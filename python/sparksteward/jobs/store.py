"""The JobResultStore (FLIP-194): durable job results, dirty until their cleanup commits.

Two implementations share one contract (``tests/test_jrs_contract.py``):

- :class:`InMemoryJobResultStore`, for tests and ``spark.steward.jrs.storage-path=memory``;
- :class:`FileSystemJobResultStore`, on any fsspec URL, laid out as::

      <path>/<cluster-id>/<job>_DIRTY.json   created once, never overwritten by create
      <path>/<cluster-id>/<job>.json         after commit (or deleted, with delete-on-commit)
      <path>/<cluster-id>/quarantine/        unreadable files moved aside by `steward jobs quarantine`

  Job ids are encoded into file names reversibly (:mod:`sparksteward.ids`). Every write stages, then
  renames (locally) or is a single PUT (object stores). If a commit was interrupted between the copy
  and the delete of an object-store rename, both files exist: the clean one wins, and the next commit
  or recovery removes the stale dirty file.

Thread-safety: both stores serialize their operations with a lock.
"""

from __future__ import annotations

import posixpath
import threading
from dataclasses import dataclass, field
from typing import Protocol

from sparksteward.errors import CorruptRecordError, InvalidIdError, JobResultExistsError, JobResultNotFoundError
from sparksteward.ids import job_id_from_filename, job_id_to_filename, validate_id, validate_job_id
from sparksteward.jobs.result import JobResult, JobResultEntry, decode_result, encode_result
from sparksteward.storage import Location, open_location

__all__ = ["FileSystemJobResultStore", "InMemoryJobResultStore", "JobResultStore", "JobResultView",
           "Listing", "open_store"]

_DIRTY = "_DIRTY.json"
_CLEAN = ".json"


@dataclass(frozen=True)
class Listing:
    """What a store holds: readable entries, and files it could not read (named, with the reason)."""

    entries: list[JobResultEntry] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)


class JobResultView(Protocol):
    """Read side of a JobResultStore."""

    def get(self, job_id: str) -> JobResultEntry | None: ...
    def list(self) -> Listing: ...


class JobResultStore(JobResultView, Protocol):
    """Write side: create dirty, update dirty, mark clean, delete, quarantine."""

    def create_dirty(self, result: JobResult) -> JobResultEntry: ...
    def update_dirty(self, result: JobResult) -> JobResultEntry: ...
    def mark_clean(self, job_id: str) -> JobResultEntry | None: ...
    def delete(self, job_id: str) -> bool: ...
    def quarantine(self, name: str) -> str: ...


def _exists_error(job_id: str, entry: JobResultEntry) -> JobResultExistsError:
    return JobResultExistsError(f"job {job_id!r} already has a {entry.state} result ({entry.status.value}) "
                                f"at {entry.source}")


class InMemoryJobResultStore:
    """A JobResultStore in this process's memory."""

    def __init__(self, cluster_id: str = "default", delete_on_commit: bool = False) -> None:
        self.cluster_id = validate_id(cluster_id, "cluster id")
        self.delete_on_commit = delete_on_commit
        self._entries: dict[str, JobResultEntry] = {}
        self._lock = threading.Lock()

    def _source(self, job_id: str) -> str:
        return f"memory://{self.cluster_id}/{job_id_to_filename(job_id)}"

    def get(self, job_id: str) -> JobResultEntry | None:
        validate_job_id(job_id)
        with self._lock:
            return self._entries.get(job_id)

    def list(self) -> Listing:
        with self._lock:
            return Listing(sorted(self._entries.values(), key=lambda e: e.job_id))

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is not None:
                raise _exists_error(result.job_id, existing)
            entry = self._entries[result.job_id] = JobResultEntry(result, False, self._source(result.job_id))
            return entry

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        with self._lock:
            existing = self._entries.get(result.job_id)
            if existing is None or existing.clean:
                raise JobResultNotFoundError(f"job {result.job_id!r} has no dirty result to update")
            entry = self._entries[result.job_id] = JobResultEntry(result, False, existing.source)
            return entry

    def mark_clean(self, job_id: str) -> JobResultEntry | None:
        with self._lock:
            existing = self._entries.get(job_id)
            if existing is None:
                raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean")
            if self.delete_on_commit:
                del self._entries[job_id]
                return None
            entry = self._entries[job_id] = JobResultEntry(existing.result, True, existing.source)
            return entry

    def delete(self, job_id: str) -> bool:
        validate_job_id(job_id)
        with self._lock:
            return self._entries.pop(job_id, None) is not None

    def quarantine(self, name: str) -> str:
        raise JobResultNotFoundError(f"{name!r}: an in-memory store has no files to quarantine")


class FileSystemJobResultStore:
    """A JobResultStore in a directory of any fsspec file system. See the module docstring."""

    def __init__(self, url: str, cluster_id: str = "default", delete_on_commit: bool = False,
                 location: Location | None = None) -> None:
        self.cluster_id = validate_id(cluster_id, "cluster id")
        self.delete_on_commit = delete_on_commit
        self.base = (location or open_location(url)).child(self.cluster_id)
        self._lock = threading.Lock()

    def _paths(self, job_id: str) -> tuple[str, str]:
        stem = job_id_to_filename(job_id)
        return self.base.path(stem + _DIRTY), self.base.path(stem + _CLEAN)

    def _read(self, path: str) -> JobResultEntry | None:
        try:
            data = self.base.read_bytes(path)
        except FileNotFoundError:
            return None
        source = self.base.display(path)
        result = decode_result(data, source)
        return JobResultEntry(result, not path.endswith(_DIRTY), source)

    def get(self, job_id: str) -> JobResultEntry | None:
        dirty, clean = self._paths(job_id)
        with self._lock:
            return self._read(clean) or self._read(dirty)

    def list(self) -> Listing:
        """Every entry; files are fetched in one batch (concurrently on object stores)."""
        listing = Listing()
        seen: dict[str, JobResultEntry] = {}
        with self._lock:
            names: dict[str, str] = {}
            for info in self.base.listdir():
                name = posixpath.basename(info["name"].rstrip("/"))
                if info.get("type") != "directory" and name.endswith(_CLEAN) and not name.startswith("."):
                    names[info["name"]] = name
            blobs = self.base.read_many(list(names)) if names else {}
            for path, name in sorted(names.items()):
                source = self.base.display(path)
                stem = name[: -len(_DIRTY)] if name.endswith(_DIRTY) else name[: -len(_CLEAN)]
                data = blobs.get(path)
                if isinstance(data, FileNotFoundError):
                    continue  # removed since the listing
                try:
                    if isinstance(data, Exception):
                        raise CorruptRecordError(f"cannot read {source}: {data}")
                    job_id = job_id_from_filename(stem)
                    entry = JobResultEntry(decode_result(data, source), not name.endswith(_DIRTY), source)
                except (CorruptRecordError, InvalidIdError) as exc:
                    listing.corrupt.append((source, str(exc)))
                    continue
                if entry.job_id != job_id:
                    listing.corrupt.append((source, f"holds job {entry.job_id!r}, not {job_id!r}"))
                elif job_id not in seen or entry.clean:  # a clean file wins over a stale dirty one
                    seen[job_id] = entry
        listing.entries.extend(sorted(seen.values(), key=lambda e: e.job_id))
        return listing

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        dirty, clean = self._paths(result.job_id)
        with self._lock:
            for path in (clean, dirty):
                try:
                    existing = self._read(path)
                except CorruptRecordError as exc:
                    raise JobResultExistsError(f"job {result.job_id!r} already has a result file that cannot be "
                                               f"read: {exc}") from exc
                if existing is not None:
                    raise _exists_error(result.job_id, existing)
            self.base.makedirs()
            if not self.base.create_exclusive(dirty, encode_result(result)):
                raise JobResultExistsError(f"job {result.job_id!r}: {self.base.display(dirty)} was created concurrently")
            return JobResultEntry(result, False, self.base.display(dirty))

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        dirty, _ = self._paths(result.job_id)
        with self._lock:
            if not self.base.exists(dirty):
                raise JobResultNotFoundError(f"job {result.job_id!r} has no dirty result to update at "
                                             f"{self.base.display(dirty)}")
            self.base.write_atomic(dirty, encode_result(result))
            return JobResultEntry(result, False, self.base.display(dirty))

    def mark_clean(self, job_id: str) -> JobResultEntry | None:
        """Commit: rename ``_DIRTY.json`` to ``.json`` (or delete it). Idempotent once clean."""
        dirty, clean = self._paths(job_id)
        with self._lock:
            has_dirty, has_clean = self.base.exists(dirty), self.base.exists(clean)
            if has_clean:
                if has_dirty:  # an interrupted object-store rename: the clean copy is complete
                    self.base.delete(dirty)
                return None if self.delete_on_commit else self._read(clean)
            if not has_dirty:
                raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean under {self.base.url}")
            if self.delete_on_commit:
                self.base.delete(dirty)
                return None
            self.base.rename(dirty, clean)
            return self._read(clean)

    def delete(self, job_id: str) -> bool:
        dirty, clean = self._paths(job_id)
        with self._lock:
            return any([self.base.delete(dirty), self.base.delete(clean)])

    def quarantine(self, name: str) -> str:
        """Move the file ``name`` (a file name in the store, or a job id) to ``quarantine/``."""
        with self._lock:
            candidates = [name] if name.endswith(_CLEAN) else [job_id_to_filename(name) + s for s in (_DIRTY, _CLEAN)]
            for candidate in candidates:
                if "/" in candidate or candidate.startswith("."):
                    raise InvalidIdError(f"{name!r} is not a file of this store")
                src = self.base.path(candidate)
                if self.base.exists(src):
                    dst = self.base.child("quarantine").path(candidate)
                    self.base.child("quarantine").makedirs()
                    self.base.rename(src, dst)
                    return self.base.display(dst)
        raise JobResultNotFoundError(f"no file {name!r} in {self.base.url}")


def open_store(url: str, cluster_id: str, delete_on_commit: bool = False) -> InMemoryJobResultStore | FileSystemJobResultStore:
    """``memory`` gives an in-memory store; anything else a filesystem store at that URL."""
    if url == "memory":
        return InMemoryJobResultStore(cluster_id, delete_on_commit)
    return FileSystemJobResultStore(url, cluster_id, delete_on_commit)
