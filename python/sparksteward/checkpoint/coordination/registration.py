"""Opening a keyed state on the driver agent: what a ``state.register`` / ``state.check`` request
(:mod:`~sparksteward.checkpoint.lifecycle_messages`) asks for, resolved against the application's
settings (:class:`Registration`), what ``restore_from``
does for a state without checkpoints of its own, and what a state open in this application keeps
(:class:`RegisteredState`). The :class:`~sparksteward.checkpoint.coordination.driver_service.StateService` serves the ops.

**restore_from.** When the state has no checkpoint of its own, ``restore_from`` is restored first
(NO_CLAIM duplication or CLAIM, see :mod:`~sparksteward.checkpoint.restore`); when it has, it is
ignored with a logged note: the state's latest checkpoint wins, as in Flink. A restored starting
point that already came from the same source in the same mode is kept as it is.

**Checks without writing.** :func:`check_unregistered` refuses a changed max parallelism of the
state's own checkpoints, bad alignment or merging settings, and a ``restore_from`` that is not a
usable checkpoint, before the first apply and without writing anything.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.coordination.stats import SubtaskStats, summarize
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.lease import StateLease, refuse_if_held
from sparksteward.checkpoint.lifecycle_messages import CheckReply, CheckRequest, RegisterRequest
from sparksteward.checkpoint.records import CheckpointMetadata, check_max_parallelism
from sparksteward.checkpoint.restore import ClaimMode, check_sources, restore_from
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage, open_checkpoint
from sparksteward.checkpoint.unaligned.backlog import DrainLog
from sparksteward.checkpoint.unaligned.channel_state import AlignmentOptions
from sparksteward.errors import (
    InvalidRequestError,
    ParallelismError,
    StateEncodingError,
    StateNotRegisteredError,
    StewardError,
    StorageError,
)

__all__ = ["CompletedStats", "RegisteredState", "Registration", "StateTable", "check_unregistered", "restore_on_register",
           "unusable_dir"]

log = logging.getLogger("sparksteward.checkpoint.coordination.registration")


@dataclass(frozen=True, slots=True)
class Registration:
    """What a ``state.register`` (or ``state.check``) request asks for, resolved against the
    application's defaults."""

    name: str
    checkpoint_dir: str
    max_parallelism: int
    parallelism: int = 0              # 0 in a check
    key_type: str = ""                # "" in a check
    num_retained: int = 1
    source: str | None = None         # restore_from
    claim_mode: ClaimMode = ClaimMode.NO_CLAIM
    alignment: dict[str, Any] | None = None      # overrides of the application's alignment options
    file_merging: dict[str, Any] | None = None   # overrides of the application's merging options
    states: tuple[dict[str, Any], ...] | None = None   # the declared state variables (None: keep the recorded)
    delete_states: tuple[str, ...] = ()
    key: str = ""                     # the key column ("" from an older client: not checked)
    event_time: dict[str, Any] | None = None   # the event-time column and delay (decision 0028)
    writer: bool = False              # a check by st.keyed_state(...): refuse at once while another writer holds it
    claimed_roots: tuple[str, ...] = ()   # where restore_from's claimed files may lie (the caller trusts them)
    op: str = "state.register"

    @classmethod
    def from_request(cls, req: RegisterRequest | CheckRequest, default_checkpoint_dir: str) -> Registration:
        """The settings of a ``state.register`` or ``state.check`` request (a check names no
        parallelism, key type or number of checkpoints to retain)."""
        register = req if isinstance(req, RegisterRequest) else None
        return cls(name=req.name, checkpoint_dir=req.checkpoint_dir or default_checkpoint_dir,
                   max_parallelism=req.max_parallelism,
                   parallelism=register.parallelism if register is not None else 0,
                   key_type=register.key_type if register is not None else "",
                   num_retained=register.num_retained if register is not None else 1,
                   source=req.restore_from or None,
                   claim_mode=ClaimMode.parse(req.claim_mode or ClaimMode.NO_CLAIM.value),
                   alignment=req.alignment, file_merging=req.file_merging,
                   states=None if req.states is None else tuple(req.states),
                   delete_states=tuple(req.delete_states or ()), key=req.key,
                   event_time=register.event_time if register is not None else None,
                   writer=isinstance(req, CheckRequest) and req.writer,
                   claimed_roots=tuple(req.claimed_roots or ()), op=req.OP)

    def check_key(self, meta: CheckpointMetadata | None, key_type: str | None = None) -> None:
        """Refuse a key column (or, with ``key_type``, a key type) other than the one checkpoint
        ``meta`` recorded, naming both and the fix: the same keys under another column (an apply
        keyed by page on a state of users) would mix two kinds of keys in one state."""
        if meta is None:
            return
        recorded = meta.properties.get("key")
        where = f"checkpoint {meta.checkpoint_id} of keyed state {self.name!r}"
        if isinstance(recorded, str) and self.key and recorded != self.key:
            raise StateEncodingError(
                f"{where} is keyed by column {recorded!r}, but it was opened with key={self.key!r}: one state "
                f"holds one kind of key. Open it with key={recorded!r} (rename or derive that column in your "
                f"DataFrame), or use another state name for state keyed by {self.key!r}")
        if key_type and key_type != meta.key_type.value:
            raise StateEncodingError(
                f"{where} has {meta.key_type.value} keys, but column {self.key or recorded!r} is {key_type}: "
                f"cast the column to {meta.key_type.value}, or use another state name")

    def states_of(self, recorded: dict[str, Any] | None, *, checkpointed: bool) -> dict[str, Any] | None:
        """The state's declarations (``properties.states``) over those its latest checkpoint
        ``recorded``, with the drops still pending (``dropped``: a second open with the same
        ``delete_states``, or one without, keeps them); ``checkpointed``: the state has a completed (or
        restored) checkpoint, so an undeclared default value state may hold JSON values; raises
        :class:`~sparksteward.errors.StateSchemaError` naming what cannot be opened."""
        if self.states is None and not self.delete_states and not recorded:
            return recorded
        from sparksteward.state.declared import resolve  # pyarrow: not when the driver agent starts

        return resolve(recorded, self.states or (), self.delete_states, state=self.name, checkpointed=checkpointed)

    def alignment_of(self, defaults: AlignmentOptions) -> AlignmentOptions:
        """The state's alignment options (FLIP-76): the application's, with the request's overrides."""
        try:
            return AlignmentOptions.from_json({**defaults.to_json(), **(self.alignment or {})})
        except StewardError as exc:
            raise InvalidRequestError(f"{self.op}: {exc}") from None

    def merging_of(self, defaults: MergingOptions, storage: CheckpointStorage) -> MergingOptions:
        """The state's file-merging options: the application's, with the request's overrides."""
        try:
            opts = MergingOptions.from_json({**defaults.to_json(), **(self.file_merging or {})})
        except StewardError as exc:
            raise InvalidRequestError(f"{self.op}: {exc}") from None
        opts.check_store(storage.url, storage.location.is_local)
        return opts


