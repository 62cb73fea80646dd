"""The report of one completed checkpoint: the figures of a keyed state's batch, flat and numeric, as
Spark's metrics system (gauges ``state.<name>.checkpoint.<figure>``), the commit's reply and the INFO
line per completed checkpoint show them.

Where each figure is known: the task counts rows in and out, the distinct keys it processed and
RocksDB's ``estimate-num-keys`` at the sync phase, and times the sync phase; the executor agent
measures the local snapshot, times the async phase (upload, merge) and reports the restore (and a
rescale's rebuild) it did on open; the driver agent's coordinator sums the acks
(:func:`~sparksteward.checkpoint.coordination.stats.summarize`) and the service times the commit and the whole
checkpoint, from the driver's ``begin`` to the written ``_metadata``.

Figures (every one a number; times in milliseconds, the slowest subtask for per-subtask phases):

=======================  ==========================================================================
``checkpoint_id``        the checkpoint; ``batch_id`` the streaming batch (absent outside a stream)
``rows_in``              rows the subtasks processed (the batch's and the replayed deferred rows)
``rows_out``             rows the state function returned
``rows_deferred``        rows an unaligned batch deferred into the checkpoint (FLIP-76)
``keys_touched``         distinct keys processed (exact: every key is in one subtask)
``entries_estimate``     state entries, RocksDB's ``rocksdb.estimate-num-keys`` summed over the
                         subtasks: an estimate that counts an entry written again since the last
                         flush once per write (Flink reports the same number)
``state_bytes_local``    the subtasks' local snapshots (the DBs' live files) on the executors
``state_bytes``          the bytes the checkpoint references (state and channel state, reused ones
                         included); the physical bytes of merged files are ``merged.physical_bytes``
``bytes_uploaded``       bytes this checkpoint wrote; ``bytes_reused`` the rest of ``state_bytes``
``files_uploaded``       files written (whole or as segments); ``files_reused`` those reused
``objects_written``      objects written to the store: whole files, merged physical files, _metadata
``channel_bytes``        the deferred rows' bytes (the unaligned backlog this checkpoint holds)
``sync_ms``              the sync phase (close the DB, link its files), slowest subtask
``async_ms``             the async phase (upload or merge, until the ack), slowest subtask
``ttl_sweep_ms``         the sweep of expired state entries (state TTL), slowest subtask;
                         ``ttl_expired_removed`` the entries it removed, ``ttl_timers_dropped``
                         the timers of keys whose every entry it removed
``commit_ms``            completing: writing ``_metadata`` and subsuming
``duration_ms``          from the driver's begin to the written ``_metadata`` (the whole batch)
``restore_ms``           the slowest subtask's restore of its base; ``rescale_ms`` the same for a
                         restore that rebuilt subtasks of another parallelism (0 without a rescale)
``restore_bytes_downloaded``  bytes restores fetched from the store (not in the local file cache)
``kept_open``            subtasks whose task went on with the DB its Python worker kept open (no
                         restore, no open: decision 0026)
``late_rows``            rows at or below the watermark (dropped, or handed over flagged: decision 0028)
``initial_rows``         rows of the initial state the first batch applied (decision 0028)
``timers_fired``         timers the batch fired (decision 0028); ``next_timer_ms`` and
                         ``next_event_timer_ms`` the earliest processing-time and event-time timer
                         left (only when there is one: the idle watcher's cues)
``max_event_ms``         the largest event time the batch saw; ``watermark_ms`` the watermark it ran
                         with (both only for a state with an event-time column, once known)
``stage_runs``           how many times the whole state stage ran in the attempt that completed: 2
                         or more when the sink took several actions on an unpersisted output
=======================  ==========================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointReport", "checkpoint_report"]

log = logging.getLogger("sparksteward.checkpoint.coordination.report")


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    """The figures of one completed checkpoint of state ``state`` (see the module docstring)."""

    state: str
    figures: Mapping[str, int | float] = field(default_factory=dict)
    query: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "query": self.query, **self.figures}

    def gauges(self) -> dict[str, int | float]:
        """The figures as Spark metrics: ``state.<name>.checkpoint.<figure>``."""
        return {f"state.{self.state}.checkpoint.{k}": v for k, v in self.figures.items()}

    def log(self) -> None:
        """The INFO line of a completed checkpoint, one per checkpoint, in ``key=value`` form so that
        it can be matched with the query's progress by ``batch``."""
        f = self.figures
        log.info("keyed state %s completed checkpoint %s (batch %s, query %s) in %.0f ms: %d rows in, %d out, %d keys "
                 "touched, ~%d entries, %d B of state (%d B local), %d B uploaded, %d B reused, %d objects "
                 "written, sync %.1f ms, async %.1f ms, commit %.1f ms", self.state, f.get("checkpoint_id"),
                 f.get("batch_id", "-"), self.query or "-", f.get("duration_ms", 0.0), f.get("rows_in", 0),
                 f.get("rows_out", 0), f.get("keys_touched", 0), f.get("entries_estimate", 0), f.get("state_bytes", 0),
                 f.get("state_bytes_local", 0), f.get("bytes_uploaded", 0), f.get("bytes_reused", 0),
                 f.get("objects_written", 0), f.get("sync_ms", 0.0), f.get("async_ms", 0.0), f.get("commit_ms", 0.0))


