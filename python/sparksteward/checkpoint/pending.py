"""PendingCheckpoint: everything of one pending checkpoint's current attempt, in one object (Flink's
``PendingCheckpoint``), owned by its :class:`~sparksteward.checkpoint.coordinator.CheckpointCoordinator`.

It holds what the subtasks acked (their handles, uploads and merged files, and the stats of each
ack), what executor agents sealed, which agent works on each subtask, the failures reported for
this attempt, and when its state stage started. A new attempt (:meth:`new_attempt`) draws a new
token and forgets the acks, failures, stats and start of the previous one; its uploads stay listed,
so they are deleted with the checkpoint's end unless something references them.

Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sparksteward.checkpoint.records import SubtaskHandle
from sparksteward.checkpoint.stats import SubtaskStats

__all__ = ["PendingCheckpoint"]


def _token() -> str:
    return uuid.uuid4().hex


@dataclass
class PendingCheckpoint:
    """One pending checkpoint (see the module docstring)."""

    checkpoint_id: int
    base_id: int | None
    rerun: bool                                              # it completed already: the first result stands
    query: str | None = None                                 # the streaming query that began it
    attempt: str = field(default_factory=_token)            # changes on every begin
    acks: dict[int, SubtaskHandle] = field(default_factory=dict)
    uploaded: set[str] = field(default_factory=set)          # every upload of every attempt (deleted unless referenced)
    unsealed: dict[str, str] = field(default_factory=dict)   # merged path -> the agent that writes it
    sealed: dict[str, int] = field(default_factory=dict)     # merged path -> durable size
    writers: dict[str, str] = field(default_factory=dict)    # merged path -> the agent whose ack listed it
    early: dict[str, tuple[str, int]] = field(default_factory=dict)   # merged path -> (agent, size) of a seal
                                                             # that came before the ack listing the file
    stats: dict[int, SubtaskStats] = field(default_factory=dict)      # subtask -> its ack's stats
    failures: dict[str, str] = field(default_factory=dict)   # who ("subtask i", "executor agent a") -> what failed
    working: dict[int, str] = field(default_factory=dict)    # subtask -> the agent that last opened or uploads it
    stage_started: float | None = None                       # monotonic time of the attempt's first open

    def new_attempt(self, query: str | None) -> None:
        """The driver begins the checkpoint again: earlier acks are replaced as the new ones arrive."""
        self.acks.clear()
        self.stats.clear()
        self.failures.clear()
        self.stage_started = None
        self.attempt = _token()
        self.query = self.query or query

    def missing(self, parallelism: int) -> list[int]:
        """The subtasks that have not acked this attempt."""
        return sorted(set(range(parallelism)) - set(self.acks))
