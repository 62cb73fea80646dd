"""PendingCheckpoint: everything of one pending checkpoint's current attempt, in one object (Flink's
``PendingCheckpoint``), owned by its :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

It holds what the subtasks acked (their handles, uploads and merged files, and the stats of each
ack), what executor agents sealed, which agent works on each subtask, the failures reported for
this attempt, and when its state stage started. A new attempt (:meth:`new_attempt`) draws a new
token and forgets the acks, failures, stats and start of the previous one; its uploads stay listed,
so they are deleted with the checkpoint's end unless something references them.

**Readiness** (Flink's ``PendingCheckpoint.isFullyAcknowledged``): :meth:`PendingCheckpoint.readiness`
decides, from what it holds and what it is given (the agents not heard from, the agent timeout,
the durable sizes of merged files), whether the attempt is READY to complete, WAITING (for acks, then
for seals) or FAILED (an upload or a seal failed, or an executor agent it waits for went silent),
with the sentence to say why. The commit loop of
:class:`~sparksteward.checkpoint.coordination.driver_service.StateService` waits on it, then completes or
aborts; ``complete`` itself refuses what is not fully acknowledged.

Not thread-safe: the coordinator's lock guards it, and it never leaves the coordinator: callers get a
:class:`PendingView` (a copy) or a :class:`Readiness`.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sparksteward.checkpoint.begun import CheckpointTime
from sparksteward.checkpoint.coordination.stats import SubtaskStats
from sparksteward.checkpoint.filemerging.space import is_merged
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle

__all__ = ["AckResult", "BeginResult", "Completion", "PendingCheckpoint", "PendingView", "Readiness", "Ready"]


class AckResult(enum.Enum):
    """How a pending checkpoint took an ack (a refused one raises instead)."""

    ACKED = "acked"          # the subtask's first ack of this attempt
    REPLACED = "replaced"    # another copy of the subtask (a retry, a speculative task) acked before: this one stands


class Ready(enum.Enum):
    """Whether a pending checkpoint can complete (see :class:`Readiness`)."""

    READY = "ready"       # every subtask acked and every merged file it needs is sealed
    WAITING = "waiting"   # for acks, then for seals
    FAILED = "failed"     # it cannot complete: commit aborts it


@dataclass(frozen=True, slots=True)
class Readiness:
    """What :meth:`PendingCheckpoint.readiness` decided, and why (``reason``: the sentence ``complete``
    raises while WAITING; what failed when FAILED; "" when READY)."""

    checkpoint_id: int
    state: Ready
    reason: str = ""
    waiting_for: tuple[str, ...] = ()   # WAITING: who ("subtask 3", "executor agent a"); FAILED: who failed
    silent: tuple[str, ...] = ()        # FAILED: the executor agents it waited for that went silent

    def abort_error(self, name: str, deleted: int) -> str:
        """The error commit raises once it aborted a FAILED checkpoint of keyed state ``name``
        (``deleted``: the uploaded files the abort deleted)."""
        if not self.silent:
            return f"checkpoint {self.checkpoint_id} of keyed state {name!r} was aborted: {self.reason}"
        return (f"checkpoint {self.checkpoint_id} of keyed state {name!r} was aborted ({deleted} files deleted): "
                f"{self.reason}. Apply the batch again with the same checkpoint_id")


@dataclass(frozen=True, slots=True)
class PendingView:
    """A copy of what a pending checkpoint's current attempt holds, taken under the coordinator's lock."""

    checkpoint_id: int
    attempt: str
    rerun: bool
    query: str | None
    acked: frozenset[int]                 # the subtasks whose ack it holds
    stats: Mapping[int, SubtaskStats]     # subtask -> its ack's stats
    sealed: Mapping[str, int]             # merged path -> the durable size a seal reported
    unsealed: Mapping[str, str]           # merged path the acks need beyond a sealed size -> its agent ("": unknown)
    stage_runs: int = 1                   # times the whole state stage ran in this attempt (PendingCheckpoint.stage_runs)
    unopened: tuple[int, ...] = ()        # subtasks no task of this attempt opened yet


@dataclass(frozen=True, slots=True)
class BeginResult:
    """What every attempt of checkpoint ``checkpoint_id`` starts from."""

    checkpoint_id: int
    base: CheckpointMetadata | None       # None: start from an empty state
    known: Mapping[str, tuple[str, int]]  # checksum -> (path, offset) of every file the base holds that
                                          # the next checkpoint may reuse (space control leaves some out)
    rerun: bool                           # True: checkpoint_id already completed (a re-run)
    attempt: str = ""                     # this attempt's token: acks and failures must carry it
    time: CheckpointTime | None = None    # the checkpoint's time, the same in every attempt and delivery
    unaligned: bool = False               # the alignment it runs with, the same in every delivery
    states: dict[str, object] | None = None   # the declared variables this attempt's tasks run with (a begin)


@dataclass(frozen=True, slots=True)
class Completion:
    """A completed checkpoint's record, and the attempt that completed it (None: it had completed before)."""

    metadata: CheckpointMetadata
    attempt: PendingView | None


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
    opens: dict[int, int] = field(default_factory=dict)     # subtask -> how many tasks opened it in this attempt

    def new_attempt(self, query: str | None) -> None:
        """The driver begins the checkpoint again: earlier acks are replaced as the new ones arrive."""
        self.acks.clear()
        self.stats.clear()
        self.failures.clear()
        self.failed.clear()
        self.opens.clear()
        self.stage_started = None
        self.attempt = _token()
        self.query = self.query or query

    def missing(self, parallelism: int) -> list[int]:
        """The subtasks that have not acked this attempt."""
        return sorted(set(range(parallelism)) - set(self.acks))

    def stage_runs(self, parallelism: int) -> int:
        """How many times this attempt's whole state stage ran: the fewest opens of any subtask (a
        second action on a lazy output runs every subtask again; a retried or speculative task, one)."""
        return min((self.opens.get(s, 0) for s in range(parallelism)), default=0)

    def view(self, unsealed: Mapping[str, str], parallelism: int) -> PendingView:
        """A copy of the current attempt (``unsealed``: from :meth:`unsealed_by`)."""
        return PendingView(self.checkpoint_id, self.attempt, self.rerun, self.query, frozenset(self.acks),
                           dict(self.stats), dict(self.sealed), dict(unsealed), self.stage_runs(parallelism),
                           tuple(s for s in range(parallelism) if not self.opens.get(s)))

    # --- readiness ---------------------------------------------------------------------------------
    def readiness(self, parallelism: int, state: str, unsealed: Mapping[str, str], *, now: float,
                  agent_timeout: float, silent: Callable[[set[str]], list[str]]) -> Readiness:
        """Whether this attempt can complete (see the module docstring). FAILED when a failure dooms it
        (:meth:`fatal_failures`) or when an executor agent it waits for is ``silent`` (of the agents
        given, those not heard from for ``agent_timeout``): one holding merged files it needs, or one
        that opened a subtask that has not acked. Else as :meth:`fully_acknowledged`. ``state``: the
        state's name; ``unsealed``: :meth:`unsealed_by`; ``now``: monotonic."""
        failures = self.fatal_failures(now, agent_timeout)
        if failures:
            return Readiness(self.checkpoint_id, Ready.FAILED, f"uploads failed ({'; '.join(failures.values())})",
                             tuple(failures))
        holders = set(unsealed.values())
        opened = {i: a for i, a in self.working.items() if i not in self.acks}
        gone = silent(holders | set(opened.values()))
        if gone:
            lost = sorted(i for i, a in opened.items() if a in gone)
            what = (["hold merged checkpoint files it needs"] if holders & set(gone) else []) + \
                ([f"were uploading its subtasks {lost} (not acked)"] if lost else [])
            return Readiness(self.checkpoint_id, Ready.FAILED,
                             f"executor agents {gone} {' and '.join(what)} and have not answered for "
                             f"{agent_timeout:g} s (their executor was lost?)",
                             tuple(f"executor agent {a}" for a in gone), tuple(gone))
        return self.fully_acknowledged(parallelism, state, unsealed)

    def fully_acknowledged(self, parallelism: int, state: str, unsealed: Mapping[str, str]) -> Readiness:
        """READY once every subtask acked and (unless it is a re-run, whose first result stands) every
        merged file its acks need is sealed; else WAITING, with the sentence ``complete`` raises."""
        missing = self.missing(parallelism)
        where = f"checkpoint {self.checkpoint_id} of state {state!r} cannot complete"
        if missing:
            return Readiness(self.checkpoint_id, Ready.WAITING,
                             f"{where}: subtasks {missing} of {parallelism} have not acked (their task failed or "
                             f"is still uploading)", tuple(f"subtask {i}" for i in missing))
        if unsealed and not self.rerun:
            agents = sorted(set(unsealed.values()))
            return Readiness(self.checkpoint_id, Ready.WAITING,
                             f"{where}: {len(unsealed)} merged files are not sealed yet by executor agents {agents}",
                             tuple(f"executor agent {a}" for a in agents))
        return Readiness(self.checkpoint_id, Ready.READY)

    # --- the tasks at work -------------------------------------------------------------------------
    def working_on(self, subtask: int, agent: str, now: float) -> None:
        """``agent`` opened or uploads ``subtask`` (``now``: monotonic)."""
        self.working[subtask] = agent
        self.copies.setdefault(subtask, {})[agent] = now

    def stage_start(self, now: float) -> float:
        """When the state stage of this attempt started: the first call's ``now`` (monotonic)."""
        if self.stage_started is None:
            self.stage_started = now
        return self.stage_started

    def report_failure(self, who: str, message: str, subtask: int | None, agent: str, others: int,
                       now: float) -> str | None:
        """``who`` reports that an upload or a seal failed (see :meth:`fatal_failures`); returns why the
        report is ignored (another copy of the subtask acked), else None."""
        if subtask is not None and subtask in self.acks:
            return "another copy of it acked"
        self.failures[who] = f"{who}: {message}"
        if subtask is not None:
            self.failed[subtask] = (agent, max(0, int(others)), now)
            self.copies.get(subtask, {}).pop(agent, None)   # its word from before the failure
        return None

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

    def record_properties(self, referenced: set[str], *, key_column: str | None,
                          cuts: tuple[Mapping[str, int], Mapping[str, int]] | None,
                          claimed: set[str], sizes: Mapping[str, int], states: object,
                          event_time: Mapping[str, object] | None = None) -> dict[str, object]:
        """The ``properties`` of the record this attempt completes as (its acks reference ``referenced``):
        its base, key column, time, query, FLIP-76 ``cuts`` (and ``cut_rows``, where a cut splits a key group), the ``claimed`` files it references, the
        durable ``sizes`` of its merged files, the declared ``states``, the ``event_time`` column and
        delay and the largest event time its acks saw (``max_event_ms``; each only when present)."""
        properties: dict[str, object] = {"base": self.base_id}
        if key_column:
            properties["key"] = key_column
        if self.time is not None:
            properties["time"] = self.time.to_json()
        if event_time:
            properties["event_time"] = dict(event_time)
        seen = [s.max_event_ms for s in self.stats.values() if s.max_event_ms is not None]
        if seen:
            properties["max_event_ms"] = max(seen)
        if self.query is not None:
            properties["query"] = self.query
        if cuts:
            properties["cuts"] = cuts[0]
            if cuts[1]:
                properties["cut_rows"] = cuts[1]
        claimed_here = sorted(referenced & claimed)
        if claimed_here:
            properties["claimed"] = claimed_here
        merged = sorted(p for p in referenced if is_merged(p))
        if merged:
            properties["merged"] = {p: sizes.get(p, 0) for p in merged}
        if states:
            properties["states"] = states
        return properties

    def unsealed_by(self, base: CheckpointMetadata | None, sizes: Mapping[str, int]) -> dict[str, str]:
        """The merged files the current acks need beyond a durable size (:meth:`not_durable`) -> the
        agent that writes each ("" if no ack listed it)."""
        return {p: self.writers.get(p) or self.unsealed.get(p, "") for p in self.not_durable(base, sizes)}

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