def checkpoint_report(state: str, summary: Mapping[str, Any], *, parallelism: int, batch_id: int | None = None,
                      commit_ms: float = 0.0, duration_ms: float = 0.0, query: str | None = None,
                      stage_runs: int = 1) -> CheckpointReport:
    """The report of a checkpoint from its :func:`~sparksteward.checkpoint.coordination.stats.summarize` ``summary``
    and what the driver agent timed. ``parallelism``: the checkpoint's (a restore from another
    parallelism is a rescale)."""
    restores = [r for r in summary.get("restores") or [] if isinstance(r, dict)]
    rescaled = [r for r in restores if r.get("old_parallelism") not in (None, parallelism)]

    def slowest(rs: list[dict[str, Any]]) -> float:
        return round(max((float(r.get("seconds") or 0.0) for r in rs), default=0.0) * 1000, 3)

    state_bytes = int(summary.get("bytes", 0))
    uploaded = int(summary.get("bytes_uploaded", 0))
    figures: dict[str, int | float] = {
        "checkpoint_id": int(summary["checkpoint_id"]),
        "rows_in": int(summary.get("rows_processed", 0)), "rows_out": int(summary.get("rows_out", 0)),
        "rows_deferred": int(summary.get("rows_deferred", 0)), "keys_touched": int(summary.get("keys_touched", 0)),
        "entries_estimate": int(summary.get("entries_estimate", 0)),
        "state_bytes_local": int(summary.get("local_bytes", 0)), "state_bytes": state_bytes,
        "bytes_uploaded": uploaded, "bytes_reused": max(0, state_bytes - uploaded),
        "files_uploaded": int(summary.get("files_uploaded", 0)), "files_reused": int(summary.get("files_reused", 0)),
        "objects_written": int(summary.get("objects_written", 0)), "channel_bytes": int(summary.get("channel_bytes", 0)),
        "sync_ms": round(float(summary.get("sync_ms_max", 0.0)), 3),
        "async_ms": round(float(summary.get("async_ms_max", 0.0)), 3),
        "ttl_sweep_ms": max((int(ms) for ms in summary.get("ttl_sweep_ms") or []), default=0),
        "commit_ms": round(commit_ms, 3), "duration_ms": round(duration_ms, 3),
        "restore_ms": slowest(restores), "rescale_ms": slowest(rescaled),
        "restore_bytes_downloaded": sum(int(r.get("bytes_downloaded") or 0) for r in restores),
        "kept_open": int(summary.get("kept_open", 0)), "stage_runs": int(stage_runs)}
    figures["late_rows"] = int(summary.get("late_rows", 0))
    figures["timers_fired"] = int(summary.get("timers_fired", 0))
    figures["initial_rows"] = int(summary.get("initial_rows", 0))
    figures["ttl_expired_removed"] = int(summary.get("ttl_expired_removed", 0))
    figures["ttl_timers_dropped"] = int(summary.get("ttl_timers_dropped", 0))
    for when in ("max_event_ms", "watermark_ms", "next_timer_ms", "next_event_timer_ms"):
        if summary.get(when) is not None:
            figures[when] = int(summary[when])
    if batch_id is not None:
        figures["batch_id"] = int(batch_id)
    return CheckpointReport(state, figures, query)
