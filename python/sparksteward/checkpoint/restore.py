"""Starting a state from another state's checkpoint (``restore_from``), and savepoints.

- **NO_CLAIM** (default, Flink's default too): the source's files are *duplicated* into this state's
  ``shared/`` by fast duplication (S3 CopyObject, local hard links), so no bytes pass through the
  process and the source stays untouched and owned by its state. Files this state already holds (same
  content) are skipped.
- **CLAIM**: nothing is copied; the restored record points at the source's files by absolute URL.
  This state's coordinator never deletes absolute-URL files, so the source must be left alone while a
  retained checkpoint still references them. (Deleting claimed files once subsumed is a next step.)
- **Savepoint**: a self-contained copy of a checkpoint at any URL (``<url>/_metadata`` and
  ``<url>/shared/...``), made by the same duplication, restorable elsewhere.

Either restore writes ``restored/_metadata`` in this state's directory (see
:data:`~sparksteward.checkpoint.storage.RESTORED`): the coordinator then uses it as the base of the
first checkpoint and counts its files, so later checkpoints never upload them again.
"""

from __future__ import annotations

import enum
import logging
import os
import posixpath
from dataclasses import replace

from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle, shared_path
from sparksteward.checkpoint.rescale import check_max_parallelism
from sparksteward.checkpoint.storage import METADATA_FILE, RESTORED, CheckpointStorage, open_checkpoint
from sparksteward.errors import CheckpointError
from sparksteward.storage import open_location

__all__ = ["ClaimMode", "restore_from", "write_savepoint"]

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


def _duplicate_into(src: CheckpointStorage, meta: CheckpointMetadata, dst: CheckpointStorage,
                    duplicator: Duplicator) -> CheckpointMetadata:
    for f in meta.files():
        if f.is_segment:
            raise CheckpointError(f"{f.name} of checkpoint {meta.checkpoint_id} is a segment of a merged file; "
                                  f"duplicating segments comes with file merging (FLIP-306)")
    have = dst.shared_files()
    pairs = {}
    for f in meta.files():
        rel = shared_path(f.checksum)
        if rel not in have:
            pairs[rel] = (src.url_of(f.path), dst.url_of(rel))
    if dst.location.is_local:
        dst.location.makedirs(dst.location.path("shared"))
    duplicator.duplicate(list(pairs.values()))
    log.info("duplicated %d files of checkpoint %d (%d already present)", len(pairs), meta.checkpoint_id,
             len(meta.files()) - len(pairs))
    return _map_files(meta, lambda f: shared_path(f.checksum))


def _absolute(src: CheckpointStorage, f: FileHandle) -> str:
    url = src.url_of(f.path)
    return url if "://" in url else "file://" + os.path.abspath(url)


def restore_from(url: str, dst: CheckpointStorage, *, max_parallelism: int,
                 claim_mode: ClaimMode | str = ClaimMode.NO_CLAIM,
                 duplicator: Duplicator | None = None) -> CheckpointMetadata:
    """Make the checkpoint or savepoint at ``url`` the starting point of the state stored in ``dst``.

    Writes ``restored/_metadata`` in ``dst`` and returns that record. A ``url`` that is not a
    checkpoint, a record of a newer version and a changed max parallelism raise clear errors before
    anything is copied.
    """
    mode = ClaimMode.parse(claim_mode)
    src, meta = open_checkpoint(url)
    check_max_parallelism(meta, max_parallelism)
    if mode is ClaimMode.CLAIM:
        restored = _map_files(meta, lambda f: _absolute(src, f))
    else:
        restored = _duplicate_into(src, meta, dst, duplicator or Duplicator())
    restored = replace(restored, state=dst.state,
                       properties={**meta.properties, "restored_from": url, "claim_mode": mode.value,
                                   "source_state": meta.state})
    dst.write_metadata(restored, as_id=RESTORED)
    return restored


def write_savepoint(src: CheckpointStorage, meta: CheckpointMetadata, url: str,
                    duplicator: Duplicator | None = None) -> str:
    """Copy checkpoint ``meta`` of ``src`` to a self-contained savepoint at ``url``; return the URL of
    its ``_metadata``. Refuses a ``url`` that already holds a ``_metadata``."""
    loc = open_location(url)
    target = CheckpointStorage(loc, meta.state)
    meta_path = loc.path(METADATA_FILE)
    if loc.exists(meta_path):
        raise CheckpointError(f"savepoint {url!r} already exists ({loc.display(meta_path)}); pick a new path")
    saved = _duplicate_into(src, meta, target, duplicator or Duplicator())
    saved = replace(saved, properties={**meta.properties, "savepoint_of": src.url_of(
        posixpath.join(f"chk-{meta.checkpoint_id}", METADATA_FILE))})
    loc.write_atomic(meta_path, saved.to_bytes())  # last: a savepoint without _metadata is not one
    return loc.display(meta_path)
