"""UnalignedCuts: where each subtask of a pending checkpoint stops processing new input (FLIP-76),
kept by the :class:`~sparksteward.checkpoint.coordinator.CheckpointCoordinator` across the attempts
of that checkpoint.

A cut is the first key group whose new input a subtask defers into channel state (the end of its
key-group range: nothing deferred). The first attempt to propose one records it; every later
attempt, a re-run of the completed checkpoint included, gets the same, so every attempt of a
checkpoint processes the same rows. A completed checkpoint's cuts live in its record
(``properties.cuts``); the pending ones here until a newer checkpoint completes or the state
rescales (cuts name subtasks of one parallelism).

Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.errors import InvalidRecordError
from sparksteward.state.keygroups import key_group_range

__all__ = ["UnalignedCuts"]


class UnalignedCuts:
    """The recorded cuts of one state's pending checkpoints (see the module docstring)."""

    def __init__(self, max_parallelism: int) -> None:
        self.max_parallelism = max_parallelism
        self._cuts: dict[int, dict[int, int]] = {}   # checkpoint -> subtask -> its cut

    def cut(self, checkpoint_id: int, subtask: int, parallelism: int, proposed: int | None,
            completed: CheckpointMetadata | None) -> int | None:
        """The cut that stands for ``subtask``; ``proposed`` is recorded if none is. ``completed``: the
        checkpoint's record if it completed (a re-run keeps its cuts: none recorded means none made).
        None when nothing is recorded and nothing is proposed."""
        if completed is not None:
            stop = key_group_range(self.max_parallelism, completed.parallelism, subtask).stop
            return recorded_cuts(completed).get(subtask, stop)
        cuts = self._cuts.setdefault(checkpoint_id, {})
        if proposed is not None and subtask not in cuts:
            expected = key_group_range(self.max_parallelism, parallelism, subtask)
            if not expected.start <= proposed <= expected.stop:
                raise InvalidRecordError(f"cut {proposed} of subtask {subtask} lies outside its key groups {expected}")
            cuts[subtask] = proposed
        return cuts.get(subtask)

    def amend(self, checkpoint_id: int, subtask: int, parallelism: int, cut: int,
              completed: CheckpointMetadata | None) -> int:
        """``subtask`` could not defer past ``cut`` (its channel state would pass the byte cap, which
        every attempt at that cut finds alike): from now on it processes everything. Returns the cut
        that stands."""
        recorded = self.cut(checkpoint_id, subtask, parallelism, None, completed)
        stop = key_group_range(self.max_parallelism, parallelism, subtask).stop
        if recorded == cut and completed is None:
            self._cuts[checkpoint_id][subtask] = stop
            return stop
        return recorded if recorded is not None else stop

    def to_property(self, checkpoint_id: int) -> dict[str, int] | None:
        """The cuts of ``checkpoint_id`` as its record's ``cuts`` property (None: none made)."""
        cuts = self._cuts.get(checkpoint_id)
        return {str(i): c for i, c in sorted(cuts.items())} if cuts else None

    def completed(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` completed: the cuts of it and of older checkpoints are no longer needed."""
        self._cuts = {c: v for c, v in self._cuts.items() if c > checkpoint_id}

    def clear(self) -> None:
        """The parallelism changed: recorded cuts name subtasks of the old one."""
        self._cuts.clear()


def recorded_cuts(meta: CheckpointMetadata) -> dict[int, int]:
    """The cuts a completed checkpoint's record holds (subtask -> cut)."""
    cuts = meta.properties.get("cuts")
    if not isinstance(cuts, dict):
        return {}
    return {int(k): int(v) for k, v in cuts.items() if str(k).isdigit() and isinstance(v, int)}
