"""The checkpoint directory of one state, on any fsspec URL: its layout, ``_metadata``, deletes and
ranged reads.

Layout::

    <checkpoint-dir>/<cluster-id>/<state>/
      chk-<N>/_metadata          CheckpointMetadata (versioned JSON), written atomically
      shared/<xxh3-128 hex>      files, named by content and shared by every checkpoint referencing them
      merged/<uuid>              (FLIP-306) physical files holding several logical files

Files are put all-or-nothing (:meth:`CheckpointStorage.put_file`): local stores stage a temp file,
fsync it and rename it; object stores use one PUT. The executor's transfers (a subtask's upload and
restore) are in :mod:`sparksteward.checkpoint.task.transfer`; the segments of one merged file a
restore needs are read in as few ranged reads as :func:`read_ranges` plans (decision 0021).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle
from sparksteward.errors import CheckpointNotFoundError, StorageError
from sparksteward.ids import validate_id
from sparksteward.storage import Location, fsync_dir, fsync_file, open_location

__all__ = ["DATA_PATH_FORMS", "METADATA_FILE", "RESTORED", "CheckpointStorage", "checkpoint_dir_name", "is_data_path",
           "open_checkpoint", "read_ranges"]

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

    def location_of(self, path: str) -> tuple[Location, str]:
        """The location of a handle path and its path there: relative paths are under this root, an
        absolute URL (a claimed file) opens its own location."""
        if "://" in path:
            loc = open_location(path)
            return loc, loc.root
        return self.location, self.location.path(*path.split("/"))

    # --- files ------------------------------------------------------------------------------
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
