"""Paths from peers: what an executor agent's ack may name, checked by the
:class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator` before anything of the
ack is recorded (what an ack records is deleted on abort).

An ack may name as uploads only data files (``shared/<checksum>``, ``merged/<32 hex>``) its handle
references, and its handle only data files or what its base or a claimed checkpoint holds; its
subtask and key groups are those of the state's parallelism. A seal names only merged files its
agent's acks listed (:mod:`~sparksteward.checkpoint.coordination.seals`). Anything else is refused,
and deletion reaches only data files and the URLs this state claimed.
"""

from __future__ import annotations

from collections.abc import Iterable

from sparksteward.checkpoint.filemerging.space import is_merged
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.storage import DATA_PATH_FORMS, is_data_path
from sparksteward.errors import InvalidRecordError
from sparksteward.state.keygroups import key_group_range

__all__ = ["check_handle", "check_subtask", "check_uploads"]


def check_uploads(who: str, handle: SubtaskHandle, uploaded: Iterable[str], merged: Iterable[str]) -> None:
    """Refuse an ack (``who``) whose uploads or merged files are not data files its handle references."""
    merged = list(merged)
    bad = [p for p in merged if not is_merged(p)]
    if bad:
        raise InvalidRecordError(f"{who}: {bad} are not merged/ paths (merged/<32 hex>)")
    referenced = {f.path for f in handle.all_files}
    bad = [p for p in (*uploaded, *merged) if not is_data_path(p) or p not in referenced]
    if bad:
        raise InvalidRecordError(
            f"{who}: uploaded files {bad} are not data files its handle references; an upload is a "
            f"file of the handle named {DATA_PATH_FORMS}")


def check_handle(who: str, handle: SubtaskHandle, base_id: int | None, base: CheckpointMetadata | None,
                 claimed: set[str]) -> None:
    """Refuse an ack (``who``) whose handle references what is neither a data file nor a file its base
    checkpoint ``base_id`` or a ``claimed`` checkpoint holds."""
    held = base.physical_paths() if base is not None else set()
    bad = sorted(p for p in {f.path for f in handle.all_files}
                 if not is_data_path(p) and p not in held and p not in claimed)
    if bad:
        raise InvalidRecordError(
            f"{who}: its handle references {bad}, which are neither data files ({DATA_PATH_FORMS}) nor "
            f"files its base checkpoint {base_id} or a claimed checkpoint holds")


def check_subtask(handle: SubtaskHandle, parallelism: int, max_parallelism: int) -> None:
    """Refuse an ack of a subtask or key groups the state's parallelism does not have."""
    if not 0 <= handle.subtask < parallelism:
        raise InvalidRecordError(f"ack for subtask {handle.subtask} of a state with parallelism {parallelism}")
    expected = key_group_range(max_parallelism, parallelism, handle.subtask)
    if handle.key_groups != expected:
        raise InvalidRecordError(
            f"subtask {handle.subtask} acked key groups {handle.key_groups}, expected {expected}")
