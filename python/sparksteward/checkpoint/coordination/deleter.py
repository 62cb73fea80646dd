"""FileDeleter: the deletes of one keyed state's checkpoint files, in order and off the caller's
thread (Flink's ``CheckpointsCleaner``), owned by its
:class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

The coordinator decides *what* goes (reference counts, retention, leases); the deleter decides
*when* and makes sure nothing it deletes is needed again by then:

- **Jobs run in submission order.** A record job deletes a subsumed checkpoint's ``chk-N`` directory
  (and the source ``_metadata`` a CLAIM restore took over); a files job deletes data files and may
  wait for a record job (``after``): if that record could not be deleted, its files stay (a record
  never points at deleted files; recovery subsumes it again).
- **Checked again just before the delete.** A file that a record references again (``needed``), that
  a pending ack or an open ``across`` file holds (``held``), or that an ack referenced since the job
  was queued (:meth:`note_acked`) is skipped.
- **Fenced before every delete request** (decision 0013): the writer lease is checked before each
  record (and the claimed source record) and before each data file, not once per job. A writer whose
  renewals failed, or whose lease another application took over, stops at its next delete, in the
  middle of a long job too; the rest of that job and every later job stay (a record that was not
  deleted keeps its files, as a failed one does).
- **A record never completes on a deleted file.** Every path handed to a delete is remembered
  (:meth:`deleted_among`, at most ``_MAX_DELETED``); :meth:`wait_idle_for` lets ``complete()`` wait for
  a delete in progress of a file it references, then look whether the file exists.

With ``background`` off, a job runs at once in the caller's thread (which holds the lock); with it
on, a daemon thread runs the jobs and the storage I/O happens outside the lock.

Thread-safe: it shares the coordinator's lock (an ``RLock``) and waits on a condition of it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sparksteward.checkpoint.lease import Fence
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError

__all__ = ["FileDeleter"]

log = logging.getLogger("sparksteward.checkpoint.coordination.deleter")

_MAX_DELETED = 100_000   # deleted paths remembered, so that complete() refuses a record naming one


@dataclass
class _Job:
    """A subsumed checkpoint's record (``checkpoint_id``, with the CLAIMed source ``record``), or data
    ``files``, which wait for the record job ``after`` and stay if it failed."""

    files: list[str] = field(default_factory=list)
    checkpoint_id: int | None = None
    record: CheckpointMetadata | None = None
    after: int | None = None
    seq: int = 0


class FileDeleter:
    """Queued deletes of one state's files (see the module docstring)."""

    def __init__(self, storage: CheckpointStorage, lease: Fence, lock: threading.RLock, *,
                 needed: Callable[[str], bool], held: Callable[[], set[str]], background: bool = False) -> None:
        self.storage = storage
        self.lease = lease
        self.background = background
        self._lock = lock
        self._needed = needed     # a retained record references the path
        self._held = held         # paths a pending ack or an open across file needs
        self._jobs: collections.deque[_Job] = collections.deque()
        self._failed_records: set[int] = set()   # record jobs that failed: the files after them stay
        self._seq = 0
        self._deleting: set[str] = set()          # data files being deleted now
        self._busy = False                        # the thread works on a job
        self._acked_since: set[str] = set()       # files acks referenced while the thread works: they stay
        self._deleted: dict[str, None] = {}       # paths handed to a delete, not seen again since (oldest first)
        self._changed = threading.Condition(lock)
        self._thread: threading.Thread | None = None
        self._closing = False

    # --- submitting (the caller holds the lock) ----------------------------------------------------
    def delete_record(self, checkpoint_id: int, claimed_source: CheckpointMetadata | None = None) -> int:
        """Queue the deletion of checkpoint ``checkpoint_id``'s record (and of the source record
        ``claimed_source`` took over with CLAIM); returns the job's number, for :meth:`delete_files`."""
        return self._submit(_Job(checkpoint_id=checkpoint_id, record=claimed_source))

    def delete_files(self, files: list[str], after: int | None = None) -> int:
        """Queue the deletion of data ``files``, after the record job ``after`` if given."""
        self._remember(files)
        return self._submit(_Job(files=list(files), after=after))

    def note_acked(self, paths: Iterable[str]) -> None:
        """An ack referenced ``paths``: a queued or running delete spares them."""
        if self._busy or self._jobs:
            self._acked_since.update(paths)

    # --- what complete() asks ----------------------------------------------------------------------
    def in_progress(self) -> set[str]:
        """The data files being deleted right now."""
        with self._lock:
            return set(self._deleting)

    def wait_idle_for(self, paths: set[str], timeout: float) -> bool:
        """Wait (releasing the lock) until none of ``paths`` is being deleted; False on timeout."""
        with self._lock:
            return self._changed.wait_for(lambda: not paths & self._deleting, timeout=timeout)

    def deleted_among(self, paths: Iterable[str]) -> list[str]:
        """Those of ``paths`` that were handed to a delete since last seen (sorted)."""
        with self._lock:
            return sorted(p for p in paths if p in self._deleted)

    def seen(self, path: str) -> None:
        """``path`` exists again (a re-upload): forget its deletion."""
        with self._lock:
            self._deleted.pop(path, None)

    def queued(self) -> int:
        """Jobs not finished yet (queued or running)."""
        with self._lock:
            return len(self._jobs) + int(self._busy)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait (without holding the caller's locks) until the queued deletes are done; False on timeout."""
        with self._lock:
            return self._changed.wait_for(lambda: not self._jobs and not self._busy, timeout=timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued deletes (up to ``timeout``) and stop the thread. Idempotent."""
        self.flush(timeout)
        with self._lock:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # --- running -----------------------------------------------------------------------------------
    def _remember(self, paths: list[str]) -> None:
        for p in paths:
            self._deleted.pop(p, None)
            self._deleted[p] = None
        while len(self._deleted) > _MAX_DELETED:
            del self._deleted[next(iter(self._deleted))]

    def _submit(self, job: _Job) -> int:
        self._seq += 1
        job.seq = self._seq
        if not self.background:
            self._run(job)
            return job.seq
        self._jobs.append(job)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"steward-deletes-{self.storage.state}")
            self._thread.start()
        self._changed.notify_all()
        return job.seq

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._changed.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._busy = False
                    self._changed.notify_all()

    def _run(self, job: _Job) -> None:
        """One job: the record, then the files still unneeded (only if the record they wait for is gone,
        each after a lease check). The storage I/O runs outside the lock unless the caller holds it."""
        if job.checkpoint_id is not None:
            self._run_record(job)
        if not job.files:
            return
        with self._lock:
            if job.after in self._failed_records:
                log.warning("not deleting %d files of %s: the record they belonged to could not be "
                            "deleted (the orphan sweep retries once it is)", len(job.files), self.storage.state)
                return
            held = self._held()
            self._acked_since = set()
        for i, path in enumerate(job.files):
            if not self._fenced(f"{len(job.files) - i} of {len(job.files)} files"):
                return
            self._delete_one(path, held)

    def _fenced(self, what: str) -> bool:
        """Whether this process may still delete in the state root (the lease, checked before every
        delete request); if not, log that ``what`` stays."""
        try:
            self.lease.check()
            return True
        except CheckpointError as exc:   # another writer may hold the state now: not ours to delete
            log.warning("not deleting %s of %s: %s", what, self.storage.state, exc)
            return False

    def _run_record(self, job: _Job) -> None:
        """The record, then the source record it claimed, each after a lease check. A record that stays
        (fenced, or its delete failed) keeps the files queued after it; recovery subsumes it again."""
        assert job.checkpoint_id is not None  # the caller's guard
        cid = job.checkpoint_id
        try:
            deleted = self._fenced(f"checkpoint {cid} (its record and its files)")
            if deleted:
                self.storage.delete_checkpoint_dir(cid)
            if deleted and job.record is not None:
                deleted = self._fenced(f"the source record checkpoint {cid} claimed (and its files)")
                if deleted:
                    self._delete_claimed_record(job.record)
        except Exception as exc:  # noqa: BLE001 - the record stays (recovery subsumes it again), its files too
            log.warning("deleting checkpoint %s of %s failed (recovery subsumes it again): %s", cid,
                        self.storage.state, exc)
            deleted = False
        if not deleted:
            with self._lock:
                self._failed_records.add(job.seq)

    def _delete_one(self, path: str, held: set[str]) -> None:
        """Delete ``path`` unless a record or a pending ack (``held``, and the acks since) references it
        again since it was queued. While the delete runs, ``complete()`` of a checkpoint referencing it
        waits, then finds it gone: a re-upload racing the delete costs a retry, never a lost file."""
        with self._lock:
            if self._needed(path) or path in held or path in self._acked_since:
                return
            self._deleting.add(path)
        try:
            self.storage.delete_files([path])
        except Exception as exc:  # noqa: BLE001 - left as an orphan: the sweep deletes it after the grace
            log.warning("deleting %s of %s failed (the orphan sweep retries): %s", path, self.storage.state, exc)
        finally:
            with self._lock:
                self._deleting.discard(path)
                self._changed.notify_all()

    def _delete_claimed_record(self, meta: CheckpointMetadata) -> None:
        """Delete the source ``_metadata`` a subsumed CLAIM restore took over (its files go as their
        references drop), so the source never lists files this state deletes."""
        url = meta.properties.get("claimed_metadata")
        if not isinstance(url, str) or "://" not in url or not url.endswith("/_metadata"):
            return
        self.storage.delete_claimed([url])
        log.info("deleted the claimed record %s of %s", url, self.storage.state)
        parent = url.split("://", 1)[1].rsplit("/", 1)[0] if url.startswith("file://") else None
        if parent:
            with contextlib.suppress(OSError):
                os.rmdir(parent)  # the empty chk-N directory, locally (object stores have none)
