"""PendingCheckpoint: everything of one pending checkpoint's current attempt, in one object (Flink's
``PendingCheckpoint``), owned by its :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

It holds what the subtasks acked (their handles, uploads and merged files, and the stats of each
ack), what executor agents sealed, which agent works on each subtask, the failures reported for
this attempt, and when its state stage started. A new attempt (:meth:`new_attempt`) draws a new
token and forgets the acks, failures, stats and start of the previous one; its uploads stay listed,
so they are deleted with the checkpoint's end unless something references them.

Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sparksteward.checkpoint.begun import CheckpointTime
from sparksteward.checkpoint.filemerging.file_merger import is_merged
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.coordination.stats import SubtaskStats

__all__ = ["AckResult", "PendingCheckpoint"]


class AckResult(enum.Enum):
    """How a pending checkpoint took an ack (a refused one raises instead)."""

    ACKED = "acked"          # the subtask's first ack of this attempt
    REPLACED = "replaced"    # another copy of the subtask (a retry, a speculative task) acked before: this one stands


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
    copies: dict[int, dict[str, float]] = field(default_factory=dict)   # subtask -> agent -> when (monotonic) it
                                                             # last said it opened or uploads it
    failed: dict[int, tuple[str, int, float]] = field(default_factory=dict)   # subtask -> (agent, other copies
                                                             # there, when) of its latest failed upload
    stage_started: float | None = None                       # monotonic time of the attempt's first open
    time: CheckpointTime | None = None                       # the checkpoint's time (every attempt and delivery)

    def new_attempt(self, query: str | None) -> None:
        """The driver begins the checkpoint again: earlier acks are replaced as the new ones arrive."""
        self.acks.clear()
        self.stats.clear()
        self.failures.clear()
        self.failed.clear()
        self.stage_started = None
        self.attempt = _token()
        self.query = self.query or query

    def missing(self, parallelism: int) -> list[int]:
        """The subtasks that have not acked this attempt."""
        return sorted(set(range(parallelism)) - set(self.acks))

    # --- acks and seals ----------------------------------------------------------------------------
    def take_files(self, uploaded: Iterable[str], merged: Iterable[str], agent: str, *, replaced: bool = False) -> None:
        """Record what an ack uploaded, before it is checked further: even a refused ack's uploads
        are deleted with the checkpoint's end unless referenced, and ``agent`` may seal the merged
        files it listed. ``replaced``: the ack belongs to a replaced attempt, whose merged files the
        current attempt's agent keeps writing if it listed them first."""
        merged = list(merged)
        self.uploaded.update(uploaded)
        self.uploaded.update(merged)
        for p in merged:
            if replaced:
                self.writers.setdefault(p, agent)
                continue
            self.writers[p] = agent
            sealer, size = self.early.pop(p, ("", 0))
            if sealer == agent:   # its agent sealed it before this ack arrived: the seal stands
                self.sealed[p] = max(self.sealed.get(p, 0), size)

    def acknowledge(self, handle: SubtaskHandle, merged: Iterable[str], agent: str,
                    stats: SubtaskStats | None) -> AckResult:
        """Take subtask ``handle.subtask``'s ack (checked by the coordinator); it clears a failure
        reported for the same subtask, and a re-run keeps the first result's stats."""
        result = AckResult.REPLACED if handle.subtask in self.acks else AckResult.ACKED
        self.acks[handle.subtask] = handle
        self.failures.pop(f"subtask {handle.subtask}", None)
        self.failed.pop(handle.subtask, None)
        if stats is not None and not self.rerun:
            self.stats[handle.subtask] = stats
        for p in merged:
            if p not in self.sealed:
                self.unsealed[p] = agent
        return result

    def fatal_failures(self, now: float, agent_timeout: float) -> dict[str, str]:
        """The reported failures that doom this attempt: a seal's, and a subtask's upload unless
        another copy of that subtask (a speculative or retried task) may still ack: on another agent
        that said it works on the subtask within ``agent_timeout``, or on the failing agent itself,
        which counted other copies when it failed and keeps saying so (``now``: monotonic)."""
        out = {}
        for who, message in self.failures.items():
            subtask = int(who.split()[1]) if who.startswith("subtask ") else None
            if subtask is not None and subtask in self.failed:
                agent, others, when = self.failed[subtask]
                seen = self.copies.get(subtask, {})
                if any(now - t < agent_timeout for a, t in seen.items() if a != agent):
                    continue
                if others and (now - when < agent_timeout or seen.get(agent, 0.0) > when):
                    continue
            out[who] = message
        return out

    def foreign(self, files: Iterable[str], agent: str) -> list[str]:
        """Those of ``files`` an ack of another agent than ``agent`` listed."""
        return sorted(p for p in files if self.writers.get(p, agent) != agent)

    def seal(self, files: Mapping[str, int], agent: str) -> None:
        """``agent`` says ``files`` (merged path -> size) are durable. A file no ack listed yet (a seal
        covers the agent's whole pool) counts once that agent's ack lists it."""
        for p, size in files.items():
            if p not in self.writers:
                self.early[p] = (agent, int(size))
                continue
            self.unsealed.pop(p, None)
            self.sealed[p] = max(self.sealed.get(p, 0), int(size))
            self.uploaded.add(p)

    def not_durable(self, base: CheckpointMetadata | None, sizes: Mapping[str, int]) -> set[str]:
        """Merged files that a segment (state or channel state) of the current acks lies beyond the
        durable size of: the largest a seal of this checkpoint or a retained record (``sizes``)
        reported. ``across`` files grow across checkpoints, so a file a retained checkpoint holds
        needs a seal again for the segments appended since; a checkpoint never completes pointing at
        bytes that are missing or not synced. A segment the base itself references is durable (a
        record written before sizes were checked may list a smaller size)."""
        reused = {(f.path, f.offset, f.length) for f in base.files()} if base is not None else set()
        out = set()
        for h in self.acks.values():
            for f in h.all_files:
                if not is_merged(f.path) or f.path in out:
                    continue
                durable = max(self.sealed.get(f.path, -1), sizes.get(f.path, -1))
                if f.offset + f.length > durable and (f.path, f.offset, f.length) not in reused:
                    out.add(f.path)
        return out
