"""The checkpoint directory of one state, on any fsspec URL: uploads, ``_metadata`` and restores.

Layout::

    <checkpoint-dir>/<cluster-id>/<state>/
      chk-<N>/_metadata          CheckpointMetadata (versioned JSON), written atomically
      shared/<xxh3-128 hex>      files, named by content and shared by every checkpoint referencing them
      merged/<uuid>              (FLIP-306, later) physical files holding several logical files

**Upload (async phase).** :meth:`CheckpointStorage.upload_snapshot` hashes every file of a local
snapshot and uploads to ``shared/<checksum>`` only those whose checksum the caller's registry does not
already hold (incremental checkpoints). Local stores stage a temp file, fsync it and rename it; object
stores use one PUT, which is all-or-nothing. Content addressing makes a re-upload of the same bytes
harmless.

**Restore.** :meth:`CheckpointStorage.restore_subtask` materialises a subtask's files in a local DB
directory: immutable SSTs are hard-linked from the executor's :class:`LocalFileCache` (downloading only
the missing ones), the small mutable files (CURRENT, MANIFEST, OPTIONS) are copied out of it. Every
file is verified against its checksum; a mismatch or a missing file raises an error naming the file
and the checkpoint, and leaves no half-restored directory behind.

**One pass per merged file** (decision 0021). The segments a restore still lacks are read by physical
file, in as few ranged reads as :func:`read_ranges` plans: segments closer than 64 KB, or that would
fill at least half of the range they span, share one read, so a merged file the subtask mostly needs
costs one GET instead of a HEAD and a GET per segment. Each segment is still verified against its
own checksum as it enters the cache.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sparksteward.hashing import hash_file
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle, shared_path
from sparksteward.errors import CheckpointCorruptError, CheckpointNotFoundError, StorageError
from sparksteward.ids import validate_id
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.storage import Location, NotRegularFileError, fsync_dir, fsync_file, open_location, regular_files

__all__ = ["DATA_PATH_FORMS", "METADATA_FILE", "RESTORED", "CheckpointStorage", "RestoreStats", "UploadResult",
           "checkpoint_dir_name", "is_data_path", "open_checkpoint", "read_ranges"]

log = logging.getLogger("sparksteward.checkpoint.storage")

METADATA_FILE = "_metadata"
_CHK = re.compile(r"^chk-(\d+)$")
MERGED_DIR = "merged"   # FLIP-306 physical files (see checkpoint/filemerging/file_merger.py)
_DATA_NAME = re.compile(r"^[0-9a-f]{32}$")                    # an xxh3-128 checksum or a uuid4 hex
_STAGED_NAME = re.compile(r"^\.[A-Za-z0-9_-][A-Za-z0-9._-]*\.tmp$")   # a staged upload (see staged_files)
DATA_PATH_FORMS = "shared/<32 hex checksum> or merged/<32 hex>"
#: segments of one merged file closer than this share a ranged read at restore
RANGE_MAX_GAP = 64 << 10
#: ... or when they fill at least this share of the range they would span
RANGE_MIN_SHARE = 0.5
#: the most bytes one ranged read holds in memory
RANGE_MAX_BYTES = 64 << 20


def is_data_path(path: str) -> bool:
    """True for a data file of a state root exactly: ``shared/<32 hex>`` or ``merged/<32 hex>``.

    Anything else (``chk-0/_metadata``, ``shared/../x``, a nested path, a URL) is not one, so a path
    a peer sends cannot be taken for one.
    """
    head, _, name = path.partition("/") if isinstance(path, str) else ("", "", "")
    return head in ("shared", MERGED_DIR) and bool(_DATA_NAME.match(name))


def _deletable(path: str) -> bool:
    """A data file, or a staged upload of one that a crash left behind."""
    head, _, name = path.partition("/")
    return is_data_path(path) or (head in ("shared", MERGED_DIR) and bool(_STAGED_NAME.match(name)))


RESTORED = -1  # the id under which a restored (restore_from) checkpoint is kept: ``restored/_metadata``


def checkpoint_dir_name(checkpoint_id: int) -> str:
    """``chk-<N>``, or ``restored`` for the checkpoint a state was restored from."""
    return "restored" if checkpoint_id == RESTORED else f"chk-{checkpoint_id}"


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


def read_ranges(segments: list[FileHandle], max_gap: int = RANGE_MAX_GAP, min_share: float = RANGE_MIN_SHARE,
                max_bytes: int = RANGE_MAX_BYTES) -> list[tuple[int, int, list[FileHandle]]]:
    """The ranged reads ``(start, end, segments)`` that fetch ``segments`` (of one physical file).

    In offset order, a segment joins the current read when the gap to it is at most ``max_gap``, or
    when the segments would fill at least ``min_share`` of the range they span (most of the file is
    needed: one read is cheaper than several), as long as the read stays within ``max_bytes``.
    """
    out: list[tuple[int, int, list[FileHandle]]] = []
    need = 0
    for f in sorted(segments, key=lambda x: (x.offset, x.length)):
        end = f.offset + f.length
        if out:
            start, last, members = out[-1]
            span = max(last, end) - start
            if span <= max_bytes and (f.offset - last <= max_gap or need + f.length >= min_share * span):
                out[-1] = (start, max(last, end), [*members, f])
                need += f.length
                continue
        out.append((f.offset, end, [f]))
        need = f.length
    return out


def _is_immutable(name: str) -> bool:
    """Never changed once a snapshot has it, so the executor's cache keeps it (by checksum): SSTs,
    blob files, and the WAL files of a closed DB (decision 0012)."""
    return name.endswith((".sst", ".blob", ".log"))


def _is_linkable(name: str) -> bool:
    """Hard-linked into a working dir at restore; everything else is copied: RocksDB rewrites CURRENT,
    appends to MANIFEST, and truncates a replayed WAL to its length, so their inodes are never shared
    with the cache."""
    return name.endswith((".sst", ".blob"))


class CheckpointStorage:
    """The checkpoint root of one state. Thread-safe as far as the fsspec backend is."""

    def __init__(self, location: Location, state: str) -> None:
        self.location = location
        self.state = state

    @classmethod
    def open(cls, checkpoint_dir: str, state: str, cluster_id: str = "default",
             **storage_options: object) -> CheckpointStorage:
        """``<checkpoint_dir>/<cluster_id>/<state>``."""
        validate_id(state, "state name")
        validate_id(cluster_id, "cluster id")
        return cls(open_location(checkpoint_dir, **storage_options).child(cluster_id, state), state)

    @property
    def url(self) -> str:
        return self.location.url

    def url_of(self, path: str) -> str:
        """The full URL of a handle path (relative paths are under this root)."""
        return path if "://" in path else posixpath.join(self.location.url, path)

    def _abs(self, path: str) -> tuple[Location, str]:
        if "://" in path:
            loc = open_location(path)
            return loc, loc.root
        return self.location, self.location.path(*path.split("/"))

    # --- upload (async phase) ----------------------------------------------------------------
    def upload_snapshot(self, snapshot_dir: str | os.PathLike[str], subtask: int, key_groups: KeyGroupRange,
                        known: Container[str] | Mapping[str, Any] = frozenset(),
                        cache: LocalFileCache | None = None,
                        merge: Callable[[str, Path, str], FileHandle] | None = None,
                        merge_below: int = 0, channel: tuple[Path, ...] = ()) -> UploadResult:
        """Upload the files of a local snapshot whose checksum ``known`` lacks; return the handle.

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
            self._put(local, rel)
            uploaded.append(rel)
            sent += size
            if cache is not None and _is_immutable(local.name):
                cache.adopt(local, checksum)
        handle = SubtaskHandle(subtask=subtask, key_groups=key_groups, files=tuple(state_handles),
                               channel_state=tuple(channel_handles))
        return UploadResult(handle, tuple(uploaded), sent, reused, tuple(sorted(merged)))

    def put_file(self, local: Path, rel: str) -> None:
        """Upload ``local`` to the relative path ``rel`` all-or-nothing (stage, fsync, rename; one PUT)."""
        self._put(local, rel)

    def local_target(self, rel: str) -> str:
        """The local path of ``rel`` (local stores only: ``across`` file merging appends there)."""
        if not self.location.is_local:
            raise StorageError(f"{self.url} is not a local store")
        return self.location.path(*rel.split("/"))

    def _put(self, local: Path, rel: str) -> None:
        loc = self.location
        target = loc.path(*rel.split("/"))
        try:
            if loc.is_local:
                directory = os.path.dirname(target)
                os.makedirs(directory, exist_ok=True)
                tmp = os.path.join(directory, f".{os.path.basename(target)}.{uuid.uuid4().hex[:8]}.tmp")
                try:
                    shutil.copyfile(local, tmp)
                    fsync_file(tmp)
                    os.replace(tmp, target)  # content-addressed: the same bytes either way
                    fsync_dir(directory)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
            else:
                loc.fs.put_file(str(local), target)  # one PUT (or multipart upload): all or nothing
        except Exception as exc:  # backend errors become ours at this boundary
            raise StorageError(f"cannot upload {local} to {loc.display(target)}: {exc}") from exc

    # --- metadata ----------------------------------------------------------------------------
    def metadata_path(self, checkpoint_id: int) -> str:
        return self.location.path(checkpoint_dir_name(checkpoint_id), METADATA_FILE)

    def write_metadata(self, meta: CheckpointMetadata, as_id: int | None = None) -> str:
        """Write ``chk-<N>/_metadata`` (or ``restored/_metadata`` for RESTORED) atomically; return its URL."""
        path = self.metadata_path(meta.checkpoint_id if as_id is None else as_id)
        self.location.write_atomic(path, meta.to_bytes())
        return self.location.display(path)

    def read_metadata(self, checkpoint_id: int) -> CheckpointMetadata:
        path = self.metadata_path(checkpoint_id)
        source = self.location.display(path)
        try:
            data = self.location.read_bytes(path)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} of state {self.state!r} has no {source}: it was never completed "
                f"or has been subsumed") from exc
        return CheckpointMetadata.from_bytes(data, source)

    def checkpoint_ids(self) -> list[int]:
        """Ids of the ``chk-<N>`` directories that hold a ``_metadata`` file, ascending."""
        ids = []
        for info in self.location.listdir():
            m = _CHK.match(posixpath.basename(info["name"].rstrip("/")))
            if m and self.location.exists(self.metadata_path(int(m.group(1)))):
                ids.append(int(m.group(1)))
        return sorted(ids)

    def has_restored(self) -> bool:
        return self.location.exists(self.metadata_path(RESTORED))

    def delete_checkpoint_dir(self, checkpoint_id: int) -> None:
        self.location.delete(self.location.path(checkpoint_dir_name(checkpoint_id)), recursive=True)

    def shared_files(self) -> set[str]:
        """Relative paths of every file under ``shared/`` (staged temp files excluded)."""
        out = set()
        for info in self.location.listdir(self.location.path("shared")):
            name = posixpath.basename(info["name"].rstrip("/"))
            if not name.startswith("."):
                out.add(posixpath.join("shared", name))
        return out

    def merged_files(self) -> set[str]:
        """Relative paths of every physical file under ``merged/`` (FLIP-306; staged temps excluded)."""
        out = set()
        for info in self.location.listdir(self.location.path(MERGED_DIR)):
            name = posixpath.basename(info["name"].rstrip("/"))
            if not name.startswith("."):
                out.add(posixpath.join(MERGED_DIR, name))
        return out

    def stored_files(self) -> set[str]:
        """Every data file of this state: ``shared/`` and ``merged/``."""
        return self.shared_files() | self.merged_files()

    def missing(self, paths: Iterable[str], list_above: int = 8) -> list[str]:
        """Of the relative data ``paths``, those not in the store: one existence check (a HEAD) per
        path, or, past ``list_above`` paths, one listing of ``shared/`` and ``merged/``. Nothing is
        answered from a cached listing."""
        paths = sorted(set(paths))
        if len(paths) > list_above:
            stored = self.stored_files()
            return [p for p in paths if p not in stored]
        out = []
        for p in paths:
            full = self.location.path(*p.split("/"))
            with contextlib.suppress(Exception):
                self.location.fs.invalidate_cache(full)
            if not self.location.exists(full):
                out.append(p)
        return out

    def file_times(self) -> dict[str, float]:
        """Every data file and staged upload under ``shared/`` and ``merged/`` -> when it last changed
        (epoch seconds). Locally the later of mtime and ctime: a hard link made by a restore keeps
        the source's old mtime but gets a new ctime."""
        out: dict[str, float] = {}
        for sub in ("shared", MERGED_DIR):
            for info in self.location.listdir(self.location.path(sub)):
                name = posixpath.basename(info["name"].rstrip("/"))
                if name.startswith(".") and not name.endswith(".tmp"):
                    continue
                out[posixpath.join(sub, name)] = _changed_at(info)
        return out

    def staged_files(self) -> set[str]:
        """Relative paths of staged uploads left under ``shared/`` or ``merged/`` by a crash (local stores)."""
        out = set()
        for sub in ("shared", MERGED_DIR):
            for info in self.location.listdir(self.location.path(sub)):
                name = posixpath.basename(info["name"].rstrip("/"))
                if name.startswith(".") and name.endswith(".tmp"):
                    out.add(posixpath.join(sub, name))
        return out

    def delete_files(self, paths: list[str]) -> int:
        """Delete data files of this root (:func:`is_data_path`, and staged uploads of them); return
        how many existed.

        Anything else (a ``_metadata``, a path outside ``shared/`` and ``merged/``, an absolute URL:
        claimed files go through :meth:`delete_claimed`) is never deleted: it is logged as an error
        and skipped, so a bad path cannot fail the caller half-way through its deletions either.
        """
        n = 0
        for p in paths:
            if not isinstance(p, str) or not _deletable(p):
                log.error("not deleting %r in %s: only data files (%s) are deleted here", p, self.url,
                          DATA_PATH_FORMS)
                continue
            if self.location.delete(self.location.path(*p.split("/"))):
                n += 1
        return n

    def delete_claimed(self, urls: list[str]) -> int:
        """Delete absolute-URL files this state took over with CLAIM (the coordinator decides which:
        only files a claimed checkpoint listed). Relative paths are refused here."""
        n = 0
        for url in urls:
            if "://" not in url:
                raise StorageError(f"delete_claimed takes absolute URLs, not {url!r}")
            loc = open_location(url)
            if loc.delete(loc.root):
                n += 1
        return n

    # --- restore -----------------------------------------------------------------------------
    def restore_subtask(self, meta: CheckpointMetadata, handle: SubtaskHandle, db_dir: str | os.PathLike[str],
                        cache: LocalFileCache) -> RestoreStats:
        """Materialise ``handle``'s files in ``db_dir`` (which must not exist), verified."""
        db_dir = Path(db_dir)
        if db_dir.exists():
            raise StorageError(f"restore target {db_dir} already exists; restore into a new directory")
        staging = db_dir.parent / f".{db_dir.name}.{uuid.uuid4().hex[:8]}.restoring"
        staging.mkdir(parents=True)
        downloaded = downloaded_bytes = cached = 0
        fetched: list[str] = []
        try:
            with contextlib.ExitStack() as pins:
                ahead = self._fetch_segments(meta, handle, cache, pins)   # one pass per merged file
                for f in handle.files:
                    with cache.pinned(f.checksum):   # no other open evicts it between the fetch and the link
                        path, hit, n = self._fetch(meta, handle, f, cache)
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

    def _fetch_segments(self, meta: CheckpointMetadata, handle: SubtaskHandle, cache: LocalFileCache,
                        pins: contextlib.ExitStack) -> dict[str, int]:
        """Download the segments of merged files that ``cache`` lacks, by physical file in the ranged
        reads :func:`read_ranges` plans, each verified as it enters the cache and pinned by ``pins``.
        Returns checksum -> bytes downloaded."""
        todo: dict[str, dict[str, FileHandle]] = {}
        for f in handle.files:
            if f.is_segment and not cache.path(f.checksum).exists():
                todo.setdefault(f.path, {}).setdefault(f.checksum, f)
        out: dict[str, int] = {}
        for physical, by_checksum in todo.items():
            loc, path = self._abs(physical)
            for start, end, segments in read_ranges(list(by_checksum.values())):
                try:
                    data = loc.fs.cat_file(path, start=start, end=end)
                except FileNotFoundError as exc:
                    raise _missing(self._what(meta, handle, segments[0]), meta) from exc
                except Exception as exc:
                    raise StorageError(f"cannot read {self._what(meta, handle, segments[0])}: {exc}") from exc
                view = memoryview(data)
                for f in segments:
                    pins.enter_context(cache.pinned(f.checksum))
                    a = f.offset - start
                    _, hit, n = self._fetch(meta, handle, f, cache, view[a:a + f.length])
                    if not hit:
                        out[f.checksum] = n
        return out

    def _what(self, meta: CheckpointMetadata, handle: SubtaskHandle, f: FileHandle) -> str:
        loc, path = self._abs(f.path)
        return (f"file {f.name} ({loc.display(path)}) of checkpoint {meta.checkpoint_id} of state "
                f"{meta.state!r}, subtask {handle.subtask}")

    def _fetch(self, meta: CheckpointMetadata, handle: SubtaskHandle, f: FileHandle,
               cache: LocalFileCache, data: memoryview | None = None) -> tuple[Path, bool, int]:
        """``f`` from ``cache``, downloaded when missing (or taken from ``data``, its bytes read already)."""
        loc, path = self._abs(f.path)
        what = self._what(meta, handle, f)

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


