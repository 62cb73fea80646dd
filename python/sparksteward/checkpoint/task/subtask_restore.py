"""Rescale keyed state: build new subtask ``j`` of parallelism ``P_new`` from a checkpoint taken at
``P_old``, with the same max parallelism (Flink's ClipDB/IngestDB, without either API).

1. **Base.** Restore the old DB whose key groups overlap ``j``'s range the most (its files only), then
   ``delete_range`` everything outside ``j``'s range (``compact=True`` also drops the bytes).
2. **Ingest.** For every other overlapping old DB: restore its files into a scratch dir, open it
   read-only, read only the overlap with a bounded iterator into an ``SstFileWriter`` file, and ingest
   that file. (rocksdict's ``ingest_external_file`` accepts only ``SstFileWriter`` files, so old SSTs
   cannot be ingested directly.)

Only the old subtasks whose key groups overlap ``j``'s range are read; :class:`RescaleStats` lists
them and the files fetched, so tests can check it. Changing the max parallelism is refused, as in
Flink: key groups are the unit of state, and a different count would move every key.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle, check_max_parallelism
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.transfer import restore_subtask
from sparksteward.errors import StateEncodingError
from sparksteward.state.keygroups import KeyGroupRange, KeyType, key_group_range, validate_parallelism

if TYPE_CHECKING:   # RocksDB is imported where a DB is opened: the driver agent checks max parallelism only
    from sparksteward.state.backend import RocksDBStateBackend

__all__ = ["RescaleStats", "open_read_only", "open_subtask", "overlapping_subtasks", "prepare_subtask",
           "rebuild_subtask", "restore_subtask_backend"]

log = logging.getLogger("sparksteward.checkpoint.task.subtask_restore")


@dataclass(frozen=True, slots=True)
class RescaleStats:
    subtask: int
    key_groups: KeyGroupRange
    base: int | None                        # the old subtask restored as the base DB
    ingested_from: tuple[int, ...]          # old subtasks whose overlap was ingested
    files_read: tuple[str, ...]             # handle paths of every old file materialised
    files_downloaded: int
    keys_ingested: int
    seconds: float
    bytes_read: int = 0                     # total length of the files in files_read
    bytes_downloaded: int = 0               # of those, what was not in the local file cache
    old_parallelism: int | None = None      # the parallelism of the checkpoint restored from
    expired_dropped: int = 0                # expired state entries (TTL) not copied from other subtasks

    def to_json(self) -> dict[str, object]:
        """What the executor agent reports for one restored subtask (plain JSON)."""
        return {"subtask": self.subtask, "key_groups": self.key_groups.to_json(), "base": self.base,
                "ingested_from": list(self.ingested_from), "files_read": list(self.files_read),
                "bytes_read": self.bytes_read, "files_downloaded": self.files_downloaded,
                "bytes_downloaded": self.bytes_downloaded, "keys_ingested": self.keys_ingested,
                "seconds": round(self.seconds, 4), "old_parallelism": self.old_parallelism,
                "expired_dropped": self.expired_dropped}


def overlapping_subtasks(meta: CheckpointMetadata, new_range: KeyGroupRange) -> list[tuple[SubtaskHandle, int]]:
    """Old subtasks overlapping ``new_range``, largest overlap first (ties: lower index first)."""
    found = [(h, h.key_groups.overlap(new_range)) for h in meta.subtasks]
    return sorted(((h, n) for h, n in found if n > 0), key=lambda hn: (-hn[1], hn[0].subtask))


def open_subtask(storage: CheckpointStorage, base: CheckpointMetadata | None, parallelism: int, index: int,
                 workdir: str | Path, cache: LocalFileCache, *, max_parallelism: int,
                 key_type: KeyType | str = KeyType.STRING, compact: bool = False, now_ms: int | None = None,
                 ) -> tuple[RocksDBStateBackend, RescaleStats | None]:
    """What a task does before it processes checkpoint N: open subtask ``index``'s DB in ``workdir``.

    A new, empty DB when ``base`` is None (the first checkpoint of a new state); otherwise ``base``'s
    files restored, rescaled when ``parallelism`` differs from the base's. A changed max parallelism or
    key type is refused.
    """
    from sparksteward.state.backend import RocksDBStateBackend

    if base is None:
        return RocksDBStateBackend(workdir, key_group_range(max_parallelism, parallelism, index), max_parallelism,
                                   key_type, create=True), None
    backend, stats = _rebuild(storage, base, parallelism, index, workdir, cache, max_parallelism=max_parallelism,
                              key_type=key_type, compact=compact, now_ms=now_ms, keep_open=True)
    assert backend is not None
    return backend, stats


def prepare_subtask(storage: CheckpointStorage, base: CheckpointMetadata | None, parallelism: int, index: int,
                    workdir: str | Path, cache: LocalFileCache, *, max_parallelism: int,
                    key_type: KeyType | str = KeyType.STRING, now_ms: int | None = None) -> RescaleStats | None:
    """:func:`open_subtask` for a DB that someone else opens next (the executor agent builds the
    directory, the task opens it): the DB is opened here only when it must change (a new DB is created;
    a rescale deletes and ingests key groups). Restoring the base's own key groups links its files and
    leaves the DB unopened, so its WAL is replayed once, by the task, instead of twice."""
    if base is None:   # a new, empty DB
        open_subtask(storage, None, parallelism, index, workdir, cache, max_parallelism=max_parallelism,
                     key_type=key_type)[0].close()
        return None
    backend, stats = _rebuild(storage, base, parallelism, index, workdir, cache, max_parallelism=max_parallelism,
                              key_type=key_type, compact=False, now_ms=now_ms, keep_open=False)
    if backend is not None:
        backend.close()
    return stats


def restore_subtask_backend(storage: CheckpointStorage, meta: CheckpointMetadata, index: int,
                            workdir: str | Path, cache: LocalFileCache, *, max_parallelism: int | None = None,
                            parallelism: int | None = None, compact: bool = False,
                            ) -> tuple[RocksDBStateBackend, RescaleStats]:
    """Open subtask ``index``'s DB in ``workdir`` from ``meta``, rescaling if ``parallelism`` differs."""
    parallelism = meta.parallelism if parallelism is None else parallelism
    return rebuild_subtask(storage, meta, parallelism, index, workdir, cache,
                           max_parallelism=max_parallelism, compact=compact)


