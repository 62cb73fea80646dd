"""The async phase of checkpoints, off the task's critical path (hosted by the executor agent).

A task hands its local snapshot to :meth:`SnapshotUploader.submit` and returns its rows at once. A
pool of threads prepares the snapshot (its WAL folded into an SST past ``wal-flush-size`` or
``wal-flush-files``, then a fully compacted copy when its files carry too much garbage or are too
many, or when it is small and was just folded, :func:`~sparksteward.state.snapshot.compact_snapshot`),
uploads its new files
(:func:`~sparksteward.checkpoint.task.transfer.upload_snapshot`), deletes the local snapshot (and the copy), and reports
the :class:`UploadResult` to ``on_done`` (the agent acks it to the driver agent's coordinator) or the
error to ``on_error`` (the agent reports the subtask failed, so the coordinator aborts the
checkpoint).

Thread-safe. ``close()`` waits for the uploads in flight (or cancels the queued ones with
``cancel=True``), joins the threads, and is idempotent.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Container, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from sparksteward.checkpoint.records import FileHandle
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task import transfer
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.transfer import UploadResult
from sparksteward.errors import CheckpointError
from sparksteward.state.snapshot import CompactionPolicy, LocalSnapshot, SnapshotCompaction, compact_snapshot, fold_wal

__all__ = ["SnapshotUploader"]

log = logging.getLogger("sparksteward.checkpoint.task.uploader")


class SnapshotUploader:
    """Uploads local snapshots with ``threads`` threads."""

    def __init__(self, threads: int = 4, cache: LocalFileCache | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="steward-upload")
        self._cache = cache
        self._lock = threading.Lock()
        self._closed = False
        self._inflight: set[Future[UploadResult]] = set()

    def submit(self, storage: CheckpointStorage, checkpoint_id: int, subtask: int, snapshot: LocalSnapshot,
               known: Container[str] | Mapping[str, str | tuple[str, int]] = frozenset(),
               on_done: Callable[[int, UploadResult], None] | None = None,
               on_error: Callable[[int, int, BaseException], None] | None = None,
               merge: Callable[[str, Path, str], FileHandle] | None = None,
               merge_below: int = 0, channel: tuple[Path, ...] = (),
               fold_wal_above: int | None = None, fold_wal_files: int | None = None,
               compaction: CompactionPolicy | None = None) -> Future[UploadResult]:
        """Queue the upload of ``snapshot`` (subtask ``subtask`` of checkpoint ``checkpoint_id``). With
        ``fold_wal_above``, a WAL larger than that, or of more than ``fold_wal_files`` files, is first
        folded into an SST (:func:`fold_wal`); then,
        with ``compaction``, a snapshot the policy picks is uploaded as a fully compacted copy
        (:func:`compact_snapshot`)."""
        with self._lock:
            if self._closed:
                raise CheckpointError("the snapshot uploader is closed")

            def work() -> UploadResult:
                compacted: SnapshotCompaction | None = None
                try:
                    folded = False
                    if fold_wal_above is not None:  # decisions 0012, 0021: the WAL past a limit becomes an SST
                        folded = fold_wal(snapshot.path, fold_wal_above, fold_wal_files) > 0
                    if compaction is not None:   # decisions 0019, 0021, after the fold: an SST outgrows its ZSTD WAL
                        compacted = compact_snapshot(snapshot.path, compaction, folded=folded)
                    local = compacted.path if compacted is not None else snapshot.path
                    result = transfer.upload_snapshot(storage, local, subtask, snapshot.key_groups, known=known,
                                                      cache=self._cache, merge=merge, merge_below=merge_below,
                                                      channel=channel)
                except BaseException as exc:
                    log.warning("upload of checkpoint %d subtask %d of %s failed: %s", checkpoint_id, subtask,
                                storage.state, exc)
                    if on_error is not None:
                        on_error(checkpoint_id, subtask, exc)
                    raise
                finally:
                    shutil.rmtree(snapshot.path, ignore_errors=True)
                    if compacted is not None:
                        shutil.rmtree(compacted.path, ignore_errors=True)
                    for p in channel:
                        Path(p).unlink(missing_ok=True)
                if on_done is not None:
                    on_done(checkpoint_id, result)
                return result

            fut = self._pool.submit(work)
            self._inflight.add(fut)
        # outside the lock: a future that is done already runs the callback in this thread
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: Future[UploadResult]) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def pending(self) -> int:
        with self._lock:
            return len(self._inflight)

    def close(self, cancel: bool = False) -> None:
        """Finish (or with ``cancel`` drop the queued) uploads and join the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> SnapshotUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
