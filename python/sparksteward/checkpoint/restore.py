"""Starting a state from another state's checkpoint (``restore_from``), and savepoints.

- **NO_CLAIM** (default, Flink's default too): the source's files are *duplicated* into this state's
  ``shared/`` by fast duplication (S3 CopyObject, local hard links), so no bytes pass through the
  process and the source stays untouched and owned by its state.
- **CLAIM**: nothing is copied; the restored record points at the source's files by absolute URL and
  this state takes ownership of them (and of the source's ``_metadata``): once later checkpoints
  subsume them, its coordinator deletes them (only files the claimed checkpoint listed, never anything
  else of the source). The source state must not be run again, and its other checkpoints may share
  claimed files (incremental checkpoints do), so they are not restorable afterwards either: claim
  only a state you are done with, as in Flink.
- **Savepoint**: a self-contained copy of a checkpoint at any URL (``<url>/_metadata`` and
  ``<url>/shared/...``), made by the same duplication, restorable elsewhere.

Either restore writes ``restored/_metadata`` in this state's directory (see
:data:`~sparksteward.checkpoint.storage.RESTORED`): the coordinator then uses it as the base of the
first checkpoint and counts its files, so later checkpoints never upload them again.

**Nothing half-written.** Before anything is written, the source's record is read (not a checkpoint,
a newer version, another max parallelism or key type are refused) and every file it lists is checked
to exist with its length (one listing per directory; no bytes are read). Files are copied first and
the record last (``_metadata`` is the commit marker); if a copy fails, the files this call copied are
deleted again. Contents are verified against their checksums where the bytes are read: by the
executors, when a task restores its subtask.
"""

from __future__ import annotations

import enum
import logging
import os
import posixpath
from dataclasses import replace

from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.merging import is_merged
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle, shared_path
from sparksteward.checkpoint.rescale import check_max_parallelism
from sparksteward.checkpoint.storage import MERGED_DIR, METADATA_FILE, RESTORED, CheckpointStorage, open_checkpoint
from sparksteward.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StateEncodingError,
    StewardError,
)
from sparksteward.state.keygroups import KeyType
from sparksteward.storage import open_location

__all__ = ["ClaimMode", "check_sources", "restore_from", "write_savepoint"]

log = logging.getLogger("sparksteward.checkpoint.restore")


class ClaimMode(str, enum.Enum):
    NO_CLAIM = "no_claim"
    CLAIM = "claim"

    @classmethod
    def parse(cls, value: object) -> ClaimMode:
        try:
            return value if isinstance(value, ClaimMode) else cls(str(value).lower())
        except ValueError:
            raise CheckpointError(f"claim_mode={value!r} is not valid: use 'no_claim' or 'claim'") from None


def _map_files(meta: CheckpointMetadata, new_path) -> CheckpointMetadata:
    def one(f: FileHandle) -> FileHandle:
        return replace(f, path=new_path(f))

    subtasks = tuple(SubtaskHandle(s.subtask, s.key_groups, tuple(one(f) for f in s.files),
                                   tuple(one(f) for f in s.channel_state)) for s in meta.subtasks)
    return replace(meta, subtasks=subtasks)


