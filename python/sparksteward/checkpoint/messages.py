"""Typed messages of the checkpoint ops between the processes of a task (see
:mod:`sparksteward.wire.messages`): those the executor agent's
:class:`~sparksteward.checkpoint.task.task_state.SubtaskService` sends to the driver agent's
:class:`~sparksteward.checkpoint.coordination.gateway.CheckpointGateway` (``state.base``, ``state.cut``,
``state.ack``, ``state.fail``, ``state.merge_poll``, ``state.sealed``), and those a Python worker
(:mod:`sparksteward.keyed_tasks`) sends to its executor agent (``state.open``, ``state.task_cut``,
``state.upload``, ``state.release``). The driver's own ops (register, begin, commit, ...) are in
:mod:`sparksteward.checkpoint.lifecycle_messages`.

**Task counters are typed end to end.** The task counts what it did (:class:`TaskCounters`) and sends
them with ``state.upload``; the executor agent extends them with its own measurements
(:class:`SubtaskStats`, a subclass) and forwards them with ``state.ack``; the driver agent sums them per
checkpoint (:func:`~sparksteward.checkpoint.coordination.stats.summarize`). A new counter is one field
of :class:`TaskCounters`; ``tests/checkpoint/coordination/test_stats_fields.py`` fails when a field does not reach
the checkpoint's stats.

**The base of an attempt is sent once per executor agent.** Every task of a checkpoint asks
``state.base`` (the ask records which agent works on which subtask and returns its cut), but the base
record and its known files are the same for every subtask of one attempt, and can be large. An agent
names the attempt whose base it holds (``have``); when that is still the current attempt, the reply
leaves them out (``same_base``) and the agent reuses its copy (:meth:`BaseReply.resolve`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.errors import InvalidRecordError
from sparksteward.wire.fields import Fields
from sparksteward.wire.messages import (
    MAX_CHECKPOINT_ID,
    MAX_PARALLELISM,
    Message,
    custom,
    flag,
    integer,
    mapping,
    message_list,
    nested,
    number,
    op,
    sequence,
    text,
)

__all__ = ["AckReply", "AckRequest", "BaseReply", "BaseRequest", "CheckpointRef", "ClosedFile", "CutReply",
           "CutRequest", "FailReply", "FailRequest", "MergePollReply", "MergePollRequest", "OpenReply", "OpenRequest",
           "ReleaseReply", "ReleaseRequest", "ReplayFile", "SealAction", "SealedFile", "SealedReply", "SealedRequest",
           "SubtaskStats", "TaskCounters", "TaskCutRequest", "UploadReply", "UploadRequest", "WorkingSubtask"]

_MANY = 1 << 20   # the bound of lists that name files or subtasks (a request is bounded in bytes anyway)
#: the most DBs a Python worker holds open after their uploads (decision 0026)
_HELD_MAX = 64


def _name() -> Any:
    """The state a request names."""
    return text(max_len=200)


def _zero_or_one() -> Any:
    """A yes or no sent as the integer 0 or 1 (as the task always sent it)."""
    return custom(lambda f, n: bool(f.integer(n, default=0, lo=0, hi=1)), int, default=False)


# --- task counters and subtask stats ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TaskCounters(Message):
    """What a task counted while it ran one subtask of a checkpoint (built by the Python worker, carried
    by ``state.upload``). Every field reaches the checkpoint's stats, summed over the subtasks unless
    :data:`~sparksteward.checkpoint.coordination.stats.PER_SUBTASK` lists it."""

    rows_processed: int = integer(default=0, lo=0)      # rows the function processed (replayed ones included)
    rows_deferred: int = integer(default=0, lo=0)       # FLIP-76: rows deferred into the channel state
    channel_bytes: int = integer(default=0, lo=0)       # FLIP-76: the bytes of that channel-state file
    unaligned: bool = _zero_or_one()                    # FLIP-76: the subtask deferred rows
    wal_bytes: int = integer(default=0, lo=0)           # the WAL the open replayed
    ttl_expired_removed: int = integer(default=0, lo=0)  # expired state entries the TTL sweep removed
    ttl_sweep_ms: int = integer(default=0, lo=0)        # the time of that sweep
    ttl_timers_dropped: int = integer(default=0, lo=0)  # timers of keys whose every entry expired (0028)
    rows_out: int = integer(default=0, lo=0)            # rows the state function returned
    keys_touched: int = integer(default=0, lo=0)        # distinct keys of the rows processed
    entries_estimate: int = integer(default=0, lo=0)    # RocksDB's estimate-num-keys at the sync phase
    entries_ingested: int = integer(default=0, lo=0)    # entries put in as ingested SSTs (decision 0023)
    open_ms: int = integer(default=0, lo=0)             # state.open as the task waited for it (base and restore)
    db_open_ms: int = integer(default=0, lo=0)          # opening RocksDB in the task (0: a kept DB, decision 0026)
    kept_open: int = integer(default=0, lo=0)           # 1 a task that went on with the DB its worker kept (0026)
    late_rows: int = integer(default=0, lo=0)           # rows at or below the watermark (decision 0028)
    timers_fired: int = integer(default=0, lo=0)        # timers the batch fired (decision 0028)
    initial_rows: int = integer(default=0, lo=0)        # rows of the initial state the first batch applied
    next_timer_ms: int | None = integer(default=None, omit_none=True)   # the earliest processing-time timer left
    next_event_timer_ms: int | None = integer(default=None, omit_none=True)   # ... and event-time timer
    max_event_ms: int | None = integer(default=None, omit_none=True)   # the largest event time seen (None: none)

    @classmethod
    def counted(cls, counts: Mapping[str, int]) -> TaskCounters:
        """The counters a task counted into a dict as it ran (``unaligned`` as 0 or 1); a name that is
        not a field is refused (TypeError)."""
        fields: dict[str, Any] = {**counts, "unaligned": bool(counts.get("unaligned"))}
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class SubtaskStats(TaskCounters):
    """One subtask's ack (``state.ack``'s ``stats``): the task's counters, and what the executor agent
    measured: its upload (files and bytes written and reused), its sync phase, its restore (None unless
    this attempt restored from a base), the local snapshot and the async phase."""

    unaligned: bool = flag(default=False)             # the same counter, a JSON boolean on this wire
    files_uploaded: int = integer(default=0)
    bytes_uploaded: int = integer(default=0)
    whole_files_uploaded: int | None = integer(default=None)   # files written whole (the rest: merged segments)
    segments_written: int = integer(default=0)        # no bound: a difference
    files_reused: int = integer(default=0)
    files: int = integer(default=0)
    bytes: int = integer(default=0)
    sync_ms: float = number(default=0.0, lo=0)
    flush_ms: float = number(default=0.0, lo=0)       # within sync_ms: a flush, or the wait for one
    restore: dict[str, Any] | None = mapping(default=None)
    local_bytes: int = integer(default=0)             # the local snapshot (the DB's live files) on the executor
    async_ms: float = number(default=0.0, lo=0)       # the async phase: upload (and merge) until the ack

    @classmethod
    def of(cls, counters: TaskCounters, **measured: Any) -> SubtaskStats:
        """``counters`` (every field of :class:`TaskCounters`) extended with the executor agent's
        ``measured`` fields."""
        return cls(**{f.name: getattr(counters, f.name) for f in dataclasses.fields(TaskCounters)}, **measured)


# --- the executor agent's ops on the driver agent --------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class BaseReply(Message):
    """What a subtask of checkpoint ``checkpoint_id`` restores and how it runs (``state.base``)."""

    checkpoint_id: int = integer(lo=0)
    attempt: str = text(default="", max_len=64)
    rerun: bool = flag(default=False)
    checkpoint_dir: str = text(max_len=4096)
    cluster_id: str = text(max_len=200)
    parallelism: int = integer(lo=1)
    max_parallelism: int = integer(lo=1)
    key_type: str = text(max_len=16)
    base: CheckpointMetadata | None = custom(lambda f, n: _base(f.req), default=None)   # None: an empty state
    known: dict[str, tuple[str, int]] = custom(lambda f, n: _known(f.mapping(n, default=None) or {},
                                                                   f.req.get("checkpoint_id")), default={})
    merging: dict[str, Any] = mapping(default={})
    alignment: dict[str, Any] = mapping(default={})
    deadline_in: float | None = number(default=None, lo=0)   # unaligned: seconds until the subtask defers input
    cut: int | None = integer(default=None, lo=0)             # FLIP-76: the cut an earlier attempt recorded
    cut_rows: int = integer(default=0, lo=0)                  # ... after that many rows of its key group
    same_base: bool = flag(default=False)                     # base and known left out: the agent holds them

    def to_json(self, *, with_base: bool = True) -> dict[str, Any]:
        """The reply's JSON object; without ``with_base``, the base and the known files are left out
        (``same_base``)."""
        left_out = ("same_base",) if with_base else ("same_base", "base", "known")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in left_out}
        if with_base:
            out["base"] = None if self.base is None else self.base.to_json()
            out["known"] = {k: list(v) for k, v in self.known.items()}
        else:
            out["same_base"] = True
        return out

    def to_wire(self) -> dict[str, Any]:
        return self.to_json(with_base=not self.same_base)

    def resolve(self, held: BaseReply | None) -> BaseReply:
        """This reply with its base: a ``same_base`` reply takes it from ``held``, the reply of the
        attempt the request named in ``have``."""
        if not self.same_base:
            return self
        if held is None or (held.checkpoint_id, held.attempt) != (self.checkpoint_id, self.attempt):
            raise InvalidRecordError(f"the driver agent left out the base of checkpoint {self.checkpoint_id} (attempt "
                                     f"{self.attempt}), which this executor agent does not hold")
        return dataclasses.replace(self, base=held.base, known=held.known, same_base=False)

    @classmethod
    def from_reply(cls, reply: dict[str, Any], held: BaseReply | None = None) -> BaseReply:
        """Read a ``state.base`` reply, with its base (see :meth:`resolve`)."""
        return cls.from_wire(reply, "state.base reply").resolve(held)


def _base(reply: dict[str, Any]) -> CheckpointMetadata | None:
    raw = reply.get("base")
    if raw is None:
        return None
    return CheckpointMetadata.from_bytes(orjson.dumps(raw), f"the base of checkpoint {reply.get('checkpoint_id')}")


def _known(raw: dict[str, Any], cid: Any) -> dict[str, tuple[str, int]]:
    """The ``known`` field: checksum -> [path, offset]; anything else is refused by name."""
    out = {}
    for k, v in raw.items():
        if (not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or isinstance(v[1], bool)
                or not isinstance(v[1], int) or v[1] < 0):
            raise InvalidRecordError(f"the base of checkpoint {cid} lists known file {str(k)[:80]!r} as "
                                     f"{str(v)[:80]}, not [path, offset]")
        out[str(k)] = (v[0], v[1])
    return out


@op("state.base", reply=BaseReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class BaseRequest(Message):
    """The base a subtask of checkpoint N restores, and its attempt (begins N if it is not pending).

    A second action on a lazy output after commit re-runs N from the same base; an aborted N is
    refused (only ``state.begin`` restarts it). ``agent``, the executor agent opening ``subtask``, is then
    expected to ack it. ``have``: the attempt whose base the agent holds (the reply leaves it out then).
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    subtask: int | None = integer(default=None, lo=0, hi=MAX_PARALLELISM)
    agent: str = text(default="", max_len=200)
    parallelism: int | None = integer(default=None, lo=1, hi=MAX_PARALLELISM)   # the task's routing
    have: str = text(default="", max_len=64)


