"""Checkpoints of keyed state (FLIP-428): records, storage, the executor's file cache and uploader,
fast duplication, restore and rescale, and the coordinator the driver agent hosts. See
``docs/state.md``. Nothing here imports pyspark or ``agents/``.

The names below are imported from their modules on first use, like the root's declarations: a process
that needs one module of this package (the driver agent, the CLI) does not load them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparksteward.lazy import lazy_face

if TYPE_CHECKING:
    from sparksteward.checkpoint.coordination.coordinator import BeginResult, CheckpointCoordinator
    from sparksteward.checkpoint.duplicate import Duplicator, can_fast_duplicate
    from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle
    from sparksteward.checkpoint.restore import ClaimMode, restore_from, write_savepoint
    from sparksteward.checkpoint.storage import CheckpointStorage, open_checkpoint
    from sparksteward.checkpoint.task.cache import LocalFileCache
    from sparksteward.checkpoint.task.subtask_restore import open_subtask, rebuild_subtask
    from sparksteward.checkpoint.task.transfer import UploadResult
    from sparksteward.checkpoint.task.uploader import SnapshotUploader

#: each exported name's module (under this package)
_EXPORTS = {
    "BeginResult": "coordination.coordinator",
    "CheckpointCoordinator": "coordination.coordinator",
    "Duplicator": "duplicate",
    "can_fast_duplicate": "duplicate",
    "CheckpointMetadata": "records",
    "FileHandle": "records",
    "SubtaskHandle": "records",
    "ClaimMode": "restore",
    "restore_from": "restore",
    "write_savepoint": "restore",
    "CheckpointStorage": "storage",
    "open_checkpoint": "storage",
    "LocalFileCache": "task.cache",
    "open_subtask": "task.subtask_restore",
    "rebuild_subtask": "task.subtask_restore",
    "UploadResult": "task.transfer",
    "SnapshotUploader": "task.uploader",
}


__getattr__, __dir__ = lazy_face(__name__, _EXPORTS, globals())


__all__ = [
    "BeginResult",
    "CheckpointCoordinator",
    "CheckpointMetadata",
    "CheckpointStorage",
    "ClaimMode",
    "Duplicator",
    "FileHandle",
    "LocalFileCache",
    "SnapshotUploader",
    "SubtaskHandle",
    "UploadResult",
    "can_fast_duplicate",
    "open_checkpoint",
    "open_subtask",
    "rebuild_subtask",
    "restore_from",
    "write_savepoint",
]
