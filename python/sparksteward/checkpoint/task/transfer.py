"""The executor's transfers to and from a state's checkpoint root (:class:`CheckpointStorage`): a
subtask's upload in the async phase and its restore into a local DB directory.

**Upload (async phase).** :func:`upload_snapshot` hashes every file of a local snapshot and uploads to
``shared/<checksum>`` only those whose checksum the caller's registry does not already hold
(incremental checkpoints). Local stores stage a temp file, fsync it and rename it; object stores use
one PUT, which is all-or-nothing (:meth:`CheckpointStorage.put_file`). Content addressing makes a
re-upload of the same bytes harmless.

**Restore.** :func:`restore_subtask` materialises a subtask's files in a local DB directory:
immutable SSTs are hard-linked from the executor's :class:`LocalFileCache` (downloading only the
missing ones), the small mutable files (CURRENT, MANIFEST, OPTIONS) are copied out of it. Every file
is verified against its checksum; a mismatch or a missing file raises an error naming the file and
the checkpoint, and leaves no half-restored directory behind. :func:`fetch_file` brings one file
into the cache the same way (the channel state a task replays).

**One pass per merged file** (decision 0021). The segments a restore still lacks are read by physical
file, in as few ranged reads as :func:`~sparksteward.checkpoint.storage.read_ranges` plans: segments
closer than 64 KB, or that would fill at least half of the range they span, share one read, so a
merged file the subtask mostly needs costs one GET instead of a HEAD and a GET per segment. Each
segment is still verified against its own checksum as it enters the cache.

Thread-safe as far as the storage and the cache are.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle, shared_path
from sparksteward.checkpoint.storage import CheckpointStorage, read_ranges
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.errors import CheckpointCorruptError, CheckpointNotFoundError, StorageError
from sparksteward.hashing import hash_file
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.storage import NotRegularFileError, regular_files

__all__ = ["RestoreStats", "UploadResult", "fetch_file", "restore_subtask", "upload_snapshot"]


@dataclass(frozen=True, slots=True)
class UploadResult:
    """What one subtask's async phase produced: its handle, and what it put in ``shared/``."""

    handle: SubtaskHandle
    uploaded: tuple[str, ...]   # relative paths this attempt uploaded (abort deletes only these)
    bytes_uploaded: int
    files_reused: int
    merged: tuple[str, ...] = ()   # merged/<uuid> physical files its segments went to (sealed later)


@dataclass(frozen=True, slots=True)
class RestoreStats:
    files: int
    downloaded_files: int
    downloaded_bytes: int
    cached_files: int
    fetched_paths: tuple[str, ...]


def _is_immutable(name: str) -> bool:
    """Never changed once a snapshot has it, so the executor's cache keeps it (by checksum): SSTs,
    blob files, and the WAL files of a closed DB (decision 0012)."""
    return name.endswith((".sst", ".blob", ".log"))


def _is_linkable(name: str) -> bool:
    """Hard-linked into a working dir at restore; everything else is copied: RocksDB rewrites CURRENT,
    appends to MANIFEST, and truncates a replayed WAL to its length, so their inodes are never shared
    with the cache."""
    return name.endswith((".sst", ".blob"))


