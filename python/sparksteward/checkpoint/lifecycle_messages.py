"""Typed messages of a keyed state's life on the driver agent: the ``state.*`` ops the user's driver
sends (:class:`~sparksteward.keyed_state.KeyedState`, and ``Steward.keyed_state``'s check) and the
:class:`~sparksteward.checkpoint.coordination.driver_service.StateService` serves.

One batch walks them in order: ``state.check`` (at ``st.keyed_state(...)``, writing nothing),
``state.register`` (at the first apply), ``state.begin`` (checkpoint N), then ``state.commit`` (or
``state.abort``) of N; ``state.info`` and ``state.savepoint`` at any time. What the executor agents
send about the same checkpoint (``state.base``, ``state.ack``, ...) is in
:mod:`sparksteward.checkpoint.messages`.

Replies that carry records or reports as they are stored (a checkpoint's ``_metadata``, its stats and
report, what ``restore_from`` did, the state's declarations) keep them as JSON objects
(:func:`~sparksteward.wire.messages.mapping`); their form is documented where they are made. A reply's
lists are not bounded below what the driver agent sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparksteward.errors import InvalidRequestError
from sparksteward.ids import validate_id
from sparksteward.wire import Fields
from sparksteward.wire.messages import (
    MAX_CHECKPOINT_ID,
    MAX_PARALLELISM,
    Message,
    custom,
    flag,
    integer,
    mapping,
    number,
    op,
    sequence,
    text,
)

__all__ = ["MAX_COMMIT_WAIT", "AbortReply", "AbortRequest", "BatchTime", "BeginReply", "BeginRequest", "CheckReply",
           "CheckRequest", "CommitReply", "CommitRequest", "InfoReply", "InfoRequest",
           "RegisterReply", "RegisterRequest", "SavepointReply", "SavepointRequest"]

#: The longest a ``state.commit`` may wait for its acks (seconds).
MAX_COMMIT_WAIT = 7 * 86400.0
_MANY = 1 << 20   # the bound of a reply's lists: the driver agent's own answer is not refused


# --- fields of the open requests (register, check) -------------------------------------------------
def _state_name(f: Fields, name: str) -> str:
    value = f.text(name, max_len=200)
    try:
        validate_id(value, "state name")
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    return value


def _claim_mode(f: Fields, name: str) -> str | None:
    value = f.text(name, default=None, max_len=32)
    if value:
        from sparksteward.checkpoint.restore import ClaimMode

        ClaimMode.parse(value)   # names the modes
    return value


def _declarations(f: Fields, name: str) -> list[dict[str, Any]] | None:
    states = f.sequence(name, default=None, max_items=256)
    if states is not None and not all(isinstance(s, dict) for s in states):
        raise InvalidRequestError(f"{f.op}: field 'states' must be an array of state declarations (objects)")
    return states


def _claimed_roots(f: Fields, name: str) -> list[str] | None:
    roots = f.sequence(name, default=None, max_items=64)
    if not all(isinstance(r, str) and 0 < len(r) <= 4096 for r in roots or ()):
        raise InvalidRequestError(f"{f.op}: field 'claimed_roots' must be an array of URLs or paths")
    return roots


def _event_time(f: Fields, name: str) -> dict[str, Any] | None:
    """``{"column": ..., "delay_ms": ...}``: the state's event-time column and watermark delay."""
    raw = f.mapping(name, default=None)
    if raw is not None:
        column, delay = raw.get("column"), raw.get("delay_ms")
        if set(raw) != {"column", "delay_ms"} or not isinstance(column, str) or not 0 < len(column) <= 1000 \
                or isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 100 * 365 * 86_400_000:
            raise InvalidRequestError(f"{f.op}: field 'event_time' must be {{'column': <column name>, 'delay_ms': "
                                      f"<0 to 100 years in ms>}}, not {raw!r}")
    return raw


