"""The driver agent's side of keyed state: one :class:`CheckpointCoordinator` per state, behind the
``state.*`` socket ops (issue 8).

Ops (every request names its state with ``name``)::

    state.check     checkpoint_dir, max_parallelism, restore_from, claim_mode (before the first apply):
                    refuses a changed max parallelism of the state's own checkpoints, and a
                    restore_from that is not a usable checkpoint, without writing anything
    state.register  checkpoint_dir, parallelism, max_parallelism, key_type, num_retained,
                    restore_from, claim_mode
                    -> the coordinator (created once per name; a second register must agree, except
                    that another parallelism rescales from the next checkpoint on; another
                    max_parallelism is refused; rescaled_from: the latest checkpoint's parallelism
                    when the next checkpoint rescales from it). When the state has no checkpoint
                    of its own, restore_from is restored first (NO_CLAIM
                    duplication or CLAIM, see checkpoint/restore.py); when it has, restore_from is
                    ignored with a logged note: the state's latest checkpoint wins, as in Flink
    state.savepoint url -> a self-contained copy of the latest completed checkpoint at url
    state.begin     checkpoint_id (null: the next after the last completed one), parallelism (of the
                    caller's routing: refused when the state was rescaled since), batch_id (a
                    streaming batch: its checkpoint id skips the ids drains took, see
                    checkpoint/backlog.py), alignment (overrides for this checkpoint only), drain
                    (an empty aligned batch under the next id that processes the backlog; refused
                    while a checkpoint is pending; id null when there is no backlog)
                    -> id, rerun, unaligned, backlog_warning
    state.base      checkpoint_id, subtask, agent -> the base every attempt restores (begins N if it is
                    not pending: a second action on a lazy output after commit re-runs N from the same
                    base; an aborted N is refused, only state.begin restarts it). ``agent`` (the
                    executor agent opening ``subtask``) is then expected to ack it
    state.ack       checkpoint_id, attempt, handle, uploaded, stats (from executor agents, after the async
                    phase); an ack of another attempt than the current one is refused
    state.fail      checkpoint_id, attempt, subtask, message (an upload or a seal failed: commit aborts),
                    ignored when its attempt is over or another copy of the subtask acked
    state.merge_poll agent, pools [{name, checkpoint_id}], closed [{name, path}], working [{name,
                    checkpoint_id, subtask}], wait
                    -> actions [{name, checkpoint_id, action: seal|wait|discard, attempt (seal)}] (FLIP-306: an executor
                    agent holding unsealed merged files long-polls; once every subtask acked, it
                    seals them. The polls are its heartbeat, sent too while it has subtasks open or
                    uploading (``working``): when an agent holding merged files a pending checkpoint
                    needs, or the agent that opened a subtask not acked yet, goes silent for
                    agent_timeout, commit aborts the checkpoint, since that upload will never come)
    state.sealed    name, checkpoint_id, agent, attempt, files [{path, size}] (merged files now durable;
                    a seal of a replaced attempt records nothing)
    state.commit    checkpoint_id, wait -> waits for every ack, completes (``_metadata``), subsumes,
                    returns the checkpoint's stats;
                    on a failure or when the wait runs out the checkpoint is aborted and an error raised
    state.abort     checkpoint_id -> files deleted
    state.info      -> last completed, retained, pending, the latest completed metadata, restore,
                    parallelism, and per checkpoint (acked in this application) the files and bytes
                    uploaded and reused and each subtask's restore (old subtasks and files read,
                    bytes downloaded); backlog (the deferred rows and bytes of the latest completed
                    checkpoint, and for how many checkpoints it grew) and drains (ids drains took)

Thread-safe: requests run on connection threads. Each state has its own lock, and storage I/O (a
restore, a recovery, a commit's ``_metadata`` and deletions) runs only under that state's lock, never
under the service's condition, which guards the map of states and wakes waiters; an agent's
heartbeat is recorded when its request arrives, so no state's I/O can make an agent look silent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparksteward.checkpoint.backlog import GROWTH_WARNING, DrainLog, growth
from sparksteward.checkpoint.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.channel import AlignmentMode, AlignmentOptions
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.lease import StateLease
from sparksteward.checkpoint.merging import MergingOptions
from sparksteward.checkpoint.records import SubtaskHandle
from sparksteward.checkpoint.rescale import check_max_parallelism
from sparksteward.checkpoint.restore import ClaimMode, check_sources, restore_from, write_savepoint
from sparksteward.checkpoint.stats import SubtaskStats, summarize
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage, checkpoint_dir_name, open_checkpoint
from sparksteward.errors import (
    CheckpointError,
    CheckpointOrderError,
    InvalidRequestError,
    ParallelismError,
    StateLeaseError,
    StateNotRegisteredError,
    StewardError,
)
from sparksteward.ids import validate_id
from sparksteward.wire import AgentServer, Connection, Fields

__all__ = ["StateService"]

log = logging.getLogger("sparksteward.checkpoint.service")

_MAX_WAIT = 7 * 86400.0
_MAX_ID = (1 << 62)
_MAX_STATS = 1000  # checkpoints whose per-subtask ack stats state.info keeps


@dataclass(frozen=True, slots=True)
class _Completed:
    """What the acks of a checkpoint completed in this application reported."""

    per_subtask: dict[int, SubtaskStats]
    merged_files_written: int = 0   # FLIP-306: the physical files its executor agents sealed

    def summary(self, checkpoint_id: int) -> dict[str, Any]:
        return summarize(checkpoint_id, self.per_subtask, self.merged_files_written)


@dataclass
class _State:
    coordinator: CheckpointCoordinator
    checkpoint_dir: str
    completed: dict[int, _Completed] = field(default_factory=dict)   # the stats of checkpoints completed here
    restore: dict[str, Any] | None = None  # what register did with restore_from
    alignment: AlignmentOptions = AlignmentOptions()
    lease: StateLease | None = None   # this application's writer lease on the state root
    lock: threading.RLock = field(default_factory=threading.RLock)   # this state's ops; storage I/O only
                                                                      # under it, never under the service's
    overrides: dict[int, AlignmentOptions] = field(default_factory=dict)  # checkpoint -> its own alignment
    drains: DrainLog = DrainLog()     # the ids drains took (read at registration)
    warned: int | None = None         # the checkpoint whose growing backlog was last warned about


class StateService:
    """The coordinators of an application's keyed states (hosted by the driver agent)."""

    def __init__(self, default_checkpoint_dir: str, cluster_id: str, *, commit_timeout: float = 600.0,
                 merging: MergingOptions | None = None, agent_timeout: float = 30.0,
                 alignment: AlignmentOptions | None = None, lease_timeout: float = 60.0,
                 orphan_grace: float = 600.0, application: Callable[[], str | None] = lambda: None) -> None:
        self.default_checkpoint_dir = default_checkpoint_dir
        self.cluster_id = cluster_id
        self.commit_timeout = commit_timeout
        self.merging = merging or MergingOptions()
        self.alignment = alignment or AlignmentOptions()
        self.agent_timeout = agent_timeout
        self._states: dict[str, _State] = {}
        self._cond = threading.Condition()   # the states map and change notifications; never held over I/O
        self._generation = 0                  # bumped by every change a waiter may be waiting for
        self._registering: dict[str, threading.Lock] = {}   # state name -> its first registration
        self._seen_lock = threading.Lock()
        self._seen: dict[str, float] = {}   # agent -> monotonic time its last request arrived
        self.lease_timeout = lease_timeout
        self.orphan_grace = orphan_grace
        self._application = application
        self._closed = threading.Event()
        self._lease_thread: threading.Thread | None = None

    def metrics(self) -> dict[str, int | float]:
        """The file-merging numbers of every registered state, flat, for health and Spark's metrics:
        ``state.<name>.merged.<k>`` for each ``k`` of :meth:`SpaceStats.to_json` (physical and logical
        files and bytes, whole files and bytes, amplification) and ``no_reuse_files``; and
        ``state.<name>.unaligned.<k>`` of its latest checkpoint (FLIP-76): ``rows_processed``,
        ``rows_deferred``, ``channel_bytes``, ``unaligned_subtasks``, ``checkpoint_id``; and its backlog,
        the channel state of the latest completed checkpoint that no batch processed yet:
        ``backlog_bytes``, ``backlog_rows`` (when acked in this application) and ``backlog_growth``
        (consecutive checkpoints it grew for).

        Thread-safe: the states are listed under the service's condition; each state's numbers are read
        under its own lock.
        """
        with self._cond:
            states = sorted(self._states.items())
        out: dict[str, int | float] = {}
        for name, st in states:
            prefix = f"state.{name}.merged."
            for key, value in st.coordinator.space().to_json().items():
                out[prefix + key] = value
            out[prefix + "no_reuse_files"] = len(st.coordinator.no_reuse())
            with st.lock:   # FLIP-76: the latest checkpoint acked in this application
                latest = max(st.completed, default=None)
                summary = st.completed[latest].summary(latest) if latest is not None else None
            if summary is not None and latest is not None:
                unaligned = f"state.{name}.unaligned."
                out[unaligned + "checkpoint_id"] = latest
                for key in ("rows_processed", "rows_deferred", "channel_bytes"):
                    out[unaligned + key] = summary[key]
                out[unaligned + "unaligned_subtasks"] = len(summary["unaligned_subtasks"])
            backlog = self._backlog(st)
            if backlog is not None:
                unaligned = f"state.{name}.unaligned."
                out[unaligned + "backlog_bytes"] = backlog["bytes"]
                out[unaligned + "backlog_growth"] = backlog["growth"]
                if backlog["rows"] is not None:
                    out[unaligned + "backlog_rows"] = backlog["rows"]
        return out

    def _backlog(self, st: _State) -> dict[str, Any] | None:
        """The channel state of the latest completed checkpoint (see checkpoint/backlog.py): its bytes
        (from the record), rows (from the acks, None unless acked in this application), the subtasks
        that hold some, and for how many consecutive checkpoints it grew."""
        c = st.coordinator
        latest = max(c.retained(), default=None)
        if latest is None:
            return None
        per = [sum(f.length for f in s.channel_state) for s in c.completed(latest).subtasks]
        with st.lock:
            rows = {cid: sum(a.rows_deferred for a in done.per_subtask.values()) for cid, done in st.completed.items()}
        return {"checkpoint_id": latest, "bytes": sum(per), "rows": rows.get(latest),
                "subtasks": [i for i, b in enumerate(per) if b], "growth": growth(rows) if latest in rows else 0}

    def register_handlers(self, server: AgentServer) -> None:
        for op, fn in {"state.register": self._op_register, "state.begin": self._op_begin,
                       "state.base": self._op_base, "state.ack": self._op_ack, "state.fail": self._op_fail,
                       "state.commit": self._op_commit, "state.abort": self._op_abort,
                       "state.info": self._op_info, "state.check": self._op_check,
                       "state.savepoint": self._op_savepoint, "state.merge_poll": self._op_merge_poll,
                       "state.sealed": self._op_sealed, "state.cut": self._op_cut}.items():
            server.add_handler(op, fn)

    # --- helpers -----------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake the waiters (commit, merge polls): something changed."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def _wait(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` for a change after generation ``seen``; return the generation now."""
        with self._cond:
            if self._generation == seen and timeout > 0:
                self._cond.wait(timeout)
            return self._generation

    def _generation_now(self) -> int:
        with self._cond:
            return self._generation

    def _heard(self, agent: str) -> None:
        """An executor agent's request arrived: liveness is judged on arrival, never behind a lock."""
        if agent:
            with self._seen_lock:
                self._seen[agent] = time.monotonic()

    def _state(self, f: Fields) -> tuple[str, _State]:
        name = f.text("name", max_len=200)
        with self._cond:
            st = self._states.get(name)
        if st is None:
            raise StateNotRegisteredError(f"keyed state {name!r} is not registered with the driver agent: create it "
                                  f"with st.keyed_state({name!r}, key=...) first")
        return name, st

    @staticmethod
    def _checkpoint_id(f: Fields, st: _State, default: Any = None) -> int:
        cid = f.integer("checkpoint_id", default=default, lo=0, hi=_MAX_ID)
        if cid is None:
            last = st.coordinator.last_completed
            cid = 0 if last is None else last + 1
        return cid

    def _reply_base(self, st: _State, cid: int, begun: Any) -> dict[str, Any]:
        c = st.coordinator
        alignment = st.overrides.get(cid, st.alignment)   # a drain: aligned, whatever the state's alignment
        return {"checkpoint_id": cid, "rerun": begun.rerun, "attempt": begun.attempt,
                "checkpoint_dir": st.checkpoint_dir,
                "cluster_id": self.cluster_id, "parallelism": c.parallelism, "max_parallelism": c.max_parallelism,
                "key_type": c.key_type.value, "base": None if begun.base is None else begun.base.to_json(),
                "known": {k: list(v) for k, v in begun.known.items()}, "merging": c.merging.to_json(),
                "alignment": alignment.to_json(),
                "deadline_in": self._deadline_in(st, cid) if alignment.unaligned else None}

    @staticmethod
    def _deadline_in(st: _State, cid: int) -> float | None:
        """Seconds until checkpoint ``cid``'s subtasks defer their input (unaligned), counted from the
        start of its state stage: the first task's open of the attempt. Late waves get less; the
        caller turns it into a deadline on its own clock (no cross-host clock comparison)."""
        if not st.alignment.unaligned:
            return None
        started = st.coordinator.stage_started(cid)
        return max(0.0, st.alignment.aligned_checkpoint_timeout - (time.monotonic() - started))

    # --- ops ---------------------------------------------------------------------------------
    def _op_register(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name = f.text("name", max_len=200)
        try:
            validate_id(name, "state name")
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        checkpoint_dir = f.text("checkpoint_dir", default=None) or self.default_checkpoint_dir
        parallelism = f.integer("parallelism", lo=1, hi=32768)
        max_parallelism = f.integer("max_parallelism", lo=1, hi=32768)
        key_type = f.text("key_type", max_len=16)
        num_retained = f.integer("num_retained", default=1, lo=1, hi=10_000)
        source = f.text("restore_from", default=None, max_len=4096) or None
        claim_mode = self._claim_mode(f)
        with self._cond:
            st = self._states.get(name)
            first = self._registering.setdefault(name, threading.Lock()) if st is None else None
        if first is not None:   # the first registration: its storage I/O holds only this name's lock
            with first:
                with self._cond:
                    st = self._states.get(name)
                if st is None:
                    st = self._register_new(f, name, checkpoint_dir, parallelism, max_parallelism, key_type,
                                            num_retained, source, claim_mode)
                    return {"last_completed": st.coordinator.last_completed, "url": st.coordinator.storage.url,
                            "restore": st.restore, "rescaled_from": self._rescaled_from(st, parallelism)}
        assert st is not None  # found registered, or registered while this waited for the name's lock
        with st.lock:
            # registered before: only settings to settle
            c = st.coordinator
            _check_max_parallelism(name, c, max_parallelism)
            if (checkpoint_dir, key_type) != (st.checkpoint_dir, c.key_type.value):
                raise CheckpointError(
                    f"keyed state {name!r} is already open in this application with checkpoint_dir="
                    f"{st.checkpoint_dir!r}, parallelism={c.parallelism}, max_parallelism={c.max_parallelism}, "
                    f"key type {c.key_type.value}; open it with the same settings or use another name")
            if parallelism != c.parallelism:  # a rescale between batches: the next checkpoint rebuilds
                c.rescale(parallelism)
            if f.mapping("alignment", default=None) is not None:  # another alignment from the next batch on
                st.alignment = self._alignment(f)
            if source and (st.restore is None or st.restore.get("source") != source):
                note = (f"restore_from={source!r} is ignored: keyed state {name!r} is already open in this "
                        f"application")
                log.warning("%s", note)
                return {"last_completed": st.coordinator.last_completed, "url": st.coordinator.storage.url,
                        "restore": {"action": "ignored", "source": source, "note": note},
                        "rescaled_from": self._rescaled_from(st, parallelism)}
        # rescaled_from: the parallelism of the latest checkpoint, when the next one rescales from it
        return {"last_completed": st.coordinator.last_completed, "url": st.coordinator.storage.url,
                "restore": st.restore, "rescaled_from": self._rescaled_from(st, parallelism)}

    def _register_new(self, f: Fields, name: str, checkpoint_dir: str, parallelism: int, max_parallelism: int,
                      key_type: str, num_retained: int, source: str | None, claim_mode: ClaimMode) -> _State:
        """Open a state this application has not registered: the lease, restore_from, the coordinator's
        recovery. Called under the name's registration lock only, so other states go on meanwhile."""
        storage = CheckpointStorage.open(checkpoint_dir, name, self.cluster_id)
        merging = self._merging(f, storage)
        alignment = self._alignment(f)
        lease = self._acquire(storage)
        try:
            restore = self._restore(storage, source, claim_mode, max_parallelism, key_type) if source else None
            coord = CheckpointCoordinator(storage, parallelism, max_parallelism, key_type=key_type,
                                          num_retained=num_retained, merging=merging, lease=lease,
                                          orphan_grace=self.orphan_grace, background_deletes=True)
        except BaseException:
            lease.release()
            raise
        coord.flush_deletions()   # the start-up subsumption and sweep: done before the state is used
        st = _State(coord, checkpoint_dir, restore=restore, alignment=alignment, lease=lease,
                    drains=DrainLog.read(storage.location))
        with self._cond:
            self._states[name] = st
        log.info("keyed state %s registered (P=%d, M=%d, %s keys, %s)", name, parallelism, max_parallelism,
                 key_type, storage.url)
        return st

    # --- the writer lease --------------------------------------------------------------------
    def _acquire(self, storage: CheckpointStorage) -> StateLease:
        """Hold the writer lease of ``storage``'s state root (or raise naming the live holder), and
        keep it renewed."""
        application = self._application() or f"driver agent pid {os.getpid()}"
        lease = StateLease(storage.location, storage.state, application=application, ttl=self.lease_timeout)
        lease.acquire()
        if self._lease_thread is None:
            self._lease_thread = threading.Thread(target=self._lease_loop, name="steward-state-leases", daemon=True)
            self._lease_thread.start()
        return lease

    def _lease_loop(self) -> None:
        """Renew every state's lease every third of the lease timeout; sweep old orphans when idle."""
        last_sweep = time.monotonic()
        while not self._closed.wait(self.lease_timeout / 3):
            with self._cond:
                states = list(self._states.values())
            for st in states:
                if st.lease is not None:
                    st.lease.renew()
            if time.monotonic() - last_sweep >= max(self.orphan_grace / 4, self.lease_timeout):
                last_sweep = time.monotonic()
                for st in states:
                    try:
                        st.coordinator.sweep()
                    except StewardError as exc:
                        log.warning("sweeping orphans of %s failed: %s", st.coordinator.storage.state, exc)

    def close(self) -> None:
        """Stop renewing and release every lease (idempotent): the next writer may start at once."""
        self._closed.set()
        if self._lease_thread is not None:
            self._lease_thread.join(10.0)
        with self._cond:
            states = list(self._states.values())
        for st in states:
            st.coordinator.close()   # the queued deletes, under the lease
            if st.lease is not None:
                st.lease.release()

    @staticmethod
    def _rescaled_from(st: _State, parallelism: int) -> int | None:
        latest = max(st.coordinator.retained(), default=None)
        checkpointed = None if latest is None else st.coordinator.completed(latest).parallelism
        return checkpointed if checkpointed not in (None, parallelism) else None

    def _alignment(self, f: Fields) -> AlignmentOptions:
        """The state's alignment options (FLIP-76): the application's, with the request's overrides."""
        given = f.mapping("alignment", default=None) or {}
        try:
            return AlignmentOptions.from_json({**self.alignment.to_json(), **given})
        except StewardError as exc:
            raise InvalidRequestError(f"{f.op}: {exc}") from None

    def _merging(self, f: Fields, storage: CheckpointStorage) -> MergingOptions:
        """The state's file-merging options: the application's, with the request's overrides."""
        given = f.mapping("file_merging", default=None) or {}
        try:
            opts = MergingOptions.from_json({**self.merging.to_json(), **given})
        except StewardError as exc:
            raise InvalidRequestError(f"{f.op}: {exc}") from None
        opts.check_store(storage.url, storage.location.is_local)
        return opts

    @staticmethod
    def _claim_mode(f: Fields) -> ClaimMode:
        value = f.text("claim_mode", default=None, max_len=32) or ClaimMode.NO_CLAIM.value
        return ClaimMode.parse(value)

    @staticmethod
    def _restore(storage: CheckpointStorage, source: str, mode: ClaimMode, max_parallelism: int,
                 key_type: str) -> dict[str, Any]:
        """restore_from for a state being registered: ignored (with a note) when it has checkpoints of
        its own; a no-op when its restored starting point already came from ``source`` in ``mode``."""
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
        meta = restore_from(source, storage, max_parallelism=max_parallelism, claim_mode=mode, key_type=key_type,
                            duplicator=dup)
        stats = dup.stats
        out = {"action": "restored", "source": source, "claim_mode": mode.value,
               "checkpoint_id": meta.checkpoint_id, "source_state": meta.properties.get("source_state"),
               "files": len({f.path for f in meta.files()}), "bytes": meta.size,
               "copied_server_side": stats.server_side, "linked": stats.linked,
               "kernel_copied": stats.kernel_copied, "streamed": stats.streamed,
               "bytes_streamed": stats.bytes_streamed, "seconds": round(time.monotonic() - started, 3)}
        log.info("state %s restored from %s (%s): %s", storage.state, source, mode.value, out)
        return out

    def _op_begin(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name, st = self._state(f)
        parallelism = f.integer("parallelism", default=None, lo=1, hi=32768)
        query = f.text("query", default=None, max_len=200) or None
        batch = f.integer("batch_id", default=None, lo=0, hi=_MAX_ID)
        drain = f.flag("drain", default=False)
        given = f.mapping("alignment", default=None)
        try:
            override = AlignmentOptions.from_json({**st.alignment.to_json(), **given}) if given else None
        except StewardError as exc:
            raise InvalidRequestError(f"{f.op}: {exc}") from None
        warning = None
        st.coordinator.flush_deletions()   # an upload of this attempt never races a delete queued before it
        with st.lock:   # a drain record is written under this state's lock only
            c = st.coordinator
            if parallelism is not None and parallelism != c.parallelism:
                raise ParallelismError(
                    f"keyed state {c.storage.state!r} now has parallelism "
                    f"{c.parallelism} (it was opened again with that parallelism), but this "
                    f"KeyedState object routes rows to {parallelism} subtasks: use the object returned by the "
                    f"latest st.keyed_state(...) call")
            if drain:
                cid = self._drain_id(name, st)
                if cid is None:
                    return {"checkpoint_id": None, "rerun": False, "unaligned": False}
                override = AlignmentOptions(alignment=AlignmentMode.ALIGNED)
                last = c.last_completed
                query = c.completed(last).properties.get("query") if last is not None else None
            else:
                cid = st.drains.checkpoint_of(batch) if batch is not None else self._checkpoint_id(f, st)
            begun = c.begin(cid, query=query)
            if override is not None:
                st.overrides[cid] = override
            else:
                st.overrides.pop(cid, None)
            for old in [i for i in st.overrides if i < cid]:
                del st.overrides[old]
        backlog = self._backlog(st)
        if backlog is not None and backlog["growth"] >= GROWTH_WARNING and st.warned != backlog["checkpoint_id"]:
            st.warned = backlog["checkpoint_id"]
            warning = (f"keyed state {name!r}: the unaligned backlog grew for {backlog['growth']} checkpoints in a "
                       f"row, to {backlog['rows']} deferred rows ({backlog['bytes']} B) in checkpoint "
                       f"{backlog['checkpoint_id']}: its subtasks defer more input than they catch up with. Raise "
                       f"aligned_checkpoint_timeout, cap it with alignment='unaligned_max_inflight', add subtasks, "
                       f"or drain it (ks.drain(...)) when the input pauses")
            log.warning("%s", warning)
        alignment = st.overrides.get(cid, st.alignment)
        return {"checkpoint_id": cid, "rerun": begun.rerun, "unaligned": alignment.unaligned,
                "backlog_warning": warning, "attempt": begun.attempt}

    def _drain_id(self, name: str, st: _State) -> int | None:
        """The checkpoint id of a drain (the next after the last completed one), recorded in the
        state's drain record before it begins; None when the latest checkpoint has no backlog. Refused
        while a checkpoint is pending. The caller holds the state's lock, so no batch begins between the
        check and the record. A batch that failed since the last
        completed checkpoint is re-delivered with the id after the drain's."""
        c = st.coordinator
        last = c.last_completed
        latest = max(c.retained(), default=None)
        if latest is None or not any(s.channel_state for s in c.completed(latest).subtasks):
            return None
        if c.pending():
            raise CheckpointOrderError(
                f"keyed state {name!r} cannot drain now: checkpoint {c.pending()[-1]} is pending (a batch is "
                f"running, or was applied and neither committed nor aborted). Drain once it completed or was "
                f"aborted; a batch processes the backlog first anyway")
        cid = 0 if last is None else last + 1
        st.drains = st.drains.with_drain(cid)
        st.drains.write(c.storage.location)
        return cid

    def _op_cut(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        """FLIP-76: a subtask proposes where its attempt stops processing new input (``cut``, a key
        group) and gets the cut that stands; ``overflow``: its channel state at that cut passes the byte
        cap, so it processes everything."""
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        subtask = f.integer("subtask", lo=0, hi=32768)
        proposed = f.integer("cut", lo=0, hi=32768)
        if f.integer("overflow", default=0, lo=0, hi=1):
            return {"cut": st.coordinator.amend_cut(cid, subtask, proposed)}
        return {"cut": st.coordinator.cut(cid, subtask, proposed)}

    def _op_base(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        subtask = f.integer("subtask", default=None, lo=0, hi=32768)
        agent = f.text("agent", default="", max_len=200)
        routed = f.integer("parallelism", default=None, lo=1, hi=32768)
        if routed is not None and routed != st.coordinator.parallelism:
            raise ParallelismError(
                f"the rows of checkpoint {cid} of keyed state {st.coordinator.storage.state!r} were routed to {routed} "
                f"subtasks, but the state now has parallelism {st.coordinator.parallelism} (it was opened again with "
                f"another parallelism): apply the batch again with the KeyedState of the latest st.keyed_state(...) call")
        self._heard(agent)
        with st.lock:  # one begin per checkpoint, even when every task asks at once
            if cid in st.coordinator.pending():
                begun = st.coordinator.base(cid)
            else:  # a second action after commit re-runs N; an aborted N is refused (see begin)
                begun = st.coordinator.begin(cid, by_task=True)
            if agent and subtask is not None:
                st.coordinator.working_on(cid, subtask, agent)
        cut = None if subtask is None else st.coordinator.cut(cid, subtask)   # FLIP-76: recorded by an earlier attempt
        return {**self._reply_base(st, cid, begun), "cut": cut}

    def _op_ack(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        handle = SubtaskHandle.from_json(f.mapping("handle"))
        uploaded = req.get("uploaded") or []
        if not isinstance(uploaded, list) or not all(isinstance(p, str) for p in uploaded):
            raise InvalidRequestError(f"{f.op}: field 'uploaded' must be a list of paths")
        merged = req.get("merged") or []
        if not isinstance(merged, list) or not all(isinstance(p, str) for p in merged):
            raise InvalidRequestError(f"{f.op}: field 'merged' must be a list of paths")
        agent = f.text("agent", default="", max_len=200)
        attempt = f.text("attempt", max_len=64)
        raw_stats = f.mapping("stats", default=None)
        stats = None if raw_stats is None else SubtaskStats.from_fields(Fields({**raw_stats, "op": f"{f.op} stats"}))
        self._heard(agent)
        with st.lock:
            st.coordinator.ack(cid, handle, tuple(uploaded), tuple(merged), agent, attempt=attempt, stats=stats)
        self._notify()
        return {}

    def _op_fail(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        subtask = f.integer("subtask", lo=0, default=None)
        message = f.text("message", default="")
        attempt = f.text("attempt", max_len=64)
        who = f"subtask {subtask}" if subtask is not None else f"executor agent {f.text('agent', default='?')}"
        with st.lock:
            ignored = st.coordinator.fail(cid, attempt, who, message, subtask)
        if ignored is not None:
            log.info("ignoring a failure report of %s for checkpoint %d of %s: %s (%s)",
                     who, cid, st.coordinator.storage.state, ignored, message)
            return {"ignored": True}
        self._notify()
        return {"ignored": False}

    def _op_merge_poll(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        agent = f.text("agent", max_len=200)
        wait = f.number("wait", default=1.0, lo=0, hi=5.0)
        pools = req.get("pools") or []
        closed = req.get("closed") or []
        working = req.get("working") or []
        if not all(isinstance(x, list) and len(x) <= 100_000 for x in (pools, closed, working)):
            raise InvalidRequestError(f"{f.op}: fields 'pools', 'closed' and 'working' must be lists")
        asked = []
        for p in pools:
            pf = _sub(f, p)
            asked.append((pf.text("name", max_len=200), pf.integer("checkpoint_id", lo=0, hi=_MAX_ID)))
        busy = []
        for w in working:
            wf = _sub(f, w)
            busy.append((wf.text("name", max_len=200), wf.integer("checkpoint_id", lo=0, hi=_MAX_ID),
                         wf.integer("subtask", lo=0, hi=32768)))
        self._heard(agent)   # on arrival: a state busy with storage I/O never makes an agent look silent
        by_name: dict[str, set[str]] = {}
        for c in closed:
            cf = _sub(f, c)
            by_name.setdefault(cf.text("name", max_len=200), set()).add(cf.text("path", max_len=300))
        with self._cond:
            states = dict(self._states)
        for name, cid, subtask in busy:
            if name in states:
                with states[name].lock:
                    states[name].coordinator.working_on(cid, subtask, agent)
        for name, paths in by_name.items():
            if name in states:
                with states[name].lock:
                    states[name].coordinator.files_closed(agent, paths)
        deadline = time.monotonic() + wait
        generation = self._generation_now()
        while True:
            actions = [self._seal_action(states, n, c) for n, c in asked]
            left = deadline - time.monotonic()
            if left <= 0 or any(a["action"] != "wait" for a in actions):
                break
            generation = self._wait(generation, left)
        self._heard(agent)
        pending = {n: set(states[n].coordinator.pending()) for n, _, _ in busy if n in states}
        stale = sorted({(n, c) for n, c, _ in busy if n in pending and c not in pending[n]})
        # the agent releases what it still holds open of those (a task killed before its upload)
        return {"actions": actions, "stale": [{"name": n, "checkpoint_id": c} for n, c in stale]}

    @staticmethod
    def _seal_action(states: dict[str, _State], name: str, cid: int) -> dict[str, Any]:
        """What the agent does with its pool of ``cid``; a seal carries the attempt it is for."""
        st = states.get(name)
        action = "discard" if st is None else st.coordinator.seal_wanted(cid)
        out: dict[str, Any] = {"name": name, "checkpoint_id": cid, "action": action}
        if st is not None and action == "seal":
            out["attempt"] = st.coordinator.attempt(cid)
        return out

    def _op_sealed(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        agent = f.text("agent", max_len=200)
        attempt = f.text("attempt", max_len=64)
        files = req.get("files")
        if not isinstance(files, list) or len(files) > 100_000:
            raise InvalidRequestError(f"{f.op}: field 'files' must be a list of {{path, size}}")
        sealed = {}
        for x in files:
            xf = _sub(f, x)
            sealed[xf.text("path", max_len=300)] = xf.integer("size", lo=0)
        self._heard(agent)
        with st.lock:
            st.coordinator.sealed(cid, sealed, agent, attempt)
        self._notify()
        return {}

    def _silent_agents(self, st: _State, cid: int) -> tuple[list[str], list[int]]:
        """Agents that have not polled for agent_timeout and hold merged files ``cid`` needs or
        opened a subtask of it that has not acked; and those subtasks."""
        now = time.monotonic()
        holders = set(st.coordinator.unsealed(cid).values())
        pending = st.coordinator.pending_checkpoint(cid)
        opened = {} if pending is None else {i: a for i, a in pending.working.items() if i not in pending.acks}
        with self._seen_lock:
            seen = dict(self._seen)
        silent = sorted(a for a in holders | set(opened.values()) if now - seen.get(a, now) > self.agent_timeout)
        return silent, sorted(i for i, a in opened.items() if a in silent)

    def _op_commit(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name, st = self._state(f)
        wait = f.number("wait", default=None, lo=0, hi=_MAX_WAIT)
        wait = self.commit_timeout if wait is None else wait
        deadline = time.monotonic() + wait
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID, default=None)
        if cid is None:
            pending = st.coordinator.pending()
            if not pending:
                raise CheckpointOrderError(f"keyed state {name!r} has no pending checkpoint to commit")
            cid = pending[-1]
        try:
            return self._complete_when_acked(st, name, cid, wait, deadline)
        finally:   # the deletes it queued run outside this state's lock: its acks and seals go on meanwhile
            st.coordinator.flush_deletions()

    def _complete_when_acked(self, st: _State, name: str, cid: int, wait: float, deadline: float) -> dict[str, Any]:
        generation = self._generation_now()
        c = st.coordinator
        while True:
            with st.lock:   # this state only: another state's commit or heartbeat never waits on its I/O
                self._abort_if_failed(st, name, cid)
                waiting = c.waiting_for(cid)
                if waiting is None:
                    pending = c.pending_checkpoint(cid)
                    try:
                        meta = c.complete(cid)
                    except (CheckpointOrderError, StateLeaseError):
                        raise
                    except CheckpointError as exc:   # files it references are being or were deleted: retried
                        waiting = str(exc)
                    else:
                        if pending is not None and not pending.rerun and pending.stats:
                            st.completed[cid] = _Completed(dict(pending.stats), len(pending.sealed))
                            while len(st.completed) > _MAX_STATS:
                                del st.completed[min(st.completed)]
                        done = st.completed.get(cid)
                        stats = done.summary(cid) if done is not None else summarize(cid, {})
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    deleted = c.abort(cid)
                    raise CheckpointError(f"{waiting}; waited {wait:g} s, so checkpoint {cid} was aborted "
                                          f"({deleted} uploaded files deleted). Apply the batch again "
                                          f"with the same checkpoint_id")
            generation = self._wait(generation, min(left, 1.0))
        return {"checkpoint_id": cid, "metadata": meta.to_json(), "retained": c.retained(),
                "path": c.storage.url_of(checkpoint_dir_name(cid)), "stats": stats}

    def _abort_if_failed(self, st: _State, name: str, cid: int) -> None:
        """Abort ``cid`` and raise when an upload or seal of it failed, or an agent it waits for is
        silent (the caller holds ``st.lock``)."""
        pending = st.coordinator.pending_checkpoint(cid)
        failures = dict(pending.failures) if pending is not None else {}
        if failures:
            st.coordinator.abort(cid)
            raise CheckpointError(f"checkpoint {cid} of keyed state {name!r} was aborted: uploads failed "
                                  f"({'; '.join(failures.values())})")
        silent, lost = self._silent_agents(st, cid)
        if silent:
            holders = sorted(set(st.coordinator.unsealed(cid).values()) & set(silent))
            deleted = st.coordinator.abort(cid)
            for a in silent:
                st.coordinator.files_closed(a)
            what = (["hold merged checkpoint files it needs"] if holders else []) + \
                ([f"were uploading its subtasks {lost} (not acked)"] if lost else [])
            raise CheckpointError(
                f"checkpoint {cid} of keyed state {name!r} was aborted ({deleted} files deleted): executor "
                f"agents {silent} {' and '.join(what)} and have not answered for "
                f"{self.agent_timeout:g} s (their executor was lost?). Apply the batch again with the "
                f"same checkpoint_id")

    def _op_abort(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        with st.lock:
            deleted = st.coordinator.abort(cid)
        st.coordinator.flush_deletions()
        return {"deleted": deleted}

    def _op_check(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name = f.text("name", max_len=200)
        try:
            validate_id(name, "state name")
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        checkpoint_dir = f.text("checkpoint_dir", default=None) or self.default_checkpoint_dir
        max_parallelism = f.integer("max_parallelism", lo=1, hi=32768)
        source = f.text("restore_from", default=None, max_len=4096) or None
        mode = self._claim_mode(f)
        with self._cond:
            st = self._states.get(name)
        if st is not None:  # open in this application: register settles the rest
            _check_max_parallelism(name, st.coordinator, max_parallelism)
            return {"registered": True, "last_completed": st.coordinator.last_completed,
                    "key_type": st.coordinator.key_type.value}
        storage = CheckpointStorage.open(checkpoint_dir, name, self.cluster_id)
        self._merging(f, storage)
        self._alignment(f)
        own = storage.checkpoint_ids()
        if own:
            latest = storage.read_metadata(own[-1])
            check_max_parallelism(latest, max_parallelism)
            return {"registered": False, "last_completed": own[-1], "restore_from": "ignored" if source else None,
                    "key_type": latest.key_type.value}
        if source:
            src, meta = open_checkpoint(source)
            check_max_parallelism(meta, max_parallelism)
            check_sources(src, meta, source)
            return {"registered": False, "last_completed": None, "restore_from": mode.value,
                    "checkpoint_id": meta.checkpoint_id, "key_type": meta.key_type.value}
        return {"registered": False, "last_completed": None, "restore_from": None}

    def _op_savepoint(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name = f.text("name", max_len=200)
        url = f.text("url", max_len=4096)
        with self._cond:
            st = self._states.get(name)
            checkpoint_dirs = {self.default_checkpoint_dir, *(s.checkpoint_dir for s in self._states.values())}
        if st is not None:
            with st.lock:
                c = st.coordinator
                latest = c.last_completed
                latest = latest if latest is not None else (RESTORED if c.restored is not None else None)
                if latest is None:
                    raise CheckpointError(f"keyed state {name!r} has no completed checkpoint yet: commit one "
                                          f"before taking a savepoint")
                meta = c.pin(latest)  # kept (with its files) while the copy runs, even if commits subsume it
                storage = c.storage
        else:  # not open in this application: the latest checkpoint on storage
            try:
                validate_id(name, "state name")
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            checkpoint_dir = f.text("checkpoint_dir", default=None) or self.default_checkpoint_dir
            storage = CheckpointStorage.open(checkpoint_dir, name, self.cluster_id)
            own = storage.checkpoint_ids()
            latest = own[-1] if own else (RESTORED if storage.has_restored() else None)
            if latest is None:
                raise CheckpointError(f"keyed state {name!r} has no completed checkpoint in {storage.url}: "
                                      f"commit one before taking a savepoint")
            meta = storage.read_metadata(latest)
        dup = Duplicator()
        try:
            path = write_savepoint(storage, meta, url, dup, checkpoint_dirs=sorted(checkpoint_dirs),
                                   source=storage.location.display(storage.metadata_path(latest)))
        finally:
            if st is not None:
                with st.lock:
                    st.coordinator.unpin(latest)
        log.info("savepoint of %s checkpoint %d written to %s (%d files copied on the server, %d linked, %d B "
                 "streamed)", name, meta.checkpoint_id, path, dup.stats.server_side, dup.stats.linked,
                 dup.stats.bytes_streamed)
        return {"url": url, "metadata": path, "checkpoint_id": meta.checkpoint_id,
                "files": len({f.path for f in meta.files()}), "bytes": meta.size,
                "bytes_streamed": dup.stats.bytes_streamed}

    def _op_info(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        c = st.coordinator
        backlog = self._backlog(st)
        with st.lock:
            last = c.last_completed
            latest = max((i for i in c.retained()), default=None)
            meta = c.completed(latest).to_json() if latest is not None else None
            return {"last_completed": last, "retained": c.retained(), "pending": c.pending(),
                    "restored": RESTORED in c.retained(), "url": c.storage.url, "latest": meta,
                    "backlog": backlog, "drains": list(st.drains.drains),
                    "checkpoint_dir": st.checkpoint_dir, "cluster_id": self.cluster_id, "restore": st.restore,
                    "parallelism": c.parallelism, "max_parallelism": c.max_parallelism,
                    "file_merging": c.merging.to_json(), "space": c.space().to_json(),
                    "no_reuse": sorted(c.no_reuse())[:1000],
                    "checkpoints": [st.completed[cid].summary(cid) for cid in sorted(st.completed)]}


def _sub(f: Fields, item: Any) -> Fields:
    """Typed access to one element of a list field, named after the request's op."""
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{f.op}: list element {str(item)[:80]!r} is not an object")
    return Fields({**item, "op": f.op})


def _check_max_parallelism(name: str, c: CheckpointCoordinator, max_parallelism: int) -> None:
    if max_parallelism != c.max_parallelism:
        raise ParallelismError(
            f"keyed state {name!r} has max_parallelism={c.max_parallelism} and cannot be opened with "
            f"max_parallelism={max_parallelism}: the max parallelism fixes the key groups and cannot change. "
            f"Keep max_parallelism={c.max_parallelism} (any parallelism up to it works), or use another state name")


def default_checkpoint_dir(cfg: Any) -> str:
    """``spark.steward.checkpoint.dir``, else ``<state-dir>/checkpoints``."""
    return cfg.checkpoint_dir or os.path.join(os.path.expanduser(cfg.effective_state_dir), "checkpoints")