def check_sources(src: CheckpointStorage, meta: CheckpointMetadata, url: str) -> None:
    """Refuse a checkpoint whose files are missing or shorter than its record says, naming the first
    such file, ``url`` and the fix. One listing per directory; no file is read."""
    by_dir: dict[str, tuple[object, str, list[tuple[FileHandle, str]]]] = {}
    for s in meta.subtasks:
        for f in (*s.files, *s.channel_state):
            loc, path = src._abs(f.path)
            parent = posixpath.dirname(path.rstrip("/"))
            key = loc.display(parent)
            by_dir.setdefault(key, (loc, parent, []))[2].append((f, f"file {f.name} of subtask {s.subtask} "
                                                                    f"({loc.display(path)})"))
    for loc, parent, files in by_dir.values():
        sizes = {posixpath.basename(str(i["name"]).rstrip("/")): i.get("size") for i in loc.listdir(parent)}
        for f, what in files:
            base = posixpath.basename(src._abs(f.path)[1])
            if base not in sizes:
                raise CheckpointNotFoundError(
                    f"restore_from={url!r}: {what} is missing, so the checkpoint is incomplete (deleted by hand, "
                    f"or claimed and subsumed by another state); nothing was restored. Pass another retained "
                    f"checkpoint or a savepoint")
            size = sizes[base]
            if isinstance(size, int) and size < f.offset + f.length:
                raise CheckpointCorruptError(
                    f"restore_from={url!r}: {what} is corrupt: it has {size} bytes, its record says "
                    f"{f.offset + f.length}; nothing was restored. Pass another retained checkpoint or a savepoint")


def _duplicate_into(src: CheckpointStorage, meta: CheckpointMetadata, dst: CheckpointStorage,
                    duplicator: Duplicator) -> CheckpointMetadata:
    """Copy every physical file of ``meta`` to ``dst`` (a file already there is copied again: only a
    fresh copy of the source is trusted): whole files to ``shared/<checksum>``, merged physical files
    (FLIP-306) once each to ``merged/<uuid>``, their segments keeping their offsets. On a failure the
    files copied so far are deleted."""
    pairs = {}
    for f in meta.files():
        rel = _dest(f)
        pairs[rel] = (src.url_of(f.path), dst.url_of(rel))
    if dst.location.is_local:
        dst.location.makedirs(dst.location.path("shared"))
        if any(is_merged(r) for r in pairs):
            dst.location.makedirs(dst.location.path(MERGED_DIR))
    try:
        duplicator.duplicate(list(pairs.values()))
    except BaseException:
        try:
            dst.delete_files(sorted(pairs))
        except StewardError as exc:  # the first error matters more; the sweep at start gets the rest
            log.warning("could not delete the files of a failed duplication into %s: %s", dst.url, exc)
        raise
    log.info("duplicated %d files of checkpoint %d into %s", len(pairs), meta.checkpoint_id, dst.url)
    return _map_files(meta, _dest)


def _dest(f: FileHandle) -> str:
    """Where a duplicate of ``f``'s physical file goes, relative to the new root."""
    if f.is_segment:
        return posixpath.join(MERGED_DIR, posixpath.basename(f.path))
    return shared_path(f.checksum)


def _absolute(src: CheckpointStorage, f: FileHandle) -> str:
    url = src.url_of(f.path)
    return url if "://" in url else "file://" + os.path.abspath(url)