@dataclass(frozen=True, slots=True)
class CompletedStats:
    """What the acks of a checkpoint completed in this application reported."""

    per_subtask: dict[int, SubtaskStats]
    merged_files_written: int = 0   # FLIP-306: the physical files its executor agents sealed

    def summary(self, checkpoint_id: int) -> dict[str, Any]:
        return summarize(checkpoint_id, self.per_subtask, self.merged_files_written)


@dataclass
class RegisteredState:
    """A keyed state open in this application: its coordinator and what the service keeps beside it."""

    coordinator: CheckpointCoordinator
    checkpoint_dir: str
    completed: dict[int, CompletedStats] = field(default_factory=dict)   # stats of checkpoints completed here
    restore: dict[str, Any] | None = None  # what register did with restore_from
    alignment: AlignmentOptions = AlignmentOptions()
    lease: StateLease | None = None   # this application's writer lease on the state root
    lock: threading.RLock = field(default_factory=threading.RLock)   # the service's data here (completed,
                                       # overrides, drains, alignment), outside the coordinator's own lock
    overrides: dict[int, AlignmentOptions] = field(default_factory=dict)  # checkpoint -> its own alignment
    drains: DrainLog = DrainLog()     # the ids drains took (read at registration)
    warned: int | None = None         # the checkpoint whose growing backlog was last warned about

    def rescaled_from(self, parallelism: int) -> int | None:
        """The parallelism of the latest checkpoint, when the next one rescales from it."""
        latest = max(self.coordinator.retained(), default=None)
        checkpointed = None if latest is None else self.coordinator.completed(latest).parallelism
        return checkpointed if checkpointed not in (None, parallelism) else None

    def check_max_parallelism(self, name: str, max_parallelism: int) -> None:
        c = self.coordinator
        if max_parallelism != c.max_parallelism:
            raise ParallelismError(
                f"keyed state {name!r} has max_parallelism={c.max_parallelism} and cannot be opened with "
                f"max_parallelism={max_parallelism}: the max parallelism fixes the key groups and cannot change. "
                f"Keep max_parallelism={c.max_parallelism} (any parallelism up to it works), or use another "
                f"state name")


