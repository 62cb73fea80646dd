"""The stats of a checkpoint: what each subtask's ack reports (:class:`SubtaskStats`: the task's
:class:`~sparksteward.checkpoint.messages.TaskCounters` and the executor agent's measurements, checked
field by field when the ack arrives) and their sum per checkpoint (:func:`summarize`, the ``stats`` of a
commit's reply and the ``checkpoints`` of ``ks.info()``, from which the checkpoint's report and its
metrics are made).

Every field of :class:`~sparksteward.checkpoint.messages.TaskCounters` is summed over the subtasks under
its own name, unless :data:`PER_SUBTASK` lists it (then its value per subtask, in subtask order),
:data:`LARGEST` or :data:`SMALLEST` (then the largest or smallest value reported, None if none was); the
``unaligned`` flag becomes
``unaligned_subtasks``. So a new counter needs no change here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparksteward.checkpoint.messages import SubtaskStats, TaskCounters

__all__ = ["LARGEST", "PER_SUBTASK", "SMALLEST", "SubtaskStats", "summarize"]

#: Task counters the checkpoint's stats show per subtask (a list in subtask order) instead of summed.
PER_SUBTASK = frozenset({"entries_ingested", "ttl_sweep_ms", "open_ms", "db_open_ms"})
#: Task counters the checkpoint's stats show as their largest value over the subtasks (None: none reported).
LARGEST = frozenset({"max_event_ms"})
#: ... and as their smallest.
SMALLEST = frozenset({"next_timer_ms", "next_event_timer_ms"})
#: Task counters shown in their own way (``unaligned``: the ids of the subtasks that deferred rows).
_SHOWN_APART = frozenset({"unaligned"})
_COUNTERS = tuple(f.name for f in dataclasses.fields(TaskCounters) if f.name not in _SHOWN_APART)


def summarize(checkpoint_id: int, per_subtask: Mapping[int, SubtaskStats],
              merged_files_written: int = 0) -> dict[str, Any]:
    """One checkpoint's stats, summed over the subtasks' acks, with each subtask's restore.
    ``merged_files_written``: the physical files (FLIP-306) its executor agents sealed."""
    ids = sorted(per_subtask)
    acks = [per_subtask[i] for i in ids]

    def total(key: str) -> int:
        return sum(int(getattr(a, key) or 0) for a in acks)

    whole = total("whole_files_uploaded") if any(a.whole_files_uploaded is not None for a in acks) \
        else total("files_uploaded")
    def extreme(key: str, pick: Any) -> int | None:
        return pick((v for a in acks if (v := getattr(a, key)) is not None), default=None)

    counters = {name: [getattr(a, name) for a in acks] if name in PER_SUBTASK else extreme(name, max)
                if name in LARGEST else extreme(name, min) if name in SMALLEST else total(name) for name in _COUNTERS}
    return {"checkpoint_id": checkpoint_id, "subtasks": len(acks), "files_uploaded": total("files_uploaded"),
            "bytes_uploaded": total("bytes_uploaded"), "files_reused": total("files_reused"),
            "segments_written": total("segments_written"), "whole_files_uploaded": whole,
            "merged_files_written": merged_files_written,
            # objects a checkpoint writes to the store: whole files, merged physical files, _metadata
            "objects_written": whole + merged_files_written + 1,
            "files": total("files"), "bytes": total("bytes"), "local_bytes": total("local_bytes"),
            "sync_ms_max": max((a.sync_ms for a in acks), default=0.0),
            "async_ms_max": max((a.async_ms for a in acks), default=0.0),
            "sync_ms": [a.sync_ms for a in acks],  # per subtask, in subtask order
            "flush_ms": [a.flush_ms for a in acks],
            "restores": [a.restore for a in acks if a.restore],
            # the task's counters: rows, keys, entries, TTL sweep and, FLIP-76, the channel state
            **counters,
            "unaligned_subtasks": [i for i, a in zip(ids, acks) if a.unaligned],
            "per_subtask": [{"subtask": i, "rows_processed": a.rows_processed, "rows_deferred": a.rows_deferred,
                             "channel_bytes": a.channel_bytes, "unaligned": a.unaligned} for i, a in zip(ids, acks)]}
