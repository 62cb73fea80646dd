"""The stats of a checkpoint: what each subtask's ack reports (:class:`SubtaskStats`, checked field by
field when the ack arrives) and their sum per checkpoint (:func:`summarize`, the ``stats`` of a
commit's reply and the ``checkpoints`` of ``ks.info()``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparksteward.wire.fields import Fields

__all__ = ["SubtaskStats", "summarize"]


@dataclass(frozen=True, slots=True)
class SubtaskStats:
    """One subtask's ack: its upload (files and bytes written and reused), its sync phase, its
    restore (None unless this attempt restored from a base) and, FLIP-76, the rows it processed
    and deferred into the channel state."""

    files_uploaded: int = 0
    bytes_uploaded: int = 0
    whole_files_uploaded: int | None = None   # files written whole (the rest are merged segments)
    segments_written: int = 0
    files_reused: int = 0
    files: int = 0
    bytes: int = 0
    sync_ms: float = 0.0
    flush_ms: float = 0.0                      # within sync_ms: a flush, or the wait for one
    restore: dict[str, Any] | None = None
    rows_processed: int = 0
    rows_deferred: int = 0
    channel_bytes: int = 0
    unaligned: bool = False
    wal_bytes: int = 0
    ttl_expired_removed: int = 0              # expired state entries the subtask's sweep removed
    rows_out: int = 0                         # rows the state function returned
    keys_touched: int = 0                     # distinct keys of the rows processed
    entries_estimate: int = 0                 # RocksDB's estimate-num-keys at the sync phase
    entries_ingested: int = 0                 # entries the task put in as ingested SSTs (decision 0023)
    local_bytes: int = 0                      # the local snapshot (the DB's live files) on the executor
    async_ms: float = 0.0                     # the async phase: upload (and merge) until the ack

    @classmethod
    def from_fields(cls, f: Fields) -> SubtaskStats:
        """The stats an ack carries, each field checked by type (a bad one raises
        :class:`~sparksteward.errors.InvalidRequestError` naming it); missing ones default."""
        counts = {name: f.integer(name, default=0) for name in _COUNTS}   # no bound: segments_written
        return cls(**counts,                                               # is a difference
                   whole_files_uploaded=f.integer("whole_files_uploaded", default=None),
                   sync_ms=float(f.number("sync_ms", default=0.0, lo=0)),
                   flush_ms=float(f.number("flush_ms", default=0.0, lo=0)),
                   async_ms=float(f.number("async_ms", default=0.0, lo=0)),
                   restore=f.mapping("restore", default=None), unaligned=f.flag("unaligned", default=False))


_COUNTS = ("files_uploaded", "bytes_uploaded", "segments_written", "files_reused", "files", "bytes",
           "rows_processed", "rows_deferred", "channel_bytes", "wal_bytes", "ttl_expired_removed", "rows_out",
           "keys_touched", "entries_estimate", "entries_ingested", "local_bytes")


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
    return {"checkpoint_id": checkpoint_id, "subtasks": len(acks), "files_uploaded": total("files_uploaded"),
            "bytes_uploaded": total("bytes_uploaded"), "files_reused": total("files_reused"),
            "segments_written": total("segments_written"), "whole_files_uploaded": whole,
            "merged_files_written": merged_files_written,
            # objects a checkpoint writes to the store: whole files, merged physical files, _metadata
            "objects_written": whole + merged_files_written + 1,
            "files": total("files"), "bytes": total("bytes"), "ttl_expired_removed": total("ttl_expired_removed"),
            "rows_out": total("rows_out"), "keys_touched": total("keys_touched"),
            "entries_estimate": total("entries_estimate"), "local_bytes": total("local_bytes"),
            "sync_ms_max": max((a.sync_ms for a in acks), default=0.0),
            "async_ms_max": max((a.async_ms for a in acks), default=0.0),
            "sync_ms": [a.sync_ms for a in acks],  # per subtask, in subtask order
            "flush_ms": [a.flush_ms for a in acks],
            "entries_ingested": [a.entries_ingested for a in acks],   # per subtask, as flush_ms
            "restores": [a.restore for a in acks if a.restore],
            # FLIP-76: what each subtask processed and deferred into the checkpoint (channel state)
            "rows_processed": total("rows_processed"), "rows_deferred": total("rows_deferred"),
            "channel_bytes": total("channel_bytes"),
            "unaligned_subtasks": [i for i, a in zip(ids, acks) if a.unaligned],
            "per_subtask": [{"subtask": i, "rows_processed": a.rows_processed, "rows_deferred": a.rows_deferred,
                             "channel_bytes": a.channel_bytes, "unaligned": a.unaligned} for i, a in zip(ids, acks)]}
