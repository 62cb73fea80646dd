"""The JobResultStore on a file system: :class:`FileSystemJobResultStore`, on any fsspec URL.

Laid out as::

      <path>/<cluster-id>/<job>_DIRTY.json   created exclusively; rewritten (stage, fsync, rename)
                                             as cleanup steps progress, by the run that wrote it only
      <path>/<cluster-id>/<job>.json         after the commit (or deleted, with delete-on-commit)
      <path>/<cluster-id>/quarantine/        unreadable files moved aside by ``quarantine``
      <path>/<cluster-id>/.lock              local stores: the lock every update and commit holds
      <path>/<cluster-id>/.<job>.lease       local stores: locked while a run of the job is live

Job ids are encoded into file names by :func:`sparksteward.ids.job_id_to_filename` (case-unique, bounded
in length, reversible except for very long ids, whose names end in a hash). Every record stores its
job id and every read checks it against the id asked for, so a name that a case-insensitive store
resolves to another job's file is an error, never the other job's result. The base directory is
created lazily by the first write, and a missing directory lists as empty (FLINK-26494).

Compare-and-swap (the contract is in :mod:`sparksteward.jobs.store`): on a local store under an
exclusive ``flock`` of ``.lock`` (:func:`~sparksteward.jobs.lease.store_lock`, released by the kernel
if the process dies), on an object store with conditional writes (``If-Match`` on the ETag that was
read, ``If-None-Match: *`` for creates). A commit links (local) or conditionally creates (object
store) the clean name, then deletes the dirty file. Leases exist on local stores (``flock``, so a
killed process releases them); object stores report no leases.

Unreadable files (partial, unparsable, unknown version, holding another job, or not a regular file:
a FIFO, a symlink, a directory named like an entry) raise
:class:`~sparksteward.errors.CorruptRecordError` naming the file from ``get``; ``list`` reports them
in ``Listing.corrupt`` and carries on, and ``quarantine`` moves any of them aside. Local files are
read with :func:`sparksteward.storage.read_regular`, so nothing blocks.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Iterator

from sparksteward.errors import (
    CorruptRecordError,
    InvalidIdError,
    JobResultExistsError,
    JobResultNotFoundError,
    StorageError,
)
from sparksteward.ids import is_hashed_filename, job_id_from_filename, validate_id
from sparksteward.jobs.lease import Lease, acquire_file_lease, is_file_leased, store_lock
from sparksteward.jobs.result import JobResult, JobResultEntry, JobStatus
from sparksteward.jobs.store import (
    CLEAN_SUFFIX,
    DIRTY_SUFFIX,
    InMemoryJobResultStore,
    Listing,
    StoreBase,
    job_file_stem,
)
from sparksteward.storage import Location, NotRegularFileError, open_location, read_regular

__all__ = ["FileSystemJobResultStore", "open_store"]

log = logging.getLogger("sparksteward.jobs.fs_store")

QUARANTINE = "quarantine"
_HINT = "Move it aside with `steward jobs quarantine`, or delete it if the job may run again."


def _stem_id(stem: str) -> str | None:
    """The job id a stem encodes; None for a hashed stem (the record says); InvalidIdError if foreign."""
    return None if is_hashed_filename(stem) else job_id_from_filename(stem)



class FileSystemJobResultStore(StoreBase):
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

    CAS_RETRIES = 5

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

    @contextlib.contextmanager
    def _locked(self, create: bool = False) -> Iterator[None]:
        """This store's thread lock and, on a local store, an exclusive ``flock`` of ``.lock``: every
        compare-and-swap runs under it, in this process and any other on the same store. Without
        ``create``, a store whose directory does not exist yet (so holds nothing) is not created."""
        with self._lock:
            if not self.base.is_local or (not create and not os.path.isdir(self.base.root)):
                yield
                return
            with store_lock(self.base.root, self.url):
                yield

    # --- reads -------------------------------------------------------------------------------
    def _load(self, path: str) -> bytes | None:
        """A file's bytes, None if missing; CorruptRecordError for a file that is not a regular file."""
        source = self.base.display(path)
        try:
            if self.base.is_local:
                return read_regular(path)
            return self.base.read_bytes(path)
        except FileNotFoundError:
            return None
        except NotRegularFileError as exc:
            raise CorruptRecordError(f"job result {source} {exc}. {_HINT}") from exc
        except IsADirectoryError as exc:
            raise CorruptRecordError(f"job result {source} is a directory, not a file. {_HINT}") from exc
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read {source}: {exc}") from exc

    def _parse(self, data: bytes, path: str, stem: str, job_id: str | None) -> JobResultEntry:
        source = self.base.display(path)
        result = JobResult.from_json(data, source)
        if (job_id is not None and result.job_id != job_id) or job_file_stem(result.job_id) != stem:
            wanted = f"{job_id!r}" if job_id is not None else "the job its name encodes"
            raise CorruptRecordError(f"job result {source} holds job {result.job_id!r}, not {wanted} (a name clash "
                                     f"on a case-insensitive store, or a file copied by hand). {_HINT}")
        return JobResultEntry(result, not path.endswith(DIRTY_SUFFIX), source)

    def _read(self, path: str, job_id: str) -> JobResultEntry | None:
        data = self._load(path)
        if data is None:
            return None
        return self._parse(data, path, job_file_stem(job_id), job_id)

    def get(self, job_id: str) -> JobResultEntry | None:
        dirty, clean = self._paths(job_id)
        with self._lock:
            # dirty first: a commit creates the clean file before it deletes the dirty one, so a dirty
            # file gone by now means the clean one exists (reading clean first could miss both)
            dirty_entry = self._read(dirty, job_id)
            return self._read(clean, job_id) or dirty_entry

    def _scan(self) -> tuple[dict[str, dict[bool, str]], list[tuple[str, str]]]:
        """``{stem: {clean?: path}}`` from one directory listing, and names that encode no job id."""
        files: dict[str, dict[bool, str]] = {}
        bad: list[tuple[str, str]] = []
        if self.base.is_local:
            try:
                with os.scandir(self.base.root) as it:
                    names = [(e.name, e.name == QUARANTINE and e.is_dir(follow_symlinks=False)) for e in it]
            except FileNotFoundError:
                names = []
            except OSError as exc:
                raise StorageError(f"cannot list {self.url}: {exc}") from exc
        else:
            names = [(posixpath.basename(i["name"].rstrip("/")),
                      posixpath.basename(i["name"].rstrip("/")) == QUARANTINE and i.get("type") == "directory")
                     for i in self.base.listdir()]
        for name, is_quarantine in names:
            if is_quarantine or name.startswith(".") or not name.endswith(CLEAN_SUFFIX):
                continue  # quarantine/, the lock, leases, staged temp files, foreign files
            path = self.base.path(name)
            is_dirty = name.endswith(DIRTY_SUFFIX)
            stem = name[: -len(DIRTY_SUFFIX if is_dirty else CLEAN_SUFFIX)]
            try:
                _stem_id(stem)
            except InvalidIdError:
                bad.append((self.base.display(path), f"the file name {name!r} does not encode a job id"))
                continue
            files.setdefault(stem, {})[not is_dirty] = path
        return files, bad

    def _read_many(self, paths: list[str]) -> dict[str, bytes | Exception]:
        if not self.base.is_local:
            try:
                return self.base.read_many(paths)  # one concurrent batch on object stores
            except StorageError as exc:
                return {p: exc for p in paths}
        out: dict[str, bytes | Exception] = {}
        for path in paths:
            try:
                data = self._load(path)
                out[path] = FileNotFoundError(path) if data is None else data
            except Exception as exc:  # noqa: BLE001 - reported per file
                out[path] = exc
        return out

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        """Entries matching the filters; one directory listing, then one batch read (concurrent on
        object stores) of just the files the ``state`` filter needs. A file that cannot be read is
        reported in ``corrupt`` with the reason; it never fails the whole listing."""
        self._check_state(state)
        want = self._status_filter(status)
        with self._lock:
            files, corrupt = self._scan()
            wanted: dict[str, tuple[str, bool]] = {}  # path -> (stem, clean)
            stale_stems = [stem for stem, f in files.items() if len(f) == 2]
            for stem, f in files.items():
                clean = True in f
                if state is None or (state == "clean") == clean or (len(f) == 2 and is_hashed_filename(stem)):
                    wanted[f[clean]] = (stem, clean)
            blobs = self._read_many(sorted(wanted)) if wanted else {}
        entries, ids = [], {}
        for path, (stem, _clean) in sorted(wanted.items()):
            data, source = blobs[path], self.base.display(path)
            if isinstance(data, FileNotFoundError):
                continue  # removed since the listing (committed, pruned or deleted)
            if isinstance(data, Exception):
                reason = str(data) if isinstance(data, CorruptRecordError) else f"cannot read it: {data}"
                corrupt.append((source, reason))
                continue
            try:
                entry = self._parse(data, path, stem, _stem_id(stem))
            except CorruptRecordError as exc:
                corrupt.append((source, str(exc)))
                continue
            ids[stem] = entry.job_id
            if self._matches(entry, state, want, ended_before):
                entries.append(entry)
        stale = sorted(ids.get(stem) or _stem_id(stem) or stem for stem in stale_stems)
        return Listing(tuple(sorted(entries, key=lambda e: e.job_id)), tuple(sorted(corrupt)), tuple(stale))

    # --- writes ------------------------------------------------------------------------------
    def _existing(self, job_id: str, path: str) -> JobResultExistsError:
        try:
            existing = self._read(path, job_id)
        except CorruptRecordError as exc:
            return JobResultExistsError(f"job {job_id!r} already has a result file that cannot be read: {exc}")
        if existing is None:  # gone again since we looked
            return JobResultExistsError(f"job {job_id!r}: {self.base.display(path)} was created concurrently by "
                                        f"another writer")
        return self._exists_error(job_id, existing)

    def create_dirty(self, result: JobResult) -> JobResultEntry:
        """Create ``<job>_DIRTY.json`` (staged, fsynced, then linked without overwrite; a conditional PUT
        on object stores). JobResultExistsError if the job has any file, readable or not."""
        self._check_cluster(result)
        dirty, clean = self._paths(result.job_id)
        data = result.to_json()
        with self._locked(create=True):
            if self.base.lexists(clean):
                raise self._existing(result.job_id, clean)
            self.base.makedirs()
            if not self.base.create_exclusive(dirty, data):
                raise self._existing(result.job_id, dirty)
        log.debug("created %s", self.base.display(dirty))
        return JobResultEntry(result, False, self.base.display(dirty))

    def _current_dirty(self, job_id: str, dirty: str, clean: str) -> tuple[JobResultEntry, str | None]:
        """The dirty entry and its version (ETag on object stores, read first); JobResultNotFoundError if none."""
        version = self.base.version(dirty)
        entry = self._read(dirty, job_id)
        if entry is None:
            if self.base.lexists(clean):
                raise JobResultNotFoundError(f"job {job_id!r} is already clean at {self.base.display(clean)}; its "
                                             f"dirty result cannot be updated")
            raise JobResultNotFoundError(f"job {job_id!r} has no dirty result to update at "
                                         f"{self.base.display(dirty)}")
        return entry, version

    def update_dirty(self, result: JobResult) -> JobResultEntry:
        """Rewrite the dirty entry of ``result.run_id`` (compare-and-swap on the stored run id: under the
        store's lock locally, ``If-Match`` on object stores). RunConflictError if it is another run's."""
        self._check_cluster(result)
        dirty, clean = self._paths(result.job_id)
        data = result.to_json()
        for _ in range(self.CAS_RETRIES):
            with self._locked():
                current, version = self._current_dirty(result.job_id, dirty, clean)
                if not self._same_run(current.result, result.run_id):
                    raise self._conflict(result.job_id, "update the dirty result", result.run_id, current.result.run_id,
                                    current.source)
                if self.base.replace_if(dirty, data, version):
                    return JobResultEntry(result, False, self.base.display(dirty))
            log.debug("job %s: %s changed while it was updated; reading it again", result.job_id, dirty)
        raise StorageError(f"job {result.job_id!r}: {self.base.display(dirty)} kept changing during "
                           f"{self.CAS_RETRIES} conditional writes; retry")

    def mark_clean(self, job_id: str, run_id: str | None = None) -> JobResultEntry | None:
        """Commit: create ``.json`` without overwriting (a link locally, ``If-None-Match`` on object
        stores), then delete ``_DIRTY.json`` (or only delete it, with delete-on-commit).

        Already clean: a no-op, and a leftover dirty file next to the clean one is deleted (a clean
        file is never replaced). Missing: JobResultNotFoundError. ``run_id`` given and the dirty
        entry is another run's: RunConflictError.
        """
        dirty, clean = self._paths(job_id)
        with self._locked():
            version = self.base.version(dirty)  # object stores: the dirty object's ETag, checked before deleting it
            try:
                entry = self._read(dirty, job_id)  # a corrupt dirty file is not committed: it raises here
            except CorruptRecordError:
                committed = self._read(clean, job_id)
                if committed is None:
                    raise
                log.warning("job %s: removing the unreadable stale %s; the committed %s wins", job_id,
                            self.base.display(dirty), committed.source)
                self.base.delete(dirty)
                return committed
            if entry is None:
                committed = self._read(clean, job_id)
                if committed is None:
                    raise JobResultNotFoundError(f"job {job_id!r} has no result to mark clean in {self.url}")
                if not self._same_run(committed.result, run_id):
                    raise self._conflict(job_id, "commit", run_id, committed.result.run_id, committed.source)
                return committed
            if not self._same_run(entry.result, run_id):
                raise self._conflict(job_id, "commit", run_id, entry.result.run_id, entry.source)
            if self.delete_on_commit:
                self.base.delete(dirty)
                return None
            data = entry.result.to_json()
            if not self.base.link_or_create(dirty, clean, data):
                committed = self._read(clean, job_id)
                if committed is not None and self._late_older_commit(committed, entry) and self.base.replace_if(
                        clean, data, self.base.version(clean)):
                    log.warning("job %s: replaced %s, committed late by the older run %s, with run %s's result",
                                job_id, self.base.display(clean), committed.result.run_id,
                                entry.result.run_id)
                    self._delete_dirty_if(dirty, version)
                    return JobResultEntry(entry.result, True, self.base.display(clean))
                log.warning("job %s: a committed result already exists at %s; deleting the dirty %s instead of "
                            "replacing it", job_id, self.base.display(clean), entry.source)
                self._delete_dirty_if(dirty, version)
                return committed
            self._delete_dirty_if(dirty, version)
        return JobResultEntry(entry.result, True, self.base.display(clean))

    def _late_older_commit(self, committed: JobResultEntry | None, entry: JobResultEntry) -> bool:
        """On an object store (no lock between a commit and a forced re-run's delete), a clean entry of
        another run next to this run's dirty one was committed late by an older run: a dirty entry is
        only created when no clean one exists, and a forced re-run deletes the older run's files first."""
        return (not self.base.is_local and committed is not None and entry.result.run_id is not None
                and committed.result.run_id not in (None, entry.result.run_id))

    def _delete_dirty_if(self, dirty: str, version: str | None) -> None:
        """Delete the dirty file we committed; on an object store only if it is still the object we read
        (a newer run may have replaced it meanwhile; its own commit deletes it then)."""
        if not self.base.is_local and version is not None and self.base.version(dirty) not in (None, version):
            log.warning("%s changed while it was committed (a newer run wrote it); leaving it",
                        self.base.display(dirty))
            return
        self.base.delete(dirty)

    def delete(self, job_id: str) -> bool:
        paths = self._paths(job_id)
        with self._locked():  # object stores delete missing keys silently: ask first, for the return value
            present = [p for p in paths if self.base.lexists(p)]
            for path in present:
                self.base.delete(path)
        return bool(present)

    def _delete_clean(self, job_id: str) -> bool:
        _, clean = self._paths(job_id)
        with self._locked():
            return self.base.delete(clean)

    def _delete_stale(self, job_id: str) -> bool:
        dirty, clean = self._paths(job_id)
        with self._locked():
            return self.base.lexists(clean) and self.base.delete(dirty)

    def quarantine(self, name: str) -> builtins.list[str]:
        """Move files to ``<cluster-id>/quarantine/``, so listings stop reporting them.

        ``name`` is a file name in the store (``x_DIRTY.json``) or a job id (all of its files). Any
        kind of file moves: a symlink (even a loop), a FIFO, a directory named like an entry.
        Returns the new locations.
        """
        with self._locked():
            paths: list[str] = []
            if name.endswith(CLEAN_SUFFIX) and "/" not in name and not name.startswith("."):
                candidate = self.base.path(name)
                if self.base.lexists(candidate):
                    paths = [candidate]
            if not paths:
                try:
                    paths = [p for p in self._paths(name) if self.base.lexists(p)]
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
                if target.lexists(dst):
                    dst = target.path(f"{base}.{uuid.uuid4().hex[:8]}")
                self.base.rename(src, dst)
                log.warning("quarantined %s to %s", self.base.display(src), self.base.display(dst))
                moved.append(self.base.display(dst))
            return moved

    # --- leases --------------------------------------------------------------------------------
    def _lease_path(self, job_id: str) -> str:
        return os.path.join(self.base.root, f".{job_file_stem(job_id)}.lease")

    def lease(self, job_id: str, run_id: str) -> Lease:
        """Hold ``job_id`` for a live run: an exclusive ``flock`` of ``.<job>.lease`` on local stores,
        released on :meth:`Lease.release` or when the process dies. JobStoreError if held elsewhere.
        Object stores: a null lease (recovery cannot tell a live run there)."""
        path = self._lease_path(job_id)
        if not self.base.is_local:
            return Lease(job_id)
        return acquire_file_lease(path, job_id, run_id)

    def is_leased(self, job_id: str) -> bool:
        """True if a live run holds ``job_id``'s lease (local stores; always False on object stores)."""
        if not self.base.is_local:
            return False
        return is_file_leased(self._lease_path(job_id))


def open_store(url: str, cluster_id: str = "default",
               delete_on_commit: bool = False) -> InMemoryJobResultStore | FileSystemJobResultStore:
    """``memory`` gives an in-memory store; any other path or URL a filesystem store there."""
    if url == "memory":
        return InMemoryJobResultStore(cluster_id, delete_on_commit)
    return FileSystemJobResultStore(url, cluster_id, delete_on_commit)
