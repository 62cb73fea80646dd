"""The begun record: what every delivery and attempt of a pending checkpoint must share, made durable
before any of its tasks runs (``<state root>/_begun``).

A micro-batch can be delivered more than once: Spark re-delivers a batch whose ``foreachBatch`` did
not return (the driver, or its agent, died between the sink's write and the commit), and a sink that
skips a batch id it already wrote keeps the *first* delivery's rows. So everything that decides which
rows a checkpoint emits and what its state becomes must be the same in every delivery, across driver
and agent restarts, not only across the attempts one coordinator sees:

- **the time of the checkpoint** (:class:`CheckpointTime`): the processing time that TTL expires
  entries by, chosen once when the checkpoint is first begun and never smaller than the previous
  checkpoint's (a wall clock that steps back does not revive what expired), and the event-time
  watermark of a state that names an event-time column (decision 0028): the largest event time the
  last completed checkpoint saw minus the state's delay, never below an earlier checkpoint's;
- **the alignment** the checkpoint runs with (an unaligned first delivery must not be re-run aligned,
  nor the other way round), and
- **the FLIP-76 cuts** (:mod:`~sparksteward.checkpoint.unaligned.coordinator_cuts`): where each unaligned subtask stopped.
  A task waits for its cut to be in this record before it goes on, so no output past a cut can reach
  a sink before the cut is durable.

The record is versioned JSON, rewritten atomically (stage, fsync, rename; one PUT on an object
store) when a checkpoint is first begun and when new cuts are recorded (many subtasks' cuts in one
write, see :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`)::

    {"version": 1, "checkpoint_id": 7, "parallelism": 4,
     "time": {"processing_ms": 1764270000000, "watermark_ms": 1764269400000},
     "unaligned": true, "cuts": {"0": 12, "3": 32}, "cut_rows": {"3": 500}}

(``cut_rows``: a cut inside key group 32 after its first 500 rows, where the function takes a key's rows
in chunks; absent where every cut is at a key-group boundary.)

Only the newest begun checkpoint matters (a newer begin aborts older pending ones), so there is one
record per state. Once checkpoint ``N`` completes its record carries the same facts
(``properties.time``, ``properties.cuts`` and ``properties.cut_rows``); a begun record of ``N`` or older is then ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.errors import CorruptRecordError
from sparksteward.storage import Location

__all__ = ["BEGUN_FILE", "BegunRecord", "CheckpointTime", "Cut", "advanced_watermark", "read_begun", "time_of"]

BEGUN_FILE = "_begun"
_VERSION = 1
_MAX_RECORD = 1 << 20
_MAX_MS = 1 << 53


class Cut(NamedTuple):
    """Where an unaligned subtask stops (FLIP-76): the first ``rows`` rows of key group ``group`` (in the
    order every attempt finds, :mod:`~sparksteward.checkpoint.unaligned.task_cut`) and every key group below
    it are processed, the rest deferred. ``rows`` is 0 unless the function takes a key's rows in chunks, so
    the cut may fall inside a key (decision 0028). Positions compare as tuples do."""

    group: int
    rows: int = 0


def cuts_json(cuts: dict[int, Cut]) -> tuple[dict[str, int], dict[str, int]]:
    """``cuts`` as a record holds them: ``cuts`` (subtask -> key group) and ``cut_rows`` (subtask -> rows,
    only where not 0, so a record without it reads as before chunked cuts existed)."""
    ordered = sorted(cuts.items())
    return {str(s): c.group for s, c in ordered}, {str(s): c.rows for s, c in ordered if c.rows}


def cuts_of(groups: object, rows: object) -> dict[int, Cut]:
    """The cuts of a record's ``cuts`` and ``cut_rows`` (missing: 0 rows); ValueError when malformed."""
    if not isinstance(groups, dict) or not isinstance(rows, dict) or \
            not all(isinstance(k, str) and k.isdigit() for k in (*groups, *rows)) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*groups.values(), *rows.values())) \
            or not set(rows) <= set(groups):
        raise ValueError(f"cuts {groups!r} and cut_rows {rows!r} are not objects of subtask -> key group and "
                         f"subtask -> rows")
    return {int(k): Cut(v, rows.get(k, 0)) for k, v in groups.items()}


