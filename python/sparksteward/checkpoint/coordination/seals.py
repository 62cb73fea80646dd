"""MergedFileSeals: the FLIP-306 seal bookkeeping of one keyed state across the attempts of its
checkpoints, owned by its :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

A subtask's small files are segments of ``merged/<uuid>`` physical files that its executor agent
writes for all the subtasks that ran there. An ack lists them as *unsealed*; once every subtask has
acked, :meth:`MergedFileSeals.wanted` tells the agents to seal (fsync and upload), and ``complete``
waits until every segment the acks reference (state and channel state) lies within a size a seal
reported (``across`` files grow across checkpoints, so a file a retained checkpoint holds is sealed
again for what was appended since; see :meth:`PendingCheckpoint.not_durable
<sparksteward.checkpoint.coordination.pending.PendingCheckpoint.not_durable>`). The record lists that
durable size of each physical file in ``properties.merged``. A physical file is counted like any
other path: it goes once no retained checkpoint references it. After each completion, space control
(``max_space_amplification``, :class:`~sparksteward.checkpoint.coordination.completed.CompletedCheckpoints`)
marks the most wasteful physical files no-reuse: ``known`` leaves their segments out, so the next
checkpoint writes them again, and the old files go with the checkpoints that reference them.

What one attempt acked and sealed lives in its
:class:`~sparksteward.checkpoint.coordination.pending.PendingCheckpoint`; what outlives an attempt is
here: the ``across``-mode files each agent still appends to, which are never deleted while it says
they are open, and which no other agent may name. An agent seals only files its own acks listed; a
seal of a replaced attempt records nothing.

Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from sparksteward.checkpoint.coordination.pending import PendingCheckpoint
from sparksteward.checkpoint.filemerging.file_merger import MergingMode, MergingOptions
from sparksteward.checkpoint.filemerging.space import is_merged
from sparksteward.errors import InvalidRecordError

__all__ = ["MergedFileSeals"]

log = logging.getLogger("sparksteward.checkpoint.coordination.seals")


class MergedFileSeals:
    """The seals and open ``across`` files of one state (see the module docstring)."""

    def __init__(self, state: str, merging: MergingOptions) -> None:
        self.state = state
        self.merging = merging
        self._open: dict[str, set[str]] = {}  # agent -> across-mode merged files it still appends to

    # --- what agents do ----------------------------------------------------------------------------
    @staticmethod
    def wanted(pending: PendingCheckpoint | None, parallelism: int) -> str:
        """What an agent holding unsealed files of a checkpoint should do: ``seal`` (every subtask of
        ``pending`` acked), ``wait``, or ``discard`` (it is not pending, or is a re-run whose first
        result stands)."""
        if pending is None or pending.rerun:
            return "discard"
        return "seal" if len(pending.acks) >= parallelism else "wait"

    @staticmethod
    def check_paths(files: Iterable[str]) -> None:
        """Refuse a seal naming a path that is not a merged file."""
        bad = [p for p in files if not is_merged(p)]
        if bad:
            raise InvalidRecordError(f"sealed files {bad} are not merged/ paths (merged/<32 hex>)")

    def take(self, checkpoint_id: int, pending: PendingCheckpoint | None, files: Mapping[str, int], agent: str,
             attempt: str | None) -> bool:
        """``agent`` says ``files`` (merged path -> size) of ``checkpoint_id`` are durable. Only files its
        acks of the pending attempt listed are taken; a seal of another ``attempt`` (asked for before
        an abort or a coordinator restart) records nothing: the current attempt's own seal follows.
        Returns True when nothing will reference the files (``checkpoint_id`` is not pending): the
        caller deletes them as late uploads."""
        if pending is not None and attempt is not None and attempt != pending.attempt:
            log.info("seal of %d merged files of checkpoint %d of %s by %r ignored: it belongs to a "
                     "replaced attempt", len(files), checkpoint_id, self.state, agent)
            return False
        foreign = pending.foreign(files, agent) if pending is not None else []
        if foreign:
            raise InvalidRecordError(
                f"seal of checkpoint {checkpoint_id} of state {self.state!r} by executor agent "
                f"{agent!r}: {foreign} are not merged files its acks listed; an agent seals only the "
                f"files it wrote")
        if pending is None:   # too late: nothing will reference them
            return True
        if pending.rerun:     # the first result stands: they go with the checkpoint's end
            pending.uploaded.update(files)
        else:
            pending.seal(files, agent)
        return False

    # --- across-mode files agents still append to ----------------------------------------------------
    def acked(self, agent: str, merged: Iterable[str]) -> None:
        """An ack of ``agent`` listed ``merged``: in ``across`` mode it appends to them until it closes them."""
        merged = set(merged)
        if merged and self.merging.mode is MergingMode.ACROSS:
            self._open.setdefault(agent, set()).update(merged)

    def check_writer(self, who: str, pending: PendingCheckpoint, merged: Iterable[str], agent: str) -> None:
        """Refuse an ack (``who``) of ``agent`` listing merged files another agent writes: an ack of it
        listed them, or it still appends to them."""
        merged = list(merged)
        taken = sorted(set(pending.foreign(merged, agent))
                       | {p for p in merged if any(p in files for a, files in self._open.items() if a != agent)})
        if taken:
            raise InvalidRecordError(f"{who}: merged files {taken} are written by another executor agent, "
                                     f"not {agent!r}")

    def close(self, agent: str, paths: set[str] | None = None) -> set[str]:
        """``agent`` stopped appending to ``paths`` (None: to all, e.g. it went silent); return those it
        held, which are subject to the reference counts again."""
        held = self._open.get(agent, set())
        released = set(held) if paths is None else held & set(paths)
        held -= released
        if not held:
            self._open.pop(agent, None)
        return released

    def held(self) -> set[str]:
        """Every file an agent still appends to: never deleted."""
        out: set[str] = set()
        out.update(*self._open.values())
        return out
