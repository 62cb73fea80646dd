"""UnalignedCuts: where each subtask of a pending checkpoint stops processing new input (FLIP-76),
kept by the :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator` across the attempts
of that checkpoint.

A cut (:class:`~sparksteward.checkpoint.begun.Cut`) is the first key group whose new input a subtask
defers into channel state (the end of its key-group range: nothing deferred), with the rows of that
key group processed before it (0 unless the function takes a key's rows in chunks). The first attempt to propose one records it; every later
attempt, a re-run of the completed checkpoint included, gets the same, so every attempt of a
checkpoint processes the same rows. A completed checkpoint's cuts live in its record
(``properties.cuts`` and ``properties.cut_rows``); the pending ones here until a newer checkpoint completes or the state
rescales (cuts name subtasks of one parallelism).

Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

from sparksteward.checkpoint.begun import Cut, cuts_json, cuts_of
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.errors import CheckpointOrderError, InvalidRecordError
from sparksteward.state.keygroups import key_group_range

__all__ = ["UnalignedCuts"]


class UnalignedCuts:
    """The recorded cuts of one state's pending checkpoints (see the module docstring)."""

    def __init__(self, max_parallelism: int) -> None:
        self.max_parallelism = max_parallelism
        self._cuts: dict[int, dict[int, Cut]] = {}   # checkpoint -> subtask -> its cut
        self.recorded_new = False   # whether the last cut() or amend() changed what is recorded

    def of(self, checkpoint_id: int) -> dict[int, Cut]:
        """The cuts recorded for ``checkpoint_id`` (subtask -> cut)."""
        return dict(self._cuts.get(checkpoint_id, {}))

    def load(self, checkpoint_id: int, cuts: dict[int, Cut]) -> None:
        """Take the cuts an earlier delivery of ``checkpoint_id`` made durable (the begun record);
        cuts recorded here since stay."""
        self._cuts[checkpoint_id] = {**cuts, **self._cuts.get(checkpoint_id, {})}

    def cut(self, checkpoint_id: int, subtask: int, parallelism: int, proposed: Cut | None,
            completed: CheckpointMetadata | None) -> Cut | None:
        """The cut that stands for ``subtask``; ``proposed`` is recorded if none is. ``completed``: the
        checkpoint's record if it completed (a re-run keeps its cuts: none recorded means none made).
        None when nothing is recorded and nothing is proposed."""
        self.recorded_new = False
        if completed is not None:
            stop = key_group_range(self.max_parallelism, completed.parallelism, subtask).stop
            return recorded_cuts(completed).get(subtask, Cut(stop))
        cuts = self._cuts.setdefault(checkpoint_id, {})
        if proposed is not None and subtask not in cuts:
            expected = key_group_range(self.max_parallelism, parallelism, subtask)
            if not expected.start <= proposed.group <= expected.stop or proposed.rows < 0 or \
                    (proposed.rows and proposed.group == expected.stop):
                inside = f" (after {proposed.rows} of its rows)" if proposed.rows else ""
                raise InvalidRecordError(f"cut {proposed.group}{inside} of subtask {subtask} lies outside its key "
                                         f"groups {expected}")
            cuts[subtask] = proposed
            self.recorded_new = True
        return cuts.get(subtask)

    def amend(self, checkpoint_id: int, subtask: int, parallelism: int, cut: Cut,
              completed: CheckpointMetadata | None) -> Cut:
        """``subtask`` could not defer past ``cut`` (its channel state would pass the byte cap, which
        every attempt at that cut finds alike): from now on it processes everything. Returns the cut
        that stands."""
        recorded = self.cut(checkpoint_id, subtask, parallelism, None, completed)
        stop = Cut(key_group_range(self.max_parallelism, parallelism, subtask).stop)
        if recorded == cut and completed is None and cut != stop:
            self._cuts[checkpoint_id][subtask] = stop
            self.recorded_new = True
            return stop
        return recorded if recorded is not None else stop

    def to_property(self, checkpoint_id: int) -> tuple[dict[str, int], dict[str, int]] | None:
        """The cuts of ``checkpoint_id`` as its record's ``cuts`` and ``cut_rows`` properties (None: none
        made)."""
        cuts = self._cuts.get(checkpoint_id)
        return cuts_json(cuts) if cuts else None

    def completed(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` completed: the cuts of it and of older checkpoints are no longer needed."""
        self._cuts = {c: v for c, v in self._cuts.items() if c > checkpoint_id}

    def clear(self) -> None:
        """The parallelism changed: recorded cuts name subtasks of the old one."""
        self._cuts.clear()


def recorded_cuts(meta: CheckpointMetadata) -> dict[int, Cut]:
    """The cuts a completed checkpoint's record holds (subtask -> cut); a record written before
    ``cut_rows`` existed reads as cuts at key-group boundaries."""
    cuts = meta.properties.get("cuts")
    if not isinstance(cuts, dict):
        return {}
    try:
        return cuts_of(cuts, meta.properties.get("cut_rows") or {})
    except ValueError as exc:
        raise InvalidRecordError(f"checkpoint {meta.checkpoint_id} of state {meta.state!r}: {exc}") from None


def translate_cuts(cuts: dict[int, Cut], old_parallelism: int, parallelism: int, max_parallelism: int,
                   what: str) -> dict[int, Cut]:
    """The cuts of ``parallelism`` subtasks that defer exactly the key groups ``cuts`` (of
    ``old_parallelism`` subtasks) deferred: a checkpoint re-delivered after a rescale must process and
    defer what its first delivery did. A subtask whose range no recorded cut constrains gets none (no
    attempt of the old one finished, so no output of it reached a sink: its clock decides). Raises
    :class:`~sparksteward.errors.CheckpointOrderError` when the deferred key groups of a new subtask's
    range are not one suffix of it (a cut cannot express them)."""
    if old_parallelism == parallelism:
        return dict(cuts)
    must_process: set[int] = set()
    must_defer: set[int] = set()
    split: dict[int, Cut] = {}   # a key group a cut splits inside: processed up to its row
    for s, c in cuts.items():
        r = key_group_range(max_parallelism, old_parallelism, s)
        must_process.update(range(r.start, c.group))
        must_defer.update(range(c.group + (1 if c.rows else 0), r.stop))
        if c.rows:
            split[c.group] = c
    out: dict[int, Cut] = {}
    for s in range(parallelism):
        r = key_group_range(max_parallelism, parallelism, s)
        defer = [g for g in range(r.start, r.stop) if g in must_defer]
        process = [g for g in range(r.start, r.stop) if g in must_process]
        inside = [split[g] for g in range(r.start, r.stop) if g in split]
        if not defer and not process and not inside:
            continue
        cut = inside[0] if inside else Cut(min(defer) if defer else r.stop)
        if (process and max(process) >= cut.group) or (defer and min(defer) < cut.group + (1 if cut.rows else 0)) \
                or len(inside) > 1:
            raise CheckpointOrderError(
                f"{what} was begun unaligned at parallelism {old_parallelism}, and its first delivery may have "
                f"emitted the output of the rows its cuts kept while deferring the rest; at parallelism "
                f"{parallelism} subtask {s} (key groups {r.start}-{r.stop - 1}) cannot defer the same key groups. "
                f"Run this batch at parallelism {old_parallelism} (st.keyed_state(..., parallelism="
                f"{old_parallelism})), then rescale from the next one")
        out[s] = cut
    return out