def _changed_at(info: dict[str, Any]) -> float:
    """When a listed file last changed: the later of mtime and ctime locally, LastModified on S3."""
    times = []
    for key in ("mtime", "created", "LastModified", "last_modified", "updated"):
        value = info.get(key)
        if isinstance(value, datetime):
            value = value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            times.append(float(value))
    return max(times, default=float("inf"))   # unknown: never old enough to sweep


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


def open_checkpoint(url: str) -> tuple[CheckpointStorage, CheckpointMetadata]:
    """Open a retained checkpoint or savepoint for ``restore_from``.

    ``url`` names a ``chk-<N>`` directory, its ``_metadata`` file, or a savepoint directory holding a
    ``_metadata``. Returns the storage of the state root the checkpoint's relative paths resolve
    against, and the parsed record. Anything else raises CheckpointNotFoundError naming ``url``.
    """
    text = url.rstrip("/")
    if posixpath.basename(text) == METADATA_FILE:
        text = posixpath.dirname(text)
    loc = open_location(text)
    meta_path = loc.path(METADATA_FILE)
    try:
        data = loc.read_bytes(meta_path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(
            f"restore_from={url!r} is not a checkpoint: {loc.display(meta_path)} does not exist. Pass a "
            f"retained checkpoint directory (<checkpoint-dir>/<cluster>/<state>/chk-<N>) or a savepoint "
            f"directory") from exc
    meta = CheckpointMetadata.from_bytes(data, loc.display(meta_path))
    name = posixpath.basename(text)
    parent = posixpath.dirname(text)
    if _CHK.match(name):  # relative paths resolve against the state root, the parent of chk-<N>
        return CheckpointStorage(open_location(parent), meta.state), meta
    return CheckpointStorage(loc, meta.state), meta  # a savepoint is self-contained
