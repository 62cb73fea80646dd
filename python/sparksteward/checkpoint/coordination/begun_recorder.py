"""BegunRecorder: what every delivery of a state's newest begun checkpoint must share (its time, its
alignment and its FLIP-76 cuts), made durable in ``<root>/_begun`` (:mod:`~sparksteward.checkpoint.begun`),
owned by its :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

- **Begin.** :meth:`BegunRecorder.begun` gives a checkpoint the record an earlier delivery made durable
  (its cuts taken in, translated to the current parallelism), or writes a new one before any of its
  tasks runs. A new one's time is the clock's and its watermark the one the last completed checkpoint's
  event times advance it to, each never below those of the previous checkpoint or of any checkpoint
  begun before.
- **Cuts.** :meth:`BegunRecorder.cut` decides the cut that stands
  (:class:`~sparksteward.checkpoint.unaligned.coordinator_cuts.UnalignedCuts`) under the coordinator's
  lock, then returns once every cut recorded so far is durable: one write takes every cut recorded by
  then, so the subtasks that wait meanwhile need no write of their own. A task goes on only after
  this, so no output past a cut reaches a sink before the cut is durable.

Locks: :attr:`BegunRecorder.io` orders the record's writes. It is taken before the coordinator's
lock, never under it (the lock order documented in the coordinator); the write of new cuts runs
outside the coordinator's lock, so acks and heartbeats go on meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from sparksteward.checkpoint.begun import BegunRecord, CheckpointTime, read_begun
from sparksteward.checkpoint.lease import Fence
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.unaligned.coordinator_cuts import UnalignedCuts, translate_cuts
from sparksteward.errors import CheckpointOrderError

__all__ = ["BegunRecorder"]

_T = TypeVar("_T")


class BegunRecorder:
    """The durable begun record of one state and the cuts of its pending checkpoints (see the module
    docstring). ``lock``: the coordinator's; ``completed``: the retained record of a checkpoint id, if any."""

    def __init__(self, storage: CheckpointStorage, max_parallelism: int, lock: threading.RLock, lease: Fence,
                 completed: Callable[[int], CheckpointMetadata | None]) -> None:
        self.storage = storage
        self.max_parallelism = max_parallelism
        self.lease = lease
        self.cuts = UnalignedCuts(max_parallelism)   # FLIP-76, kept across the attempts of a checkpoint
        self.record: BegunRecord | None = None
        self.io = threading.Lock()   # taken before the coordinator's lock, never under it
        self._lock = lock
        self._completed = completed
        self._made = 0      # cuts recorded in memory so far, and how many of them are durable
        self._durable = 0

    def load(self) -> None:
        """Read the record a previous coordinator of the state left (a restarted driver)."""
        self.record = read_begun(self.storage.location)

    def begun(self, checkpoint_id: int, parallelism: int, unaligned: bool, now: float,
              previous: Iterable[CheckpointTime | None], advanced: int | None = None) -> BegunRecord:
        """The begun record of ``checkpoint_id`` (see the module docstring); ``previous``: the times of
        the checkpoints before it; ``advanced``: the watermark the last completed one's event times
        advance it to. The caller holds :attr:`io` and the coordinator's lock."""
        rec = self.record
        if rec is not None and rec.checkpoint_id == checkpoint_id:
            if rec.parallelism != parallelism or self.cuts.to_property(checkpoint_id) is None:
                cuts = translate_cuts(rec.cuts, rec.parallelism, parallelism, self.max_parallelism,
                                      f"checkpoint {checkpoint_id} of state {self.storage.state!r}")
                self.cuts.load(checkpoint_id, cuts)
                if rec.parallelism != parallelism:
                    rec = rec.with_cuts(cuts, parallelism)
                    rec.write(self.storage.location)
                    self.record = rec
            return rec
        time = CheckpointTime.choose(now, (*previous, rec.time if rec is not None else None), advanced)
        rec = BegunRecord(checkpoint_id, parallelism, time, unaligned)
        rec.write(self.storage.location)   # durable before any task of the checkpoint runs
        self.record = rec
        return rec

    def cut(self, checkpoint_id: int, decide: Callable[[UnalignedCuts, CheckpointMetadata | None], _T]) -> _T:
        """``decide(cuts, completed)`` (under the coordinator's lock) the cut that stands, then return it
        once every cut recorded so far is durable (an earlier write may have failed); a completed
        checkpoint's cuts (a re-run) are in its record already."""
        with self._lock:
            completed = self._completed(checkpoint_id)
            stands = decide(self.cuts, completed)
            if self.cuts.recorded_new:
                self._made += 1
            made = self._made if completed is None and self._made > self._durable else 0
        if made:
            self._make_durable(checkpoint_id, made)
        return stands

    def _make_durable(self, checkpoint_id: int, made: int) -> None:
        """Return once the first ``made`` cuts recorded are in the begun record."""
        with self.io:
            if self._durable >= made:
                return
            with self._lock:
                rec, upto = self.record, self._made
                if rec is None or rec.checkpoint_id != checkpoint_id:
                    raise CheckpointOrderError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} is no longer the newest begun "
                        f"(checkpoint {rec.checkpoint_id if rec else None} is): its cut is not recorded")
                self.lease.check()
                rec = rec.with_cuts(self.cuts.of(checkpoint_id))
            rec.write(self.storage.location)   # outside the lock: acks and heartbeats go on meanwhile
            with self._lock:
                self.record = rec
                self._durable = upto