@dataclass(frozen=True, slots=True)
class CheckpointTime:
    """The time of one checkpoint: the same for every task, attempt and delivery of it.

    ``processing_ms``: the processing time in epoch milliseconds (TTL expiry), never smaller than the
    previous checkpoint's. ``watermark_ms``: the event-time watermark (None: the state has none yet),
    never smaller than the previous checkpoint's; a row whose event time is at or below it is late.
    """

    processing_ms: int
    watermark_ms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.processing_ms, bool) or not isinstance(self.processing_ms, int) \
                or not 0 <= self.processing_ms < _MAX_MS:
            raise ValueError(f"processing_ms {self.processing_ms!r} must be an int of epoch milliseconds")
        if self.watermark_ms is not None and (isinstance(self.watermark_ms, bool) or not isinstance(
                self.watermark_ms, int) or not -_MAX_MS < self.watermark_ms < _MAX_MS):
            raise ValueError(f"watermark_ms {self.watermark_ms!r} must be an int of epoch milliseconds")

    def to_json(self) -> dict[str, int]:
        out = {"processing_ms": self.processing_ms}
        if self.watermark_ms is not None:
            out["watermark_ms"] = self.watermark_ms
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CheckpointTime:
        if not isinstance(raw, dict):
            raise ValueError(f"time {raw!r} is not an object")
        return cls(raw["processing_ms"], raw.get("watermark_ms"))

    @classmethod
    def choose(cls, now: float, previous: Iterable[CheckpointTime | None] = (),
               advanced: int | None = None) -> CheckpointTime:
        """The time of a new checkpoint: the clock's ``now`` (seconds) and the watermark ``advanced``
        to, each never below what a ``previous`` checkpoint's time holds."""
        before = [t for t in previous if t is not None]
        marks = [m for m in (advanced, *(t.watermark_ms for t in before)) if m is not None]
        return cls(max([int(now * 1000), *(t.processing_ms for t in before)]), max(marks) if marks else None)


def advanced_watermark(meta: CheckpointMetadata | None, delay_ms: int | None) -> int | None:
    """The watermark the checkpoint after ``meta`` advances to: the largest event time the tasks of
    ``meta`` saw (``properties.max_event_ms``) minus ``delay_ms``; None without either."""
    if meta is None or delay_ms is None:
        return None
    seen = meta.properties.get("max_event_ms")
    if not isinstance(seen, int) or isinstance(seen, bool) or not -_MAX_MS < seen - delay_ms < _MAX_MS:
        return None   # a hand-edited record: the watermark stays where it was
    return seen - delay_ms


def time_of(meta: CheckpointMetadata | None) -> CheckpointTime | None:
    """The time a completed checkpoint's record holds (None: none, or a record from before times)."""
    if meta is None:
        return None
    try:
        return CheckpointTime.from_json(meta.properties["time"])
    except (KeyError, ValueError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class BegunRecord:
    """The durable facts of the newest begun checkpoint (see the module docstring)."""

    checkpoint_id: int
    parallelism: int
    time: CheckpointTime
    unaligned: bool
    cuts: dict[int, Cut] = field(default_factory=dict)   # subtask -> its cut

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_id, bool) or not isinstance(self.checkpoint_id, int) or self.checkpoint_id < 0:
            raise ValueError(f"checkpoint_id {self.checkpoint_id!r} must be an int >= 0")
        if isinstance(self.parallelism, bool) or not isinstance(self.parallelism, int) or self.parallelism < 1:
            raise ValueError(f"parallelism {self.parallelism!r} must be an int >= 1")
        for s, c in self.cuts.items():
            if not (isinstance(s, int) and isinstance(c, Cut)) or isinstance(s, bool) \
                    or not 0 <= s < self.parallelism or min(c) < 0:
                raise ValueError(f"cut {s!r}: {c!r} must map a subtask below the parallelism to a Cut")

    def with_cuts(self, cuts: dict[int, Cut], parallelism: int | None = None) -> BegunRecord:
        return BegunRecord(self.checkpoint_id, self.parallelism if parallelism is None else parallelism,
                           self.time, self.unaligned, dict(cuts))

    def to_bytes(self) -> bytes:
        groups, rows = cuts_json(self.cuts)
        return orjson.dumps({"version": _VERSION, "checkpoint_id": self.checkpoint_id,
                             "parallelism": self.parallelism, "time": self.time.to_json(),
                             "unaligned": self.unaligned, "cuts": groups, **({"cut_rows": rows} if rows else {})})

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> BegunRecord:
        try:
            rec = orjson.loads(data)
            if not isinstance(rec, dict) or rec.get("version") != _VERSION:
                raise ValueError(f"unknown version {rec.get('version') if isinstance(rec, dict) else rec!r}")
            unaligned = rec["unaligned"]
            if not isinstance(unaligned, bool):
                raise ValueError(f"unaligned {unaligned!r} is not a boolean")
            return cls(rec["checkpoint_id"], rec["parallelism"], CheckpointTime.from_json(rec["time"]), unaligned,
                       cuts_of(rec["cuts"], rec.get("cut_rows") or {}))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(
                f"begun record {source} is unreadable ({exc}): it holds the time and the cuts of the checkpoint "
                f"being applied, which every delivery of that batch must share. Restore it from a backup; delete "
                f"it only if no output of that batch reached a sink (the batch then runs with a new time and "
                f"new cuts)") from exc

    def write(self, loc: Location) -> None:
        """Write the record atomically under the state root ``loc``."""
        loc.write_atomic(loc.path(BEGUN_FILE), self.to_bytes())


def read_begun(loc: Location) -> BegunRecord | None:
    """The begun record under the state root ``loc`` (None if there is none)."""
    path = loc.path(BEGUN_FILE)
    try:
        data = loc.read_bytes(path)
    except FileNotFoundError:
        return None
    if len(data) > _MAX_RECORD:
        raise CorruptRecordError(f"begun record {loc.display(path)} is {len(data)} bytes, not a begun record")
    return BegunRecord.from_bytes(data, loc.display(path))