@dataclass(frozen=True, slots=True)
class CutReply(Message):
    """The cut that stands for every attempt of the checkpoint (a key group, after ``rows`` of its rows)."""

    cut: int = integer(lo=0, hi=MAX_PARALLELISM)
    rows: int = integer(default=0, lo=0)


@op("state.cut", reply=CutReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class CutRequest(Message):
    """FLIP-76: a subtask proposes where its attempt stops processing new input, and gets the cut that stands.

    ``cut``: a key group; ``rows``: how many of its rows come before the cut (decision 0028: a function
    that takes a key's rows in chunks). ``overflow``: its channel state at that cut passes the byte cap, so
    it processes everything.
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    subtask: int = integer(lo=0, hi=MAX_PARALLELISM)
    cut: int = integer(lo=0, hi=MAX_PARALLELISM)
    overflow: bool = _zero_or_one()
    rows: int = integer(default=0, lo=0)


@dataclass(frozen=True, slots=True)
class AckReply(Message):
    """``acked``, or ``replaced``: another copy of the subtask acked before."""

    result: str = text(max_len=32)


def _handle(f: Fields, n: str) -> SubtaskHandle:
    return SubtaskHandle.from_json(f.mapping(n))


@op("state.ack", reply=AckReply)
@dataclass(frozen=True, slots=True)
class AckRequest(Message):
    """A subtask's snapshot is uploaded (after the async phase): its handle, the files it wrote, and its stats.

    An ack of another attempt than the current one is refused.
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    handle: SubtaskHandle = custom(_handle, lambda h: h.to_json())
    attempt: str = text(max_len=64)
    uploaded: list[str] = sequence(default=[], of=str, max_items=_MANY)   # paths written whole
    merged: list[str] = sequence(default=[], of=str, max_items=_MANY)     # merged files its segments went to
    agent: str = text(default="", max_len=200)
    stats: SubtaskStats | None = nested(SubtaskStats, default=None)


@dataclass(frozen=True, slots=True)
class FailReply(Message):
    """Whether the report was ignored: its attempt is over, or another copy of the subtask acked."""

    ignored: bool = flag()


@op("state.fail", reply=FailReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class FailRequest(Message):
    """An upload or a seal failed, so commit aborts the checkpoint (unless the report is ignored).

    It is ignored when its attempt is over or another copy of the subtask acked; ``others``: the copies
    of the subtask still at work on the reporting agent.
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    attempt: str = text(max_len=64)
    message: str = text(default="")
    subtask: int | None = integer(default=None, lo=0, omit_none=True)
    agent: str = text(default="", max_len=200)
    others: int = integer(default=0, lo=0, hi=1 << 20)


@dataclass(frozen=True, slots=True)
class CheckpointRef(Message):
    """A checkpoint of a state: a pool of merged files, or one that is no longer pending."""

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)


@dataclass(frozen=True, slots=True)
class WorkingSubtask(Message):
    """A subtask open (its task runs) or uploading (its ack is still to come) on an executor agent."""

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    subtask: int = integer(lo=0, hi=MAX_PARALLELISM)


@dataclass(frozen=True, slots=True)
class ClosedFile(Message):
    """A merged physical file an executor agent closed (it appends no more to it)."""

    name: str = _name()
    path: str = text(max_len=300)


@dataclass(frozen=True, slots=True)
class SealAction(Message):
    """What an agent does with its pool of merged files of a checkpoint; a seal carries the attempt it is for."""

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    action: str = text(choices=("seal", "wait", "discard"))
    attempt: str | None = text(default=None, max_len=64, omit_none=True)


@dataclass(frozen=True, slots=True)
class MergePollReply(Message):
    """The action on each pool asked about, and the working checkpoints that are no longer pending (the
    agent releases what it still holds open of those: a task killed before its upload)."""

    actions: list[SealAction] = message_list(SealAction)
    stale: list[CheckpointRef] = message_list(CheckpointRef)


@op("state.merge_poll", reply=MergePollReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class MergePollRequest(Message):
    """FLIP-306: an executor agent holding unsealed merged files long-polls until it may seal or must discard them.

    Once every subtask of a checkpoint acked, its pools are sealed. The polls are the agent's heartbeat,
    sent too while it has subtasks open or uploading (``working``): when an agent holding merged files
    a pending checkpoint needs, or the agent that opened a subtask not acked yet, goes silent for
    agent_timeout, commit aborts the checkpoint, since that upload will never come.
    """

    agent: str = text(max_len=200)
    wait: float = number(default=1.0, lo=0, hi=5.0)
    pools: list[CheckpointRef] = message_list(CheckpointRef)
    closed: list[ClosedFile] = message_list(ClosedFile)
    working: list[WorkingSubtask] = message_list(WorkingSubtask)


@dataclass(frozen=True, slots=True)
class SealedFile(Message):
    """A merged physical file now durable, and its size."""

    path: str = text(max_len=300)
    size: int = integer(lo=0)


@dataclass(frozen=True, slots=True)
class SealedReply(Message):
    """Nothing: the seal is recorded."""


@op("state.sealed", reply=SealedReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class SealedRequest(Message):
    """FLIP-306: an executor agent's merged files of a checkpoint are now durable, with their sizes.

    A seal of a replaced attempt records nothing.
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)
    agent: str = text(max_len=200)
    attempt: str = text(max_len=64)
    files: list[SealedFile] = message_list(SealedFile, required=True)


# --- a Python worker's ops on its executor agent ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReplayFile(Message):
    """A channel-state file of the base that the subtask replays first (FLIP-76), linked for the task."""

    name: str = text()
    path: str = text(max_len=4096)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenReply(Message):
    """An open subtask: its token, its working and snapshot dirs, how it runs and what it replays."""

    token: str = text(max_len=64)
    workdir: str = text(max_len=4096)
    snapshot: str = text(max_len=4096)
    parallelism: int = integer(lo=1, hi=MAX_PARALLELISM)
    max_parallelism: int = integer(lo=1, hi=MAX_PARALLELISM)
    key_type: str = text(max_len=16)
    rerun: bool = flag(default=False)
    restore: dict[str, Any] | None = mapping(default=None)   # what the restore read, None without a base
    alignment: dict[str, Any] = mapping(default={})
    deadline_in: float | None = number(default=None, lo=0)
    channel: str = text(max_len=4096)                        # where the task writes its deferred input
    replay: list[ReplayFile] = message_list(ReplayFile, max_items=_MANY)
    cut: int | None = integer(default=None, lo=0)
    cut_rows: int = integer(default=0, lo=0)
    attempt: str = text(default="", max_len=64)
    replay_filter: bool = flag(default=False)                # the base has another parallelism: filter by key group
    flush_wal_above: int | None = integer(default=None, lo=0)   # the task flushes a larger WAL (decision 0022)
    #: decision 0026: the token of a DB the worker holds open that is exactly the base; the task goes on
    #: with it (its dir is ``workdir``) instead of opening the restored one
    kept: str = text(default="", max_len=64)
    #: tokens of held DBs that can never be a base again (or that this agent does not know): the
    #: worker closes them now
    stale: list[str] = sequence(default=[], of=str, max_items=_HELD_MAX)


@op("state.open", reply=OpenReply, served_by="executor")
@dataclass(frozen=True, slots=True)
class OpenRequest(Message):
    """A task opens its subtask of checkpoint N: the executor agent restores the base of N into a fresh working dir.

    It asks the driver agent for the base (``state.base``), restores the subtask from its local file
    cache, rescaling it when the base has another parallelism, and closes the DB. ``parallelism``: the
    task's routing (refused when the state was rescaled since); ``now_ms``: the batch's processing
    time (a rescale drops what expired).
    """

    name: str = _name()
    checkpoint_id: int = integer(lo=0)
    subtask: int = integer(lo=0)
    parallelism: int | None = integer(default=None, lo=1)
    now_ms: int | None = integer(default=None, lo=0, hi=1 << 62)
    #: decision 0026: the tokens of the DBs of this state the worker holds open after their uploads
    #: (any subtask), and of those it closed on its own since its last open
    held: list[str] = sequence(default=[], of=str, max_items=_HELD_MAX)
    dropped: list[str] = sequence(default=[], of=str, max_items=_HELD_MAX)
    pid: int | None = integer(default=None, lo=1)   # the worker's process: its held DBs go when it does


@op("state.task_cut", reply=CutReply, served_by="executor")
@dataclass(frozen=True, slots=True)
class TaskCutRequest(Message):
    """FLIP-76: the task of an open subtask proposes its cut; the executor agent asks the driver agent (``state.cut``).

    The reply is the cut that stands for every attempt of the checkpoint.
    """

    token: str = text(max_len=64)
    cut: int = integer(lo=0, hi=MAX_PARALLELISM)
    overflow: bool = _zero_or_one()
    rows: int = integer(default=0, lo=0)


@dataclass(frozen=True, slots=True)
class UploadReply(Message):
    """Nothing: the snapshot is queued for its upload."""


@op("state.upload", reply=UploadReply, served_by="executor")
@dataclass(frozen=True, slots=True)
class UploadRequest(Message):
    """A task hands its sync-phase snapshot and its counters to the executor agent, which uploads it and acks it.

    The working dir is deleted at once; when the upload is done the agent acks the driver agent
    (``state.ack``) with the handle and the stats, or reports the failure (``state.fail``).
    """

    token: str = text(max_len=64)
    sync_ms: float = number(default=0.0, lo=0)
    flush_ms: float = number(default=0.0, lo=0)
    counters: TaskCounters = nested(TaskCounters, default=TaskCounters())
    keep: bool = flag(default=False)   # the task keeps its DB open: its working dir is lent, not deleted (0026)


@dataclass(frozen=True, slots=True)
class ReleaseReply(Message):
    """Whether the subtask was still open (a late release is a no-op)."""

    released: bool = flag()


@op("state.release", reply=ReleaseReply, served_by="executor")
@dataclass(frozen=True, slots=True)
class ReleaseRequest(Message):
    """A task that ends before its upload releases its subtask: its working dir and snapshot are deleted."""

    token: str = text(max_len=64)
