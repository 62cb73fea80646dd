"""The backlog of an unaligned state (FLIP-76): the rows its batches deferred and no batch has
processed yet, and the drains that process them when no batch comes.

**Backlog.** The channel state of the latest completed checkpoint: its bytes (from the record) and
rows (from the subtasks' acks, when they were acked in this application). :func:`growth` counts for
how many consecutive checkpoints it grew; from :data:`GROWTH_WARNING` on the driver agent logs a
warning: the subtasks defer more than they catch up with (raise the aligned-checkpoint timeout, use
``unaligned_max_inflight``, or add subtasks).

**Drains.** Spark runs no micro-batch without input, so when a stream's input stops, the deferred
rows wait. A drain applies an empty batch aligned under the next checkpoint id: every subtask
processes its replayed channel state whole and defers nothing. Its id must never be the id of a
later batch (that batch would be taken for a re-run of the drain and its rows lost), so the drain
ids are kept in ``<state root>/_drains``, versioned JSON written atomically before the drain
begins::

    {"version": 1, "drains": [8, 15]}

and a streaming batch ``b`` gets the checkpoint id :meth:`DrainLog.checkpoint_of` ``(b)``: ``b``
moved past every drain id at or below it, the same for every attempt and after any restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sparksteward.errors import CorruptRecordError
from sparksteward.storage import Location

__all__ = ["DRAINS_FILE", "GROWTH_WARNING", "DrainLog", "growth"]

DRAINS_FILE = "_drains"
GROWTH_WARNING = 3   # consecutive checkpoints whose backlog grew before the driver agent warns
_VERSION = 1
_MAX_RECORD = 1 << 20


@dataclass(frozen=True, slots=True)
class DrainLog:
    """The checkpoint ids that drains took, ascending."""

    drains: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = tuple(self.drains)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in ids) or list(ids) != sorted(set(ids)):
            raise ValueError(f"drain ids {ids!r} must be distinct ints >= 0, ascending")
        object.__setattr__(self, "drains", ids)

    def checkpoint_of(self, batch_id: int) -> int:
        """The checkpoint id of streaming batch ``batch_id``: moved one up past every drain id at or
        below it."""
        cid = batch_id
        for d in self.drains:
            if d <= cid:
                cid += 1
        return cid

    def with_drain(self, checkpoint_id: int) -> DrainLog:
        return DrainLog(tuple(sorted({*self.drains, checkpoint_id})))

    def to_bytes(self) -> bytes:
        return orjson.dumps({"version": _VERSION, "drains": list(self.drains)})

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> DrainLog:
        try:
            rec = orjson.loads(data)
            if not isinstance(rec, dict) or rec.get("version") != _VERSION:
                raise ValueError(f"unknown version {rec.get('version') if isinstance(rec, dict) else rec!r}")
            return cls(tuple(rec["drains"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(
                f"drain record {source} is unreadable ({exc}): it lists the checkpoint ids that drains took, "
                f"which streaming batches skip; restore it from a backup, or stop the query and delete it only if "
                f"the state never drained") from exc

    @classmethod
    def read(cls, loc: Location) -> DrainLog:
        """The record of the state root ``loc``; empty when it never drained."""
        path = loc.path(DRAINS_FILE)
        try:
            data = loc.read_bytes(path)
        except FileNotFoundError:
            return cls()
        if len(data) > _MAX_RECORD:
            raise CorruptRecordError(f"drain record {loc.display(path)} is {len(data)} bytes, not a drain record")
        return cls.from_bytes(data, loc.display(path))

    def write(self, loc: Location) -> None:
        loc.write_atomic(loc.path(DRAINS_FILE), self.to_bytes())


def growth(rows_by_checkpoint: Mapping[int, Any]) -> int:
    """How many consecutive checkpoints, ending at the latest of ``rows_by_checkpoint`` (checkpoint id
    -> rows deferred, None when unknown), deferred more rows than the one before."""
    ids = sorted(rows_by_checkpoint)
    grew = 0
    for before, after in zip(reversed(ids[:-1]), reversed(ids[1:])):
        a, b = rows_by_checkpoint[before], rows_by_checkpoint[after]
        if a is None or b is None or b <= a:
            break
        grew += 1
    return grew
