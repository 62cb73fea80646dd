"""Event time of a keyed state (issue 38, decision 0028): its column, its watermark delay, and what a
task does with each input batch before the function sees it.

A state opened with ``event_time="ts"`` and ``watermark_delay`` has, for each checkpoint, one
watermark chosen by the driver when the checkpoint is first begun (:mod:`sparksteward.checkpoint.begun`):
the largest event time the last completed checkpoint saw minus the delay, never going back. A row
whose event time is **at or below** the watermark is late (Spark's rule): ``late="drop"`` (the
default) drops it before the function and counts it (``late_rows``); ``late="keep"`` hands it over
with a boolean column ``__late``. Every row, late or not, counts towards the largest event time the
task reports. A row whose event time is null is never late and counts towards nothing.

The event-time column may be a ``timestamp`` (any unit, with or without a time zone), a ``date``, or
an integer of epoch milliseconds. Rows a FLIP-76 cut deferred are judged by the watermark of the batch
that processes them.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.errors import StateEncodingError, StateError
from sparksteward.state.declared import duration_ms

__all__ = ["LATE_COLUMN", "LATE_MODES", "EventTime", "event_ms", "judge"]

#: The column a late row carries with ``late="keep"``.
LATE_COLUMN = "__late"
LATE_MODES = ("drop", "keep")
_MAX_DELAY_MS = 100 * 365 * 86_400_000


@dataclass(frozen=True, slots=True)
class EventTime:
    """A state's event-time column, watermark delay and what happens to late rows."""

    column: str
    delay_ms: int = 0
    late: str = "drop"

    @classmethod
    def of(cls, column: Any, delay: Any = 0, late: Any = "drop") -> EventTime:
        """Check ``keyed_state(event_time=, watermark_delay=, late=)``: ``delay`` is seconds or a timedelta."""
        if not isinstance(column, str) or not 0 < len(column) <= 1000:
            raise StateError(f"event_time={column!r} must name the event-time column of the input")
        delay_ms = duration_ms(delay, "watermark_delay")
        if not 0 <= delay_ms <= _MAX_DELAY_MS:
            raise StateError(f"watermark_delay={delay!r} must be between 0 and 100 years")
        if late not in LATE_MODES:
            raise StateError(f"late={late!r} must be 'drop' (late rows are dropped and counted) or 'keep' (handed "
                             f"to the function with a boolean {LATE_COLUMN!r} column)")
        return cls(column, delay_ms, late)

    def to_json(self) -> dict[str, Any]:
        return {"column": self.column, "delay_ms": self.delay_ms, "late": self.late}

    def recorded(self) -> dict[str, Any]:
        """What the driver keeps and every checkpoint records (``properties.event_time``)."""
        return {"column": self.column, "delay_ms": self.delay_ms}


def event_ms(batch: pa.RecordBatch, column: str) -> pa.Array:
    """The event times of ``batch`` as int64 epoch milliseconds (nulls kept)."""
    if column not in batch.schema.names:
        raise StateEncodingError(
            f"event-time column {column!r} is not in the input (columns: {', '.join(batch.schema.names)}): "
            f"keep it in the DataFrame you apply, or open the state with the event_time column it has")
    values = batch.column(column)
    t = values.type
    if pa.types.is_timestamp(t):
        return pc.cast(pc.cast(values, pa.timestamp("ms", t.tz), safe=False), pa.int64())
    if pa.types.is_date(t):
        return pc.cast(pc.cast(values, pa.date64()), pa.int64())
    if pa.types.is_integer(t):
        return pc.cast(values, pa.int64())
    raise StateEncodingError(
        f"event-time column {column!r} is {t}: it must be a timestamp, a date or a bigint of epoch milliseconds "
        f"(cast it, for example with F.col({column!r}).cast('timestamp'))")


def judge(batches: Iterator[pa.RecordBatch], event: EventTime, watermark_ms: int | None,
          counters: MutableMapping[str, Any]) -> Iterator[pa.RecordBatch]:
    """``batches`` as the function sees them: late rows dropped or flagged (see the module docstring);
    ``counters["late_rows"]`` and ``counters["max_event_ms"]`` counted as they are read."""
    counters.setdefault("late_rows", 0)
    for batch in batches:
        ms = event_ms(batch, event.column)
        top = pc.max(ms).as_py()
        if top is not None and (counters.get("max_event_ms") is None or top > counters["max_event_ms"]):
            counters["max_event_ms"] = top
        if watermark_ms is None:
            late = None
        else:
            late = pc.fill_null(pc.less_equal(ms, pa.scalar(watermark_ms, pa.int64())), False)
            counters["late_rows"] += pc.sum(late).as_py() or 0
        if event.late == "keep":
            flag = late if late is not None else pa.array([False] * batch.num_rows, pa.bool_())
            yield batch.append_column(pa.field(LATE_COLUMN, pa.bool_(), nullable=False), flag)
        elif late is None or not pc.any(late).as_py():
            yield batch
        elif (kept := batch.filter(pc.invert(late))).num_rows:
            yield kept