# --- upload (async phase) ----------------------------------------------------------------------------
def upload_snapshot(storage: CheckpointStorage, snapshot_dir: str | os.PathLike[str], subtask: int,
                    key_groups: KeyGroupRange, known: Container[str] | Mapping[str, Any] = frozenset(),
                    cache: LocalFileCache | None = None,
                    merge: Callable[[str, Path, str], FileHandle] | None = None,
                    merge_below: int = 0, channel: tuple[Path, ...] = ()) -> UploadResult:
    """Upload the files of a local snapshot whose checksum ``known`` lacks to ``storage``; return the
    handle.

    ``known`` holds the checksums the registry already has (the files of the base checkpoint).
    As a mapping ``checksum -> path`` (or ``-> (path, offset)`` for a segment of a merged file)
    it also says where a known file lives, so a file of a claimed, restored or merged checkpoint
    keeps its place instead of being uploaded again.

    ``merge(name, local, checksum)``: FLIP-306 file merging. A new file smaller than
    ``merge_below`` bytes is appended to a merged physical file by ``merge``, which returns its
    segment's handle; larger files are uploaded whole to ``shared/<checksum>``.

    ``channel``: FLIP-76 channel-state files of the subtask (its deferred input), stored like the
    other files and listed in the handle's ``channel_state``.
    """
    snapshot_dir = Path(snapshot_dir)
    state_handles: list[FileHandle] = []
    channel_handles: list[FileHandle] = []
    uploaded: list[str] = []
    merged: set[str] = set()
    sent = reused = 0
    try:
        todo = [(p, state_handles) for p in regular_files(snapshot_dir)]
    except NotRegularFileError as exc:
        raise StorageError(f"cannot upload snapshot {snapshot_dir}: {exc}; a snapshot holds only the regular "
                           "files of its DB, so this checkpoint is not taken") from exc
    todo += [(Path(p), channel_handles) for p in channel]
    for local, files in todo:
        checksum = hash_file(local).hex()
        size = local.stat().st_size
        if checksum in known:
            where = known[checksum] if isinstance(known, Mapping) else shared_path(checksum)
            path, offset = (where, 0) if isinstance(where, str) else (str(where[0]), int(where[1]))
            files.append(FileHandle(name=local.name, path=path, length=size, checksum=checksum,
                                    offset=offset))
            reused += 1
            continue
        if merge is not None and size < merge_below:
            seg = merge(local.name, local, checksum)
            files.append(seg)
            merged.add(seg.path)
            sent += size
            if cache is not None and _is_immutable(local.name):
                cache.adopt(local, checksum)
            continue
        rel = shared_path(checksum)
        files.append(FileHandle(name=local.name, path=rel, length=size, checksum=checksum))
        storage.put_file(local, rel)
        uploaded.append(rel)
        sent += size
        if cache is not None and _is_immutable(local.name):
            cache.adopt(local, checksum)
    handle = SubtaskHandle(subtask=subtask, key_groups=key_groups, files=tuple(state_handles),
                           channel_state=tuple(channel_handles))
    return UploadResult(handle, tuple(uploaded), sent, reused, tuple(sorted(merged)))