def _dropped(f: Fields, name: str) -> list[str] | None:
    dropped = f.sequence(name, default=None, max_items=256)
    if not all(isinstance(n, str) and 0 < len(n) <= 100 for n in dropped or ()):
        raise InvalidRequestError(f"{f.op}: field 'delete_states' must be an array of state variable names")
    return dropped


# --- state.register -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterReply(Message):
    """The state as registered: ``restore`` is what ``restore_from`` did (action ``restored``, ``kept``
    or ``ignored``, see checkpoint/coordination/registration.py); ``rescaled_from`` the latest
    checkpoint's parallelism when the next one rescales from it; ``states`` the resolved declarations."""

    last_completed: int | None = integer(default=None)
    url: str = text()
    restore: dict[str, Any] | None = mapping(default=None)
    rescaled_from: int | None = integer(default=None)
    states: dict[str, Any] | None = mapping(default=None)


@op("state.register", reply=RegisterReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest(Message):
    """Open keyed state ``name`` in this application (the first apply): its coordinator, created once per
    name, restoring ``restore_from`` when the state has no checkpoint of its own.

    A second register must agree, except that another parallelism rescales from the next checkpoint on;
    another max parallelism is refused."""

    name: str = custom(_state_name)
    checkpoint_dir: str | None = text(default=None)   # None: the application's
    parallelism: int = integer(lo=1, hi=MAX_PARALLELISM)
    max_parallelism: int = integer(lo=1, hi=MAX_PARALLELISM)
    key_type: str = text(max_len=16)
    num_retained: int = integer(default=1, lo=1, hi=10_000)
    restore_from: str | None = text(default=None, max_len=4096)
    claim_mode: str | None = custom(_claim_mode, default=None)
    states: list[dict[str, Any]] | None = custom(_declarations, default=None)
    claimed_roots: list[str] | None = custom(_claimed_roots, default=None)
    delete_states: list[str] | None = custom(_dropped, default=None)
    alignment: dict[str, Any] | None = mapping(default=None)      # overrides of the application's (FLIP-76)
    file_merging: dict[str, Any] | None = mapping(default=None)   # overrides of the application's (FLIP-306)
    key: str = text(default="", max_len=1000)                     # the key column ("": not checked)
    event_time: dict[str, Any] | None = custom(_event_time, default=None)   # decision 0028 (None: no watermark)


# --- state.check ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReply(Message):
    """What opening the state will find: ``registered`` (open in this application), its last completed
    checkpoint and key type, the latest completed ``_metadata`` (``latest``), what ``restore_from``
    will do (not registered: ``ignored``, the claim mode, or None) and the declarations the next batch
    uses; ``checkpoint_id``: the checkpoint ``restore_from`` names."""

    registered: bool = flag()
    last_completed: int | None = integer(default=None)
    key_type: str | None = text(default=None, max_len=16)
    latest: dict[str, Any] | None = mapping(default=None)
    restore_from: str | None = text(default=None)
    checkpoint_id: int | None = integer(default=None)
    states: dict[str, Any] | None = mapping(default=None)
    checkpoint_dir: str = text()
    cluster_id: str = text()

    def to_wire(self) -> dict[str, Any]:
        """The reply as before typed messages: a registered state's leaves out ``restore_from``; an
        unregistered one's leaves out ``latest`` and ``key_type`` when it has none; ``checkpoint_id``
        is there only with a value."""
        absent = ("restore_from", "checkpoint_id") if self.registered else ("latest", "key_type", "checkpoint_id")
        return {k: v for k, v in Message.to_wire(self).items() if v is not None or k not in absent}


@op("state.check", reply=CheckReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckRequest(Message):
    """Check, before the first apply and without writing anything, that keyed state ``name`` can be
    opened so: refuses a changed max parallelism or key column, bad alignment or merging settings, a
    ``restore_from`` that is not a usable checkpoint, and (``writer``) a live writer elsewhere."""

    name: str = custom(_state_name)
    checkpoint_dir: str | None = text(default=None)   # None: the application's
    max_parallelism: int = integer(lo=1, hi=MAX_PARALLELISM)
    restore_from: str | None = text(default=None, max_len=4096)
    claim_mode: str | None = custom(_claim_mode, default=None)
    states: list[dict[str, Any]] | None = custom(_declarations, default=None)
    claimed_roots: list[str] | None = custom(_claimed_roots, default=None)
    delete_states: list[str] | None = custom(_dropped, default=None)
    alignment: dict[str, Any] | None = mapping(default=None)
    file_merging: dict[str, Any] | None = mapping(default=None)
    key: str = text(default="", max_len=1000)
    writer: bool = flag(default=False)   # st.keyed_state(...): refuse at once while another writer holds it


# --- state.begin ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BatchTime(Message):
    """A checkpoint's processing time (TTL) and event-time watermark (None: none yet), chosen once by
    the coordinator: the same for every task, attempt and delivery of it (checkpoint/begun.py)."""

    processing_ms: int = integer()
    watermark_ms: int | None = integer(default=None, omit_none=True)


def _batch_time(f: Fields, name: str) -> BatchTime | None:
    raw = f.mapping(name, default=None)
    return None if raw is None else BatchTime.from_wire(raw, f"{f.op} {name}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BeginReply(Message):
    """The checkpoint begun (None: a drain with no backlog, and then nothing else), whether it re-runs a
    completed one, its alignment, the attempt's token, its processing time and watermark, the declarations
    its tasks run with, whether it starts from an empty state (``empty``: no base; an initial state
    applies there), and a warning when the unaligned backlog keeps growing."""

    checkpoint_id: int | None = integer(default=None)
    rerun: bool = flag(default=False)
    unaligned: bool = flag(default=False)
    backlog_warning: str | None = text(default=None)
    attempt: str = text(default="", max_len=64)
    time: BatchTime | None = custom(_batch_time, lambda t: t.to_wire(), default=None)
    states: dict[str, Any] | None = mapping(default=None)
    empty: bool = flag(default=False)

    def to_wire(self) -> dict[str, Any]:
        """A drain with nothing to drain answers the id (null), ``rerun`` and ``unaligned`` only."""
        out = Message.to_wire(self)
        if self.checkpoint_id is None:
            return {k: out[k] for k in ("checkpoint_id", "rerun", "unaligned")}
        return out


@op("state.begin", reply=BeginReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class BeginRequest(Message):
    """Begin checkpoint ``checkpoint_id`` of keyed state ``name`` (None: the next after the last completed
    one) before its batch runs.

    A streaming batch names its ``batch_id`` instead (its id skips those drains took); ``drain`` begins
    an empty aligned batch under the next id that processes the backlog (refused while a checkpoint is
    pending), with ``timers`` also when there is none (its tasks fire the due timers). ``parallelism``
    (the caller's routing) is refused when the state was rescaled since; ``alignment`` overrides the
    state's for this checkpoint only."""

    name: str = text(max_len=200)
    parallelism: int | None = integer(default=None, lo=1, hi=MAX_PARALLELISM)
    query: str | None = text(default=None, max_len=200)   # the streaming query that runs the batch
    batch_id: int | None = integer(default=None, lo=0, hi=MAX_CHECKPOINT_ID)
    drain: bool = flag(default=False)
    timers: bool = flag(default=False)   # a drain that fires due timers: it begins without a backlog too
    alignment: dict[str, Any] | None = mapping(default=None, omit_none=True)
    checkpoint_id: int | None = integer(default=None, lo=0, hi=MAX_CHECKPOINT_ID)


# --- state.commit ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class CommitReply(Message):
    """The completed checkpoint: its ``_metadata`` and path, the retained ones, its stats
    (checkpoint/coordination/stats.py) and its report (checkpoint/coordination/report.py; None for a
    re-run)."""

    checkpoint_id: int = integer()
    metadata: dict[str, Any] = mapping()
    retained: list[int] = sequence(max_items=_MANY, of=int)
    path: str = text()
    stats: dict[str, Any] = mapping()
    report: dict[str, Any] | None = mapping(default=None)


@op("state.commit", reply=CommitReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRequest(Message):
    """Wait for every subtask's ack of checkpoint ``checkpoint_id`` (None: the newest pending one) and
    complete it (``_metadata``), subsuming older ones.

    A failed upload, a silent executor agent it waits for, or a ``wait`` (seconds; None: the
    application's commit timeout) that runs out aborts the checkpoint and raises."""

    name: str = text(max_len=200)
    wait: float | None = number(default=None, lo=0, hi=MAX_COMMIT_WAIT)
    checkpoint_id: int | None = integer(default=None, lo=0, hi=MAX_CHECKPOINT_ID)


# --- state.abort ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AbortReply(Message):
    """How many files only the aborted checkpoint uploaded were deleted."""

    deleted: int = integer()


@op("state.abort", reply=AbortReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequest(Message):
    """Drop pending checkpoint ``checkpoint_id`` of keyed state ``name`` and delete the files only it
    uploaded."""

    name: str = text(max_len=200)
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)


# --- state.opened ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpenedReply(Message):
    """The subtasks of a pending checkpoint that no task of its attempt opened (empty when it is not
    pending)."""

    unopened: list[int] = sequence(max_items=_MANY, of=int)


@op("state.opened", reply=OpenedReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedRequest(Message):
    """Which subtasks of pending checkpoint ``checkpoint_id`` of keyed state ``name`` ran: ``process()``
    asks after a sink that took no action on every subtask's output (``take``, ``isEmpty``)."""

    name: str = text(max_len=200)
    checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)


# --- state.info -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class InfoReply(Message):
    """A keyed state open in this application, as ``KeyedState.info()`` returns it (see its docstring):
    checkpoints last completed, retained and pending, the latest completed ``_metadata``, the backlog
    and drains, the restore, settings, file-merging space, the latest report, the writer lease, and
    per checkpoint acked in this application its stats."""

    last_completed: int | None = integer(default=None)
    retained: list[int] = sequence(max_items=_MANY, of=int)
    pending: list[int] = sequence(max_items=_MANY, of=int)
    restored: bool = flag()
    url: str = text()
    latest: dict[str, Any] | None = mapping(default=None)
    backlog: dict[str, Any] | None = mapping(default=None)
    drains: list[int] = sequence(max_items=_MANY, of=int)
    checkpoint_dir: str = text()
    cluster_id: str = text()
    restore: dict[str, Any] | None = mapping(default=None)
    parallelism: int = integer()
    max_parallelism: int = integer()
    file_merging: dict[str, Any] = mapping()
    space: dict[str, Any] = mapping()
    no_reuse: list[str] = sequence(max_items=_MANY, of=str)
    report: dict[str, Any] | None = mapping(default=None)
    lease: dict[str, Any] | None = mapping(default=None)
    checkpoints: list[dict[str, Any]] = sequence(max_items=_MANY, of=dict)


@op("state.info", reply=InfoReply)
@dataclass(frozen=True, slots=True)
class InfoRequest(Message):
    """Describe keyed state ``name``: its checkpoints, backlog, settings, space and lease, and the stats
    of every checkpoint acked in this application."""

    name: str = text(max_len=200)


# --- state.savepoint ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SavepointReply(Message):
    """The savepoint written: its ``_metadata`` path, the checkpoint it copies, its files and bytes, and
    the bytes that were streamed rather than copied on the server."""

    url: str = text()
    metadata: str = text()
    checkpoint_id: int = integer()
    files: int = integer()
    bytes: int = integer()
    bytes_streamed: int = integer()


@op("state.savepoint", reply=SavepointReply)
@dataclass(frozen=True, slots=True, kw_only=True)
class SavepointRequest(Message):
    """Write a self-contained copy of keyed state ``name``'s latest completed checkpoint to ``url``; a
    state not open in this application is read from ``checkpoint_dir``."""

    name: str = text(max_len=200)
    url: str = text(max_len=4096)
    checkpoint_dir: str | None = text(default=None)