def restore_on_register(storage: CheckpointStorage, reg: Registration) -> dict[str, Any]:
    """``restore_from`` for a state being registered (see the module docstring); what it did."""
    assert reg.source is not None  # the caller's guard
    source, mode = reg.source, reg.claim_mode
    own = storage.checkpoint_ids()
    if own:
        note = (f"restore_from={source!r} is ignored: state {storage.state!r} already has checkpoint "
                f"{own[-1]} of its own, and a state continues from its latest checkpoint. Use a new state "
                f"name to start from {source!r}")
        log.warning("%s", note)
        return {"action": "ignored", "source": source, "note": note, "last_completed": own[-1]}
    if storage.has_restored():
        try:
            props = storage.read_metadata(RESTORED).properties
        except StewardError:
            props = {}
        if props.get("restored_from") == source and props.get("claim_mode") == mode.value:
            log.info("state %s continues from its restored starting point %s", storage.state, source)
            return {"action": "kept", "source": source, "claim_mode": mode.value}
    dup = Duplicator()
    started = time.monotonic()
    meta = restore_from(source, storage, max_parallelism=reg.max_parallelism, claim_mode=mode,
                        key_type=reg.key_type, duplicator=dup, claimed_roots=reg.claimed_roots)
    stats = dup.stats
    out = {"action": "restored", "source": source, "claim_mode": mode.value,
           "checkpoint_id": meta.checkpoint_id, "source_state": meta.properties.get("source_state"),
           "files": len({f.path for f in meta.files()}), "bytes": meta.size,
           "copied_server_side": stats.server_side, "linked": stats.linked,
           "kernel_copied": stats.kernel_copied, "streamed": stats.streamed,
           "bytes_streamed": stats.bytes_streamed, "seconds": round(time.monotonic() - started, 3)}
    log.info("state %s restored from %s (%s): %s", storage.state, source, mode.value, out)
    return out


