"""The driver's side of keyed state on the driver agent: the ``state.*`` ops KeyedState calls, over
one :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator` per state. The ops executor
agents call (base, cut, ack, fail, merge_poll, sealed) are
:class:`~sparksteward.checkpoint.coordination.gateway.CheckpointGateway`'s; both share one
:class:`~sparksteward.checkpoint.coordination.registration.StateTable`.

Ops: ``state.check``, ``state.register``, ``state.savepoint``, ``state.begin``, ``state.commit``,
``state.abort`` and ``state.info``, each a typed request and reply in
:mod:`~sparksteward.checkpoint.lifecycle_messages`, whose docstrings say what they do (the op table of
``docs/architecture.md`` is generated from them). Every request names its state with ``name``.

Thread-safe: requests run on connection threads. A state's checkpoint protocol has one lock, its
coordinator's; storage I/O runs under it, never under the table's condition (the map of states, and
waiters). ``st.lock`` guards only what the service keeps beside the coordinator (completed stats, drain
record, alignment and overrides) and orders the driver's register and begin; always taken outside
the coordinator's locks, by no executor agent's op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from sparksteward.checkpoint.begun import time_of
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.coordination.gateway import CheckpointGateway
from sparksteward.checkpoint.coordination.pending import Readiness, Ready
from sparksteward.checkpoint.coordination.registration import (
    CompletedStats,
    RegisteredState,
    Registration,
    StateTable,
    check_unregistered,
    restore_on_register,
    unusable_dir,
)
from sparksteward.checkpoint.coordination.report import CheckpointReport, checkpoint_report
from sparksteward.checkpoint.coordination.stats import summarize
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.lease import StateLease
from sparksteward.checkpoint.lifecycle_messages import (
    AbortReply,
    AbortRequest,
    BatchTime,
    BeginReply,
    BeginRequest,
    CheckReply,
    CheckRequest,
    CommitReply,
    CommitRequest,
    InfoReply,
    InfoRequest,
    OpenedReply,
    OpenedRequest,
    RegisterReply,
    RegisterRequest,
    SavepointReply,
    SavepointRequest,
)
from sparksteward.checkpoint.restore import write_savepoint
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage, checkpoint_dir_name
from sparksteward.checkpoint.unaligned.backlog import GROWTH_WARNING, DrainLog, growth
from sparksteward.checkpoint.unaligned.channel_state import AlignmentMode, AlignmentOptions
from sparksteward.errors import (
    CheckpointError,
    CheckpointOrderError,
    InvalidRequestError,
    ParallelismError,
    StateEncodingError,
    StateLeaseError,
    StewardError,
    StorageError,
)
from sparksteward.ids import validate_id
from sparksteward.wire import AgentServer, Connection

__all__ = ["StateService"]

log = logging.getLogger("sparksteward.checkpoint.coordination.driver_service")

_MAX_STATS = 1000  # checkpoints whose per-subtask ack stats state.info keeps


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
        self.table = StateTable()
        self.gateway = CheckpointGateway(self.table, cluster_id)   # the ops executor agents call
        self._registering_lock = threading.Lock()
        self._registering: dict[str, threading.Lock] = {}   # state name -> its first registration
        self.lease_timeout = lease_timeout
        self.orphan_grace = orphan_grace
        self._application = application
        self._closed = threading.Event()
        self._lease_thread: threading.Thread | None = None
        self._figures_lock = threading.Lock()
        self._begun: dict[tuple[str, int], tuple[float, int | None]] = {}   # (state, id) -> begin's time, batch
        self._reports: dict[str, CheckpointReport] = {}   # state -> its latest checkpoint completed here

    def metrics(self) -> dict[str, int | float]:
        """The file-merging numbers of every registered state, flat, for health and Spark's metrics:
        ``state.<name>.merged.<k>`` for each ``k`` of :meth:`SpaceStats.to_json` (physical and logical
        files and bytes, whole files and bytes, amplification) and ``no_reuse_files``; and
        ``state.<name>.unaligned.<k>`` of its latest checkpoint (FLIP-76): ``rows_processed``,
        ``rows_deferred``, ``channel_bytes``, ``unaligned_subtasks``, ``checkpoint_id``; and its backlog,
        the channel state of the latest completed checkpoint that no batch processed yet:
        ``backlog_bytes``, ``backlog_rows`` (when acked in this application) and ``backlog_growth``
        (consecutive checkpoints it grew for); and ``state.<name>.checkpoint.<figure>`` of the latest
        checkpoint completed in this application (see :mod:`~sparksteward.checkpoint.coordination.report`).

        Thread-safe: the states are listed under the service's condition; each state's numbers are read
        under its own lock.
        """
        states = sorted(self.table.all().items())
        out: dict[str, int | float] = {}
        for name, st in states:
            prefix = f"state.{name}.merged."
            for key, value in st.coordinator.space().to_json().items():
                out[prefix + key] = value
            out[prefix + "no_reuse_files"] = len(st.coordinator.no_reuse())
            with st.lock:   # st.completed (the service's own data); FLIP-76: the latest checkpoint acked here
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
            report = self.report(name)
            if report is not None:
                out.update(report.gauges())
        return out

    def report(self, name: str) -> CheckpointReport | None:
        """The report of state ``name``'s latest checkpoint completed in this application, or None."""
        with self._figures_lock:
            return self._reports.get(name)

    def _completed(self, name: str, st: RegisteredState, cid: int, stats: dict[str, Any], commit_ms: float,
                   query: str | None, stage_runs: int = 1) -> CheckpointReport:
        """Make, keep and log the report of checkpoint ``cid``, just completed."""
        with self._figures_lock:
            begun, batch = self._begun.get((name, cid), (None, None))
            for key in [k for k in self._begun if k[0] == name and k[1] <= cid]:
                del self._begun[key]
        duration = (time.monotonic() - begun) * 1000 if begun is not None else commit_ms
        report = checkpoint_report(name, stats, parallelism=st.coordinator.parallelism, batch_id=batch,
                                   commit_ms=commit_ms, duration_ms=duration, query=query, stage_runs=stage_runs)
        with self._figures_lock:
            self._reports[name] = report
        report.log()
        return report

    def _backlog(self, st: RegisteredState) -> dict[str, Any] | None:
        """The channel state of the latest completed checkpoint (see checkpoint/unaligned/backlog.py): its bytes
        (from the record), rows (from the acks, None unless acked in this application), the subtasks
        that hold some, and for how many consecutive checkpoints it grew."""
        c = st.coordinator
        latest = max(c.retained(), default=None)
        if latest is None:
            return None
        per = [sum(f.length for f in s.channel_state) for s in c.completed(latest).subtasks]
        with st.lock:   # st.completed: the service's own data
            rows = {cid: sum(a.rows_deferred for a in done.per_subtask.values()) for cid, done in st.completed.items()}
        return {"checkpoint_id": latest, "bytes": sum(per), "rows": rows.get(latest),
                "subtasks": [i for i, b in enumerate(per) if b], "growth": growth(rows) if latest in rows else 0}

    def register_handlers(self, server: AgentServer) -> None:
        server.serve(RegisterRequest, self._op_register)
        server.serve(CheckRequest, self._op_check)
        server.serve(BeginRequest, self._op_begin)
        server.serve(CommitRequest, self._op_commit)
        server.serve(AbortRequest, self._op_abort)
        server.serve(OpenedRequest, self._op_opened)
        server.serve(InfoRequest, self._op_info)
        server.serve(SavepointRequest, self._op_savepoint)
        self.gateway.register_handlers(server)

    def registered(self, name: str) -> RegisteredState:
        """The state ``name`` open in this application (KeyError if it is not)."""
        st = self.table.get(name)
        if st is None:
            raise KeyError(name)
        return st

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _checkpoint_id(cid: int | None, st: RegisteredState) -> int:
        """``cid``, or (None) the next after the last completed checkpoint."""
        if cid is None:
            last = st.coordinator.last_completed
            cid = 0 if last is None else last + 1
        return cid

    # --- ops ---------------------------------------------------------------------------------
    def _op_register(self, conn: Connection, req: RegisterRequest) -> RegisterReply:
        reg = Registration.from_request(req, self.default_checkpoint_dir)
        name = reg.name
        with self._registering_lock:
            st = self.table.get(name)
            first = self._registering.setdefault(name, threading.Lock()) if st is None else None
        if first is not None:   # the first registration: its storage I/O holds only this name's lock
            with first:
                st = self.table.get(name)
                if st is None:
                    st = self._register_new(reg)
                    return self._registered(st, reg, st.restore)
        assert st is not None  # found registered, or registered while this waited for the name's lock
        with st.lock:   # the service's settings (st.alignment), and no begin between its checks and the rescale
            # registered before: only settings to settle
            c = st.coordinator
            st.check_max_parallelism(name, reg.max_parallelism)
            self._check_same_key(name, reg, c)
            if (reg.checkpoint_dir, reg.key_type) != (st.checkpoint_dir, c.key_type.value):
                raise CheckpointError(
                    f"keyed state {name!r} is already open in this application with checkpoint_dir="
                    f"{st.checkpoint_dir!r}, parallelism={c.parallelism}, max_parallelism={c.max_parallelism}, "
                    f"key type {c.key_type.value}; open it with the same settings or use another name")
            if reg.states is not None or reg.delete_states:   # declared again: from the next checkpoint on
                c.declare(lambda recorded: reg.states_of(recorded, checkpointed=bool(c.retained())))
            if reg.parallelism != c.parallelism:  # a rescale between batches: the next checkpoint rebuilds
                c.rescale(reg.parallelism)
            if reg.alignment is not None:  # another alignment from the next batch on
                st.alignment = reg.alignment_of(self.alignment)
            if reg.event_time is not None:   # another event-time delay from the next batch on
                c.event_time = reg.event_time
            if reg.source and (st.restore is None or st.restore.get("source") != reg.source):
                note = (f"restore_from={reg.source!r} is ignored: keyed state {name!r} is already open in this "
                        f"application")
                log.warning("%s", note)
                return self._registered(st, reg, {"action": "ignored", "source": reg.source, "note": note})
        return self._registered(st, reg, st.restore)

    @staticmethod
    def _registered(st: RegisteredState, reg: Registration, restore: dict[str, Any] | None) -> RegisterReply:
        # rescaled_from: the parallelism of the latest checkpoint, when the next one rescales from it
        return RegisterReply(last_completed=st.coordinator.last_completed, url=st.coordinator.storage.url,
                             restore=restore, rescaled_from=st.rescaled_from(reg.parallelism),
                             states=st.coordinator.states)

    def _register_new(self, reg: Registration) -> RegisteredState:
        """Open a state this application has not registered: the lease, restore_from, the coordinator's
        recovery. Called under the name's registration lock only, so other states go on meanwhile."""
        storage = CheckpointStorage.open(reg.checkpoint_dir, reg.name, self.cluster_id)
        merging = reg.merging_of(self.merging, storage)
        alignment = reg.alignment_of(self.alignment)
        try:
            lease = self._acquire(storage)
        except StorageError as exc:
            raise unusable_dir(reg, exc) from exc
        try:
            restore = restore_on_register(storage, reg) if reg.source else None
            coord = CheckpointCoordinator(storage, reg.parallelism, reg.max_parallelism, key_type=reg.key_type,
                                          num_retained=reg.num_retained, merging=merging, lease=lease,
                                          orphan_grace=self.orphan_grace, background_deletes=True)
        except BaseException:
            lease.release()
            raise
        try:   # the declared state variables over those the latest checkpoint recorded, and its key column
            latest = max(coord.retained(), default=None)
            meta = None if latest is None else coord.completed(latest)
            reg.check_key(meta)
            coord.key_column = reg.key or (meta.properties.get("key") if meta is not None else None) or None
            coord.event_time = reg.event_time
            coord.states = reg.states_of(None if meta is None else meta.properties.get("states"),
                                         checkpointed=meta is not None)
        except BaseException:
            coord.close()
            lease.release()
            raise
        coord.flush_deletions()   # the start-up subsumption and sweep: done before the state is used
        st = RegisteredState(coord, reg.checkpoint_dir, restore=restore, alignment=alignment, lease=lease,
                             drains=DrainLog.read(storage.location))
        self.table.add(reg.name, st)
        log.info("keyed state %s registered (P=%d, M=%d, %s keys, %s)", reg.name, reg.parallelism,
                 reg.max_parallelism, reg.key_type, storage.url)
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
        """Renew every state's lease every third of the lease timeout; sweep old orphans when idle.

        One state's error never stops the others': ``renew`` raises none of the store's errors (a state
        whose lease is lost fences itself and says why), and whatever a state's renewal raises anyway,
        or its sweep, is logged and the loop goes on with the next state."""
        last_sweep = time.monotonic()
        while not self._closed.wait(self.lease_timeout / 3):
            states = list(self.table.all().values())
            for st in states:
                if st.lease is not None:
                    try:
                        st.lease.renew()
                    except Exception:  # a bug, not the store (renew catches that): the other states go on
                        log.exception("renewing the lease of %s failed", st.coordinator.storage.state)
            if time.monotonic() - last_sweep >= max(self.orphan_grace / 4, self.lease_timeout):
                last_sweep = time.monotonic()
                for st in states:
                    try:
                        st.coordinator.sweep()
                    except (StewardError, OSError) as exc:  # a deleted state folder: the other states go on
                        log.warning("sweeping orphans of %s failed: %s", st.coordinator.storage.state, exc)

    def close(self) -> None:
        """Stop renewing and release every lease (idempotent): the next writer may start at once."""
        self._closed.set()
        if self._lease_thread is not None:
            self._lease_thread.join(10.0)
        states = list(self.table.all().values())
        for st in states:
            st.coordinator.close()   # the queued deletes, under the lease
            if st.lease is not None:
                st.lease.release()

    def _op_begin(self, conn: Connection, req: BeginRequest) -> BeginReply:
        name, st = self.table.lookup(req.name)
        parallelism, batch, given = req.parallelism, req.batch_id, req.alignment
        query = req.query or None
        try:
            override = AlignmentOptions.from_json({**st.alignment.to_json(), **given}) if given else None
        except StewardError as exc:
            raise InvalidRequestError(f"{req.OP}: {exc}") from None
        warning = None
        st.coordinator.flush_deletions()   # an upload of this attempt never races a delete queued before it
        # the service's data (drain record, overrides) and the driver's ops in order (no rescale or other
        with st.lock:   # drain between these checks and the begin); the coordinator takes its own lock inside
            c = st.coordinator
            if parallelism is not None and parallelism != c.parallelism:
                raise ParallelismError(
                    f"keyed state {c.storage.state!r} now has parallelism "
                    f"{c.parallelism} (it was opened again with that parallelism), but this "
                    f"KeyedState object routes rows to {parallelism} subtasks: use the object returned by the "
                    f"latest st.keyed_state(...) call")
            if req.drain:
                cid = self._drain_id(name, st, always=req.timers)
                if cid is None:
                    return BeginReply(checkpoint_id=None, rerun=False, unaligned=False)
                override = AlignmentOptions(alignment=AlignmentMode.ALIGNED)
                last = c.last_completed
                query = c.completed(last).properties.get("query") if last is not None else None
            else:
                cid = st.drains.checkpoint_of(batch) if batch is not None else \
                    self._checkpoint_id(req.checkpoint_id, st)
            wanted = override or st.alignment
            begun = c.begin(cid, query=query, unaligned=wanted.unaligned)
            states = begun.states   # the record this attempt's tasks run with, its pending drops included
            with self._figures_lock:
                self._begun[(name, cid)] = (time.monotonic(), batch)
            if begun.unaligned != wanted.unaligned:   # an earlier delivery of cid ran with the other alignment
                override = AlignmentOptions.from_json({**wanted.to_json(), "alignment": (
                    AlignmentMode.UNALIGNED if begun.unaligned else AlignmentMode.ALIGNED).value})
                log.info("checkpoint %d of %s runs %s, as its first delivery did", cid, name,
                         override.alignment.value)
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
        return BeginReply(checkpoint_id=cid, rerun=begun.rerun, unaligned=alignment.unaligned,
                          backlog_warning=warning, attempt=begun.attempt,
                          time=None if begun.time is None else BatchTime(**begun.time.to_json()),
                          states=states, empty=begun.base is None)

    def _drain_id(self, name: str, st: RegisteredState, always: bool = False) -> int | None:
        """The checkpoint id of a drain (the next after the last completed one), recorded in the state's
        drain record before it begins; None when the latest checkpoint has no backlog and not ``always``.
        Refused while a checkpoint is pending. The caller holds the state's lock, so no batch begins
        between the check and the record. A batch that failed since the last completed checkpoint is
        re-delivered with the id after the drain's."""
        c = st.coordinator
        last = c.last_completed
        newest = c.latest_retained()   # one answer: a commit may subsume the checkpoint meanwhile
        if not always and (newest is None or not any(s.channel_state for s in newest.subtasks)):
            return None
        pending = c.pending()
        if pending:
            raise CheckpointOrderError(
                f"keyed state {name!r} cannot drain now: checkpoint {pending[-1]} is pending (a batch is "
                f"running, or was applied and neither committed nor aborted). Drain once it completed or was "
                f"aborted; a batch processes the backlog first anyway")
        cid = 0 if last is None else last + 1
        st.drains = st.drains.with_drain(cid)
        st.drains.write(c.storage.location)
        return cid

    def _op_commit(self, conn: Connection, req: CommitRequest) -> CommitReply:
        name, st = self.table.lookup(req.name)
        wait = self.commit_timeout if req.wait is None else req.wait
        deadline = time.monotonic() + wait
        cid = req.checkpoint_id
        if cid is None:
            pending = st.coordinator.pending()
            if not pending:
                raise CheckpointOrderError(f"keyed state {name!r} has no pending checkpoint to commit")
            cid = pending[-1]
        try:
            return CommitReply(**self._complete_when_acked(st, name, cid, wait, deadline))
        finally:   # the deletes it queued run outside this state's lock: its acks and seals go on meanwhile
            st.coordinator.flush_deletions()

    def _complete_when_acked(self, st: RegisteredState, name: str, cid: int, wait: float, deadline: float) -> dict[str, Any]:
        """Wait until pending ``cid`` is ready (as it decides: ``CheckpointCoordinator.readiness``), then
        complete it; abort it when it failed or the wait runs out. Only the coordinator's lock is taken:
        no other state waits on this one's I/O, and its acks and seals go on while it waits."""
        generation = self.table.generation()
        c = st.coordinator
        while True:
            ready = c.readiness(cid, self.agent_timeout, lambda agents: self.table.silent(agents, self.agent_timeout))
            if ready is not None and ready.state is Ready.FAILED:
                self._abort_failed(st, name, ready)
            waiting = None if ready is None else ready.reason
            if ready is None or ready.state is Ready.READY:   # not pending: complete returns its record or refuses
                started = time.monotonic()
                try:
                    done = c.complete_attempt(cid)
                except (CheckpointOrderError, StateLeaseError):
                    raise
                except CheckpointError as exc:   # files it references are being or were deleted: retried
                    waiting = str(exc)
                else:
                    meta, attempt = done.metadata, done.attempt
                    with st.lock:   # st.completed is the service's own data (metrics and info read it)
                        if attempt is not None and not attempt.rerun and attempt.stats:
                            st.completed[cid] = CompletedStats(dict(attempt.stats), len(attempt.sealed))
                            while len(st.completed) > _MAX_STATS:
                                del st.completed[min(st.completed)]
                        kept = st.completed.get(cid)
                    stats = kept.summary(cid) if kept is not None else summarize(cid, {})
                    if (when := time_of(meta)) is not None and when.watermark_ms is not None:
                        stats["watermark_ms"] = when.watermark_ms   # the watermark the batch ran with
                    report = None
                    if attempt is not None and not attempt.rerun:
                        report = self._completed(name, st, cid, stats, (time.monotonic() - started) * 1000,
                                                 attempt.query, attempt.stage_runs)
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                deleted = c.abort(cid)
                raise CheckpointError(f"{waiting}; waited {wait:g} s, so checkpoint {cid} was aborted "
                                      f"({deleted} uploaded files deleted). Apply the batch again "
                                      f"with the same checkpoint_id")
            generation = self.table.wait(generation, min(left, 1.0))
        return {"checkpoint_id": cid, "metadata": meta.to_json(), "retained": c.retained(),
                "path": c.storage.url_of(checkpoint_dir_name(cid)), "stats": stats,
                "report": report.to_json() if report is not None else None}

    @staticmethod
    def _abort_failed(st: RegisteredState, name: str, ready: Readiness) -> NoReturn:
        """Abort a checkpoint that cannot complete (an upload or a seal failed, or an executor agent it
        waits for went silent: the files that agent held open are released) and raise why."""
        deleted = st.coordinator.abort(ready.checkpoint_id)
        for a in ready.silent:
            st.coordinator.files_closed(a)
        raise CheckpointError(ready.abort_error(name, deleted))

    def _op_abort(self, conn: Connection, req: AbortRequest) -> AbortReply:
        _, st = self.table.lookup(req.name)
        deleted = st.coordinator.abort(req.checkpoint_id)
        st.coordinator.flush_deletions()
        return AbortReply(deleted)

    def _op_opened(self, conn: Connection, req: OpenedRequest) -> OpenedReply:
        _, st = self.table.lookup(req.name)
        view = st.coordinator.snapshot(req.checkpoint_id)
        return OpenedReply([] if view is None else list(view.unopened))

    @staticmethod
    def _check_same_key(name: str, reg: Registration, c: CheckpointCoordinator) -> None:
        if reg.key and c.key_column and reg.key != c.key_column:
            raise StateEncodingError(
                f"keyed state {name!r} is open in this application keyed by column {c.key_column!r}, and was "
                f"opened again with key={reg.key!r}: one state holds one kind of key. Open it with "
                f"key={c.key_column!r}, or use another state name")

    def _op_check(self, conn: Connection, req: CheckRequest) -> CheckReply:
        reg = Registration.from_request(req, self.default_checkpoint_dir)
        st = self.table.get(reg.name)
        if st is not None:  # open in this application: register settles the rest
            st.check_max_parallelism(reg.name, reg.max_parallelism)
            c = st.coordinator
            self._check_same_key(reg.name, reg, c)
            latest = max(c.retained(), default=None)
            return CheckReply(registered=True, last_completed=c.last_completed, key_type=c.key_type.value,
                              latest=None if latest is None else c.completed(latest).to_json(),
                              states=reg.states_of(c.states, checkpointed=bool(c.retained())),
                              checkpoint_dir=st.checkpoint_dir, cluster_id=self.cluster_id)
        storage = CheckpointStorage.open(reg.checkpoint_dir, reg.name, self.cluster_id)
        return check_unregistered(reg, storage, self.merging, self.alignment, self.cluster_id)

    def _op_savepoint(self, conn: Connection, req: SavepointRequest) -> SavepointReply:
        name, url = req.name, req.url
        states = self.table.all()
        st = states.get(name)
        checkpoint_dirs = {self.default_checkpoint_dir, *(s.checkpoint_dir for s in states.values())}
        latest: int | None   # the checkpoint copied (RESTORED: the restored starting point)
        if st is not None:
            # the latest completed checkpoint (else the restored one), kept with its files while the copy
            # runs, even if commits subsume it
            pinned = st.coordinator.pin_latest()
            if pinned is None:
                raise CheckpointError(f"keyed state {name!r} has no completed checkpoint yet: commit one "
                                      f"before taking a savepoint")
            latest, meta = pinned
            storage = st.coordinator.storage
        else:  # not open in this application: the latest checkpoint on storage
            try:
                validate_id(name, "state name")
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            checkpoint_dir = req.checkpoint_dir or self.default_checkpoint_dir
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
                st.coordinator.unpin(latest)
        log.info("savepoint of %s checkpoint %d written to %s (%d files copied on the server, %d linked, %d B "
                 "streamed)", name, meta.checkpoint_id, path, dup.stats.server_side, dup.stats.linked,
                 dup.stats.bytes_streamed)
        return SavepointReply(url=url, metadata=path, checkpoint_id=meta.checkpoint_id,
                              files=len({f.path for f in meta.files()}), bytes=meta.size,
                              bytes_streamed=dup.stats.bytes_streamed)

    def _op_info(self, conn: Connection, req: InfoRequest) -> InfoReply:
        name, st = self.table.lookup(req.name)
        c = st.coordinator
        backlog = self._backlog(st)
        report = self.report(name)
        with st.lock:   # st.drains and st.completed: the service's own data
            last = c.last_completed
            newest = c.latest_retained()
            meta = newest.to_json() if newest is not None else None
            return InfoReply(
                last_completed=last, retained=c.retained(), pending=c.pending(),
                restored=RESTORED in c.retained(), url=c.storage.url, latest=meta,
                backlog=backlog, drains=list(st.drains.drains),
                checkpoint_dir=st.checkpoint_dir, cluster_id=self.cluster_id, restore=st.restore,
                parallelism=c.parallelism, max_parallelism=c.max_parallelism,
                file_merging=c.merging.to_json(), space=c.space().to_json(),
                no_reuse=sorted(c.no_reuse())[:1000],
                report=report.to_json() if report is not None else None,
                lease=st.lease.info() if st.lease is not None else None,
                checkpoints=[st.completed[cid].summary(cid) for cid in sorted(st.completed)])


def default_checkpoint_dir(cfg: Any) -> str:
    """``spark.steward.checkpoint.dir``, else ``<state-dir>/checkpoints``."""
    return cfg.checkpoint_dir or os.path.join(os.path.expanduser(cfg.effective_state_dir), "checkpoints")