# --- restore -----------------------------------------------------------------------------------------
def restore_subtask(storage: CheckpointStorage, meta: CheckpointMetadata, handle: SubtaskHandle,
                    db_dir: str | os.PathLike[str], cache: LocalFileCache) -> RestoreStats:
    """Materialise ``handle``'s files (of ``meta``, in ``storage``) in ``db_dir`` (which must not
    exist), verified."""
    db_dir = Path(db_dir)
    if db_dir.exists():
        raise StorageError(f"restore target {db_dir} already exists; restore into a new directory")
    staging = db_dir.parent / f".{db_dir.name}.{uuid.uuid4().hex[:8]}.restoring"
    staging.mkdir(parents=True)
    downloaded = downloaded_bytes = cached = 0
    fetched: list[str] = []
    try:
        with contextlib.ExitStack() as pins:
            ahead = _fetch_segments(storage, meta, handle, cache, pins)   # one pass per merged file
            for f in handle.files:
                with cache.pinned(f.checksum):   # no other open evicts it between the fetch and the link
                    path, hit, n = fetch_file(storage, meta, handle, f, cache)
                    dest = staging / f.name
                    if _is_linkable(f.name):
                        os.link(path, dest)
                    else:  # never share CURRENT's, MANIFEST's or a WAL's inode with the cache
                        shutil.copyfile(path, dest)
                if hit and f.checksum in ahead:   # downloaded above
                    hit, n = False, ahead.pop(f.checksum)
                if not hit:
                    downloaded += 1
                    downloaded_bytes += n
                    fetched.append(f.path)
                else:
                    cached += 1
        os.replace(staging, db_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return RestoreStats(len(handle.files), downloaded, downloaded_bytes, cached, tuple(fetched))


def _fetch_segments(storage: CheckpointStorage, meta: CheckpointMetadata, handle: SubtaskHandle,
                    cache: LocalFileCache, pins: contextlib.ExitStack) -> dict[str, int]:
    """Download the segments of merged files that ``cache`` lacks, by physical file in the ranged
    reads :func:`read_ranges` plans, each verified as it enters the cache and pinned by ``pins``.
    Returns checksum -> bytes downloaded."""
    todo: dict[str, dict[str, FileHandle]] = {}
    for f in handle.files:
        if f.is_segment and not cache.path(f.checksum).exists():
            todo.setdefault(f.path, {}).setdefault(f.checksum, f)
    out: dict[str, int] = {}
    for physical, by_checksum in todo.items():
        loc, path = storage.location_of(physical)
        for start, end, segments in read_ranges(list(by_checksum.values())):
            try:
                data = loc.fs.cat_file(path, start=start, end=end)
            except FileNotFoundError as exc:
                raise _missing(_what(storage, meta, handle, segments[0]), meta) from exc
            except Exception as exc:
                raise StorageError(f"cannot read {_what(storage, meta, handle, segments[0])}: {exc}") from exc
            view = memoryview(data)
            for f in segments:
                pins.enter_context(cache.pinned(f.checksum))
                a = f.offset - start
                _, hit, n = fetch_file(storage, meta, handle, f, cache, view[a:a + f.length])
                if not hit:
                    out[f.checksum] = n
    return out


def _what(storage: CheckpointStorage, meta: CheckpointMetadata, handle: SubtaskHandle, f: FileHandle) -> str:
    loc, path = storage.location_of(f.path)
    return (f"file {f.name} ({loc.display(path)}) of checkpoint {meta.checkpoint_id} of state "
            f"{meta.state!r}, subtask {handle.subtask}")


def fetch_file(storage: CheckpointStorage, meta: CheckpointMetadata, handle: SubtaskHandle, f: FileHandle,
               cache: LocalFileCache, data: memoryview | None = None) -> tuple[Path, bool, int]:
    """File ``f`` of ``handle`` (of ``meta``, in ``storage``) from ``cache``, downloaded and verified
    when missing (or taken from ``data``, its bytes read already).

    Returns the path of the cache entry, whether it was there already, and its length. The caller
    pins ``f.checksum`` (:meth:`LocalFileCache.pinned`) for as long as it uses the path. A missing
    file raises CheckpointNotFoundError and a wrong checksum CheckpointCorruptError, naming the file
    and the checkpoint.
    """
    loc, path = storage.location_of(f.path)
    what = _what(storage, meta, handle, f)

    def open_source():
        if data is not None:
            return io.BytesIO(data)
        try:
            src = loc.fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise _missing(what, meta) from exc
        except Exception as exc:
            raise StorageError(f"cannot read {what}: {exc}") from exc
        if f.offset:
            src.seek(f.offset)
        return src

    def mismatch(actual: str) -> Exception:
        return CheckpointCorruptError(
            f"{what} is corrupt: expected checksum {f.checksum}, read {actual}; nothing was restored. "
            f"{_fix(meta)}")

    try:
        return cache.fetch(f.checksum, open_source, f.length, mismatch)
    except (CheckpointCorruptError, CheckpointNotFoundError, StorageError):
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{what} is missing: {exc}") from exc


def _missing(what: str, meta: CheckpointMetadata) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{what} is missing: the checkpoint is incomplete (deleted by hand, or by a gc "
                                   f"that did not know it); {_fix(meta)}")


def _fix(meta: CheckpointMetadata) -> str:
    """What to do about a bad file of ``meta``: for a restored starting point, restore another one."""
    source = meta.properties.get("restored_from")
    if source:
        return (f"It was restored from {source}: start the state again with restore_from= another retained "
                f"checkpoint or a savepoint")
    return "Restore an older checkpoint"