def open_read_only(storage: CheckpointStorage, meta: CheckpointMetadata, handle: SubtaskHandle,
                   workdir: str | Path, cache: LocalFileCache) -> RocksDBStateBackend:
    """Subtask ``handle`` of ``meta`` restored into ``workdir`` as it is and opened read-only, for an offline
    read: no rescale, and RocksDB writes nothing (a writable open writes a MANIFEST and syncs it)."""
    from sparksteward.state.backend import DB_DIR, RocksDBStateBackend

    if not handle.files:   # a subtask that never held state: an empty DB
        return restore_subtask_backend(storage, meta, handle.subtask, workdir, cache)[0]
    restore_subtask(storage, meta, handle, Path(workdir) / DB_DIR, cache)
    return RocksDBStateBackend(workdir, handle.key_groups, meta.max_parallelism, meta.key_type, create=False,
                               read_only=True)


def rebuild_subtask(storage: CheckpointStorage, meta: CheckpointMetadata, new_parallelism: int, index: int,
                    workdir: str | Path, cache: LocalFileCache, *, max_parallelism: int | None = None,
                    compact: bool = False, now_ms: int | None = None) -> tuple[RocksDBStateBackend, RescaleStats]:
    """Build subtask ``index`` of ``new_parallelism`` in ``workdir`` (which must hold no DB).

    With ``now_ms`` (the batch's processing time), the entries copied from other old subtasks skip
    what a TTL expired by then (values, list elements and map entries, and their expiry index keys),
    so a rescale drops expired state instead of copying it; the base's own are swept by later batches.

    Returns the open backend (the caller closes it) and what was read.
    """
    backend, stats = _rebuild(storage, meta, new_parallelism, index, workdir, cache, max_parallelism=max_parallelism,
                              key_type=None, compact=compact, now_ms=now_ms, keep_open=True)
    assert backend is not None
    return backend, stats