def restore_from(url: str, dst: CheckpointStorage, *, max_parallelism: int,
                 claim_mode: ClaimMode | str = ClaimMode.NO_CLAIM, key_type: KeyType | str | None = None,
                 duplicator: Duplicator | None = None) -> CheckpointMetadata:
    """Make the checkpoint or savepoint at ``url`` the starting point of the state stored in ``dst``.

    Writes ``restored/_metadata`` in ``dst`` and returns that record. A ``url`` that is not a
    checkpoint, a record of a newer version, a changed max parallelism or key type, a ``url`` inside
    ``dst``, missing or truncated files, and a ``dst`` that has checkpoints of its own raise clear
    errors before anything is written. An earlier restored starting point of ``dst`` (restored, never
    checkpointed since) is replaced: its record is deleted before any file is copied.
    """
    mode = ClaimMode.parse(claim_mode)
    own = dst.checkpoint_ids()
    if own:
        raise CheckpointError(
            f"state {dst.state!r} ({dst.url}) already has checkpoints {own} of its own, so restore_from={url!r} "
            f"would discard them: a state continues from its latest checkpoint. Use a new state name (or delete "
            f"the state's directory) to start from {url!r}")
    src, meta = open_checkpoint(url)
    where = url.rstrip("/")
    if "://" not in where:
        where = os.path.abspath(where)
    root = dst.url.rstrip("/")
    if "://" not in root:
        root = os.path.abspath(root)
    if where == root or where.startswith(root + "/"):
        raise CheckpointError(f"restore_from={url!r} is inside the directory of state {dst.state!r} ({dst.url}) "
                              f"itself: a state continues from its own checkpoints without restore_from; pass "
                              f"another state's checkpoint or a savepoint")
    check_max_parallelism(meta, max_parallelism)
    if key_type is not None and meta.key_type is not KeyType.parse(key_type):
        raise StateEncodingError(
            f"restore_from={url!r} holds {meta.key_type.value} keys, but state {dst.state!r} has "
            f"{KeyType.parse(key_type).value} keys: cast the key column to {meta.key_type.value}, or restore "
            f"another checkpoint")
    check_sources(src, meta, url)
    props = {**meta.properties, "restored_from": url, "claim_mode": mode.value, "source_state": meta.state}
    props.pop("claimed", None)
    if dst.has_restored():
        log.info("state %s: replacing its restored starting point with %s", dst.state, url)
        dst.delete_checkpoint_dir(RESTORED)  # the record first: its files are orphans from here on
    if mode is ClaimMode.CLAIM:
        restored = _map_files(meta, lambda f: _absolute(src, f))
        props["claimed_metadata"] = _metadata_url(url)
    else:
        restored = _duplicate_into(src, meta, dst, duplicator or Duplicator())
    restored = replace(restored, state=dst.state, properties=props)
    try:
        dst.write_metadata(restored, as_id=RESTORED)
    except BaseException:
        if mode is ClaimMode.NO_CLAIM:
            dst.delete_files(sorted({f.path for f in restored.files()}))
        raise
    return restored


def _metadata_url(url: str) -> str:
    """The absolute URL of the ``_metadata`` of the checkpoint or savepoint ``url`` names."""
    text = url.rstrip("/")
    if posixpath.basename(text) == METADATA_FILE:
        text = posixpath.dirname(text)
    loc = open_location(text)
    shown = loc.display(loc.path(METADATA_FILE))
    return shown if "://" in shown else "file://" + os.path.abspath(shown)


def write_savepoint(src: CheckpointStorage, meta: CheckpointMetadata, url: str,
                    duplicator: Duplicator | None = None, *, source: str | None = None) -> str:
    """Copy checkpoint ``meta`` of ``src`` to a self-contained savepoint at ``url``; return the URL of
    its ``_metadata``. Refuses a ``url`` that already holds a ``_metadata``.

    The files are duplicated first and ``_metadata`` is written last (atomically: the savepoint's
    commit marker); if anything fails, the files this call copied are deleted again, so ``url``
    holds a whole savepoint or none. ``source`` (default ``chk-<N>/_metadata`` of ``src``) is
    recorded as ``savepoint_of``.
    """
    loc = open_location(url)
    target = CheckpointStorage(loc, meta.state)
    meta_path = loc.path(METADATA_FILE)
    if loc.exists(meta_path):
        raise CheckpointError(f"savepoint {url!r} already exists ({loc.display(meta_path)}); pick a new path")
    check_sources(src, meta, src.url_of(posixpath.join(f"chk-{meta.checkpoint_id}", METADATA_FILE)))
    saved = _duplicate_into(src, meta, target, duplicator or Duplicator())
    props = {k: v for k, v in meta.properties.items() if k not in ("claimed", "claimed_metadata")}
    props["savepoint_of"] = source or src.url_of(posixpath.join(f"chk-{meta.checkpoint_id}", METADATA_FILE))
    saved = replace(saved, properties=props)
    try:
        loc.write_atomic(meta_path, saved.to_bytes())  # last: a savepoint without _metadata is not one
    except BaseException:
        target.delete_files(sorted({f.path for f in saved.files()}))
        raise
    return loc.display(meta_path)