def check_unregistered(reg: Registration, storage: CheckpointStorage, merging: MergingOptions,
                       alignment: AlignmentOptions, cluster_id: str) -> CheckReply:
    """``state.check`` of a state not open in this application (see the module docstring)."""
    reg.merging_of(merging, storage)
    reg.alignment_of(alignment)
    try:
        own = storage.checkpoint_ids()
    except StorageError as exc:
        raise unusable_dir(reg, exc) from exc
    if reg.writer:   # st.keyed_state(...): a live writer elsewhere is named now, not at the first batch
        refuse_if_held(storage.location, reg.name)
    if own:
        latest = storage.read_metadata(own[-1])
        check_max_parallelism(latest, reg.max_parallelism)
        reg.check_key(latest)
        return CheckReply(registered=False, last_completed=own[-1], restore_from="ignored" if reg.source else None,
                          key_type=latest.key_type.value, latest=latest.to_json(),
                          states=reg.states_of(latest.properties.get("states"), checkpointed=True),
                          checkpoint_dir=reg.checkpoint_dir, cluster_id=cluster_id)
    if reg.source:
        src, meta = open_checkpoint(reg.source)
        check_max_parallelism(meta, reg.max_parallelism)
        reg.check_key(meta)
        check_sources(src, meta, reg.source, claimed_roots=reg.claimed_roots)
        return CheckReply(registered=False, last_completed=None, restore_from=reg.claim_mode.value,
                          checkpoint_id=meta.checkpoint_id, key_type=meta.key_type.value,
                          states=reg.states_of(meta.properties.get("states"), checkpointed=True),
                          checkpoint_dir=reg.checkpoint_dir, cluster_id=cluster_id)
    return CheckReply(registered=False, last_completed=None, restore_from=None,
                      states=reg.states_of(None, checkpointed=False),
                      checkpoint_dir=reg.checkpoint_dir, cluster_id=cluster_id)


def unusable_dir(reg: Registration, exc: StorageError) -> StorageError:
    """The error of a checkpoint dir that cannot be listed or written (a path under a regular file, no
    permission, a bucket that does not exist), naming the state, the dir and the fix; raised by
    ``state.check`` (at ``keyed_state()``) or by the lease at the first apply, before any task runs."""
    return StorageError(f"keyed state {reg.name!r} cannot use its checkpoint dir {reg.checkpoint_dir}: {exc}; pass "
                        "a checkpoint_dir (or spark.steward.checkpoint.dir) this application can create and write")


class StateTable:
    """The keyed states open in this application, shared by the ops the driver calls
    (:class:`~sparksteward.checkpoint.coordination.driver_service.StateService`) and those executor agents call
    (:class:`~sparksteward.checkpoint.coordination.gateway.CheckpointGateway`), with the change notifications their
    waiters (a commit, a merge poll) wait on and the time each executor agent was last heard from.

    Thread-safe. Its condition guards only the map and the generation and is never held over I/O:
    each state's own lock guards that state.
    """

    def __init__(self) -> None:
        self._states: dict[str, RegisteredState] = {}
        self._cond = threading.Condition()
        self._generation = 0                  # bumped by every change a waiter may be waiting for
        self._seen_lock = threading.Lock()
        self._seen: dict[str, float] = {}     # agent -> monotonic time its last request arrived

    def get(self, name: str) -> RegisteredState | None:
        with self._cond:
            return self._states.get(name)

    def add(self, name: str, st: RegisteredState) -> None:
        with self._cond:
            self._states[name] = st

    def all(self) -> dict[str, RegisteredState]:
        with self._cond:
            return dict(self._states)

    def lookup(self, name: str) -> tuple[str, RegisteredState]:
        """The state a request names, or a clear error when it is not open here."""
        st = self.get(name)
        if st is None:
            raise StateNotRegisteredError(f"keyed state {name!r} is not registered with the driver agent: create it "
                                          f"with st.keyed_state({name!r}, key=...) first")
        return name, st

    # --- change notifications ----------------------------------------------------------------------
    def notify(self) -> None:
        """Wake the waiters (commit, merge polls): something changed."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` for a change after generation ``seen``; return the generation now."""
        with self._cond:
            if self._generation == seen and timeout > 0:
                self._cond.wait(timeout)
            return self._generation

    def generation(self) -> int:
        with self._cond:
            return self._generation

    # --- executor agents' liveness -----------------------------------------------------------------
    def heard(self, agent: str) -> None:
        """An executor agent's request arrived: liveness is judged on arrival, never behind a lock."""
        if agent:
            with self._seen_lock:
                self._seen[agent] = time.monotonic()

    def silent(self, agents: set[str], timeout: float) -> list[str]:
        """Those of ``agents`` not heard from for ``timeout`` seconds (never heard: not silent)."""
        now = time.monotonic()
        with self._seen_lock:
            seen = dict(self._seen)
        return sorted(a for a in agents if now - seen.get(a, now) > timeout)
