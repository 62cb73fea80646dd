"""Checkpoints of keyed state (FLIP-428): records, storage, the executor's file cache and uploader,
fast duplication, restore and rescale, and the coordinator the driver agent hosts. See
``docs/state.md``. Nothing here imports pyspark or ``agents/``.
"""

from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.coordination.coordinator import BeginResult, CheckpointCoordinator
from sparksteward.checkpoint.duplicate import Duplicator, can_fast_duplicate
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle
from sparksteward.checkpoint.task.subtask_restore import open_subtask, rebuild_subtask
from sparksteward.checkpoint.restore import ClaimMode, restore_from, write_savepoint
from sparksteward.checkpoint.storage import CheckpointStorage, UploadResult, open_checkpoint
from sparksteward.checkpoint.task.uploader import SnapshotUploader

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