def _rebuild(storage: CheckpointStorage, meta: CheckpointMetadata, new_parallelism: int, index: int,
             workdir: str | Path, cache: LocalFileCache, *, max_parallelism: int | None,
             key_type: KeyType | str | None, compact: bool, now_ms: int | None,
             keep_open: bool) -> tuple[RocksDBStateBackend | None, RescaleStats]:
    """:func:`rebuild_subtask`, also refusing another ``key_type`` (when given) and, unless
    ``keep_open``, leaving unopened (None) a DB that needs no change."""
    from sparksteward.state.backend import DB_DIR, RocksDBStateBackend

    started = time.perf_counter()
    m = meta.max_parallelism if max_parallelism is None else max_parallelism
    check_max_parallelism(meta, m)
    if key_type is not None and KeyType.parse(key_type) is not meta.key_type:
        raise StateEncodingError(
            f"state {meta.state!r} was checkpointed with {meta.key_type.value} keys (checkpoint "
            f"{meta.checkpoint_id}); it cannot continue with {KeyType.parse(key_type).value} keys: cast the key "
            f"column to {meta.key_type.value}")
    validate_parallelism(new_parallelism, m)
    new_range = key_group_range(m, new_parallelism, index)
    workdir = Path(workdir)
    overlaps = [(h, n) for h, n in overlapping_subtasks(meta, new_range) if h.files]
    files_read: list[str] = []
    downloaded = downloaded_bytes = 0
    keys = dropped = 0
    if not overlaps:
        backend = RocksDBStateBackend(workdir, new_range, m, meta.key_type, create=True)
        return backend, RescaleStats(index, new_range, None, (), (), 0, 0, time.perf_counter() - started,
                                     old_parallelism=meta.parallelism)

    base, _ = overlaps[0]
    st = restore_subtask(storage, meta, base, workdir / DB_DIR, cache)
    files_read += [f.path for f in base.files]
    read_bytes = sum(f.length for f in base.files)
    downloaded += st.downloaded_files
    downloaded_bytes += st.downloaded_bytes
    if not keep_open and base.key_groups == new_range and len(overlaps) == 1:   # nothing to change: leave it closed
        return None, RescaleStats(index, new_range, base.subtask, (), tuple(files_read), downloaded, 0,
                                  time.perf_counter() - started, bytes_read=read_bytes,
                                  bytes_downloaded=downloaded_bytes, old_parallelism=meta.parallelism)
    backend = RocksDBStateBackend(workdir, new_range, m, meta.key_type, create=False)
    try:
        if base.key_groups != new_range:
            backend.delete_outside(new_range, compact=compact)
        ingested = []
        for other, _ in overlaps[1:]:
            scratch = workdir.parent / f".{workdir.name}.rescale-{other.subtask}-{uuid.uuid4().hex[:8]}"
            try:
                st = restore_subtask(storage, meta, other, scratch / DB_DIR, cache)
                files_read += [f.path for f in other.files]
                read_bytes += sum(f.length for f in other.files)
                downloaded += st.downloaded_files
                downloaded_bytes += st.downloaded_bytes
                sst = scratch / "overlap.sst"
                with RocksDBStateBackend(scratch, other.key_groups, m, meta.key_type, create=False,
                                         read_only=True) as old:
                    n, skipped = _write_sst(old, other.key_groups.intersect(new_range), sst, now_ms)
                dropped += skipped
                if n:
                    backend.ingest([sst])
                    keys += n
                ingested.append(other.subtask)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        backend.close()
        shutil.rmtree(workdir / DB_DIR, ignore_errors=True)  # nothing half-built stays behind
        raise
    stats = RescaleStats(index, new_range, base.subtask, tuple(ingested), tuple(files_read), downloaded, keys,
                         time.perf_counter() - started, bytes_read=read_bytes, bytes_downloaded=downloaded_bytes,
                         old_parallelism=meta.parallelism, expired_dropped=dropped)
    log.log(logging.INFO if ingested or base.key_groups != new_range else logging.DEBUG,  # DEBUG: no rescale
            "rebuilt subtask %d %s of %s from old subtasks %s (base %d) in %.2f s", index, new_range,
            meta.state, [base.subtask, *ingested], base.subtask, stats.seconds)
    return backend, stats


def _write_sst(old: RocksDBStateBackend, groups: KeyGroupRange, target: Path,
               now_ms: int | None = None) -> tuple[int, int]:
    """Copy the entries of ``groups`` into one SstFileWriter file, without what expired at ``now_ms``;
    return how many were copied (0 writes nothing) and how many expired ones were left out."""
    import rocksdict

    from sparksteward.state.rocksdb_options import db_options
    from sparksteward.state.rows import expired
    from sparksteward.state.typed import KIND_EXPIRY, index_expiry

    writer = None
    n = skipped = 0
    for k, v in old.iter_raw(groups):
        if now_ms is not None and (expired(v, now_ms) or (k[2:3] == KIND_EXPIRY and index_expiry(k) <= now_ms)):
            skipped += k[2:3] != KIND_EXPIRY
            continue
        if writer is None:
            writer = rocksdict.SstFileWriter(options=db_options(create=False))
            writer.open(str(target))
        writer[k] = v
        n += 1
    if writer is not None:
        writer.finish()
    return n, skipped
