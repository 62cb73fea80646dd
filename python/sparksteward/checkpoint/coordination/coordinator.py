"""The checkpoint coordinator of one keyed state (Flink's CheckpointCoordinator), hosted by the driver
agent. Spark-free: the agent feeds it ``begin``/``ack``/``complete``/``abort`` calls.

Life of checkpoint ``N`` (one micro-batch)::

    begin(N)              -> pending; returns the base (the last completed checkpoint before N) that
                             every attempt of N restores, and the files that base already holds
    ack(N, i, result)     <- subtask i's async phase is done: its handle and what it uploaded
    complete(N)           -> all P acked: chk-N/_metadata is written atomically, N is completed,
                             older checkpoints beyond num_retained are subsumed
    abort(N)              -> pending dropped; files only N uploaded are deleted

**Exactly-once rules.** ``begin(N)`` with ``N`` older than the last completed checkpoint is refused
(:class:`~sparksteward.errors.CheckpointOrderError`). ``begin(N)`` with ``N`` equal to the last
completed one is a re-run (the driver died after ``complete`` but before Spark recorded the batch):
it restores the same base, and its ``complete`` keeps the first result. To make that possible the
base of the last completed checkpoint is retained until a newer checkpoint begins ("keep N-1 until
N+1 starts"), on top of the ``num_retained`` latest completed ones; a coordinator rebuilt from the
checkpoint dir (a restarted driver) keeps it too. A newer checkpoint beginning or completing aborts
the older pending ones (a re-run left pending by a second action after ``complete``, an abandoned
attempt). A task may re-begin a completed checkpoint (a second action) but not an aborted one: only
the driver's ``begin`` restarts that, so a straggler of the abandoned attempt cannot.

**Files.** Reference counts, retention, the start-up sweep and what may be deleted belong to
:class:`~sparksteward.checkpoint.coordination.completed.CompletedCheckpoints` (claimed files included); the
deletes themselves run in order on :class:`~sparksteward.checkpoint.coordination.deleter.FileDeleter`'s thread.

**Late acks** (of a replaced or aborted attempt, after its checkpoint completed or was aborted) are
refused and their uploads deleted once nothing is pending: a pending attempt's upload, not acked yet,
may hold the same content (files are named by content), so the deletion waits for it.

**Paths from peers** are checked before anything of an ack is recorded (``peer_paths.py``; the rules
of a begin are in ``begin_rules.py``); deletion reaches only data files and the URLs this state claimed.
**Merged files (FLIP-306)**: once every subtask acked, the agents seal the merged files the acks listed,
and ``complete`` waits for those seals (``seals.py``, also the ``across`` files agents still append to).

**Readiness** is the pending checkpoint's own decision (:meth:`PendingCheckpoint.readiness
<sparksteward.checkpoint.coordination.pending.PendingCheckpoint.readiness>`), answered under the lock;
the service's commit loop waits on it, then completes or aborts. The live pending checkpoint never
leaves the coordinator: callers get copies (``PendingView``, ``BeginResult``, ``Completion``), and
what must happen at once (a task's base-or-begin, a savepoint's pin) is one method.

Thread-safe: one lock around every operation, the only lock of the state's checkpoint protocol. Lock
order: the begun record's ``_begun_io`` (:attr:`BegunRecorder.io
<sparksteward.checkpoint.coordination.begun_recorder.BegunRecorder.io>`) before ``_lock``, never under
it; a caller's own lock only ever outside both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sparksteward.checkpoint.begun import CheckpointTime, Cut, advanced_watermark, time_of
from sparksteward.checkpoint.coordination.begin_rules import check_begin
from sparksteward.checkpoint.coordination.begun_recorder import BegunRecorder
from sparksteward.checkpoint.coordination.completed import CompletedCheckpoints, check_compatible
from sparksteward.checkpoint.coordination.deleter import FileDeleter
from sparksteward.checkpoint.coordination.peer_paths import check_handle, check_subtask, check_uploads
from sparksteward.checkpoint.coordination.pending import (
    AckResult,
    BeginResult,
    Completion,
    PendingCheckpoint,
    PendingView,
    Readiness,
)
from sparksteward.checkpoint.coordination.seals import MergedFileSeals
from sparksteward.checkpoint.coordination.stats import SubtaskStats
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.filemerging.space import SpaceStats, space_stats
from sparksteward.checkpoint.lease import CallerIsTheOnlyWriter, Fence
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage
from sparksteward.checkpoint.task.transfer import UploadResult
from sparksteward.clock import Clock, SystemClock
from sparksteward.errors import (
    CheckpointError,
    CheckpointOrderError,
)
from sparksteward.state.keygroups import KeyType, validate_parallelism

__all__ = ["BeginResult", "CheckpointCoordinator", "Completion"]

log = logging.getLogger("sparksteward.checkpoint.coordination.coordinator")
_T = TypeVar("_T")

_DELETE_WAIT = 120.0     # how long complete() waits for a delete of a file it references to finish


class CheckpointCoordinator:
    """Pending and completed checkpoints of one state, and the reference counts of its files."""

    def __init__(self, storage: CheckpointStorage, parallelism: int, max_parallelism: int, *,
                 key_type: KeyType | str = KeyType.STRING, num_retained: int = 1,
                 clock: Clock | None = None, merging: MergingOptions | None = None,
                 lease: Fence | None = None, orphan_grace: float = 0.0, background_deletes: bool = False) -> None:
        validate_parallelism(parallelism, max_parallelism)
        self.storage = storage
        #: the declared state variables (``properties.states`` from now on, state/declared.py); None: none
        self.states: dict[str, object] | None = None
        #: the key column every checkpoint from now on records (``properties.key``); None: unknown
        self.key_column: str | None = None
        #: the event-time column and delay (``properties.event_time``, decision 0028); None: no watermark
        self.event_time: dict[str, Any] | None = None
        self._drops_given: dict[int, frozenset[str]] = {}   # checkpoint -> the drops its attempt's tasks were given
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.key_type = KeyType.parse(key_type)
        self.clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._pending: dict[int, PendingCheckpoint] = {}
        self._latest_begun: int | None = None
        self._aborted: set[int] = set()       # aborted ids not begun again by the driver
        self._late: set[str] = set()          # uploads of refused late acks, deleted once nothing is pending
        self.merging = merging or MergingOptions(enabled=False)
        self._seals = MergedFileSeals(storage.state, self.merging)   # FLIP-306
        self.swept: int = 0
        self.lease: Fence = lease or CallerIsTheOnlyWriter()
        self.orphan_grace = float(orphan_grace)
        self._begun_here: set[int] = set()   # ids the driver began in this coordinator's life: a task
                                              # re-begins only those
        # the newest begun checkpoint's time, alignment and FLIP-76 cuts, durable in <root>/_begun;
        # _begun_io orders its writes (taken before _lock, never under it): many cuts go in one write
        self._begun = BegunRecorder(storage, max_parallelism, self._lock, self.lease,
                                    completed=lambda cid: self._done.get(cid))
        self._begun_io = self._begun.io
        # the storage I/O of a deletion runs on the deleter's thread, outside the lock
        self.deleter = FileDeleter(storage, self.lease, self._lock, needed=lambda p: self._done.refs[p] > 0,
                                   held=self._in_flight, background=background_deletes)
        self._done = CompletedCheckpoints(storage, self.deleter, self.lease, num_retained=num_retained,
                                          merging=self.merging)
        with self._lock:   # its subsume queues deletes, which notify the deleter's thread under the lock
            self._recover()

    # --- start -------------------------------------------------------------------------------
    def _recover(self) -> None:
        unreadable = self._done.load(lambda meta: check_compatible(meta, self.max_parallelism, self.key_type))
        self._begun.load()
        self._subsume()
        self._done.control_space()
        if unreadable:
            log.warning("not sweeping orphans of %s: checkpoints %s could not be read", self.storage.state, unreadable)
            return
        self.swept = self.sweep()

    def sweep(self) -> int:
        """Delete the files no retained checkpoint references that are older than ``orphan_grace``
        (orphans of a crashed upload, an abandoned attempt or a cut-short subsumption); return how many.
        Only under a held lease and while nothing is pending (a pending upload is unknown before its ack).
        Listed outside the lock: a file uploaded since is not listed, one completed on since is referenced."""
        if self._pending:
            return 0
        ages = self.storage.file_times()
        with self._lock:
            n = self._done.sweep(ages, self.clock.now(), self.orphan_grace, self._seals.held(),
                                 skip=lambda: bool(self._pending))
        if n:
            log.info("swept %d orphaned files of %s (older than %g s, referenced by no retained checkpoint)",
                     n, self.storage.state, self.orphan_grace)
        return n

    # --- queries -----------------------------------------------------------------------------
    @property
    def last_completed(self) -> int | None:
        """The newest checkpoint completed by this state (not the restored starting point)."""
        with self._lock:
            return self._done.last

    @property
    def num_retained(self) -> int:
        return self._done.num_retained

    def retained(self) -> list[int]:
        """Retained completed checkpoints; ``RESTORED`` (-1) while the restored starting point is kept."""
        with self._lock:
            return sorted(self._done.records)

    @property
    def restored(self) -> CheckpointMetadata | None:
        with self._lock:
            return self._done.get(RESTORED)

    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def latest_retained(self) -> CheckpointMetadata | None:
        """The newest retained record (the restored starting point while it is the only one), or None."""
        with self._lock:
            return self._done.get(max(self._done.records, default=None))

    def completed(self, checkpoint_id: int) -> CheckpointMetadata:
        with self._lock:
            return self._done.record(checkpoint_id)

    def references(self, path: str) -> int:
        with self._lock:
            return self._done.refs[path]

    def claimed(self) -> set[str]:
        """The absolute URLs this state took over with CLAIM and has not deleted yet."""
        with self._lock:
            return set(self._done.claimed)

    def space(self) -> SpaceStats:
        """Physical against live bytes of the retained checkpoints' merged files (computed outside the lock)."""
        with self._lock:
            metas = list(self._done.records.values())
        return space_stats(metas)

    def no_reuse(self) -> set[str]:
        with self._lock:
            return set(self._done.no_reuse)

    def pin(self, checkpoint_id: int) -> CheckpointMetadata:
        """Keep completed checkpoint ``checkpoint_id`` (and its files) until :meth:`unpin`; return it."""
        with self._lock:
            return self._done.pin(checkpoint_id)

    def pin_latest(self) -> tuple[int, CheckpointMetadata] | None:
        """:meth:`pin` the newest completed checkpoint, else the restored one; its id and record (None: neither)."""
        with self._lock:
            latest = self._done.last if self._done.last is not None or RESTORED not in self._done.records else RESTORED
            return None if latest is None else (latest, self._done.pin(latest))

    def unpin(self, checkpoint_id: int) -> None:
        with self._lock:
            self._done.unpin(checkpoint_id)
            self._subsume()

    def declare(self, resolve: Callable[[dict[str, object] | None], dict[str, object] | None]) -> None:
        """The variables are declared again: ``resolve(recorded)`` is :attr:`states` from the next checkpoint on."""
        with self._lock:
            self.states = resolve(self.states)

    def _with_pending(self, checkpoint_id: int, act: Callable[[PendingCheckpoint], _T], otherwise: _T) -> _T:
        """``act(pending)`` on pending ``checkpoint_id`` under the lock; ``otherwise`` if it is not pending."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            return otherwise if pending is None else act(pending)

    def snapshot(self, checkpoint_id: int) -> PendingView | None:
        """A copy of pending checkpoint ``checkpoint_id``'s current attempt (None if not pending)."""
        return self._with_pending(checkpoint_id, lambda p: p.view(self._unsealed(p), self.parallelism), None)

    def readiness(self, checkpoint_id: int, agent_timeout: float,
                  silent: Callable[[set[str]], list[str]]) -> Readiness | None:
        """Whether pending ``checkpoint_id`` can complete, as it decides (:meth:`PendingCheckpoint.readiness`;
        ``silent``: of the agents given, those not heard from for ``agent_timeout``). None when it is not
        pending: :meth:`complete` then returns its record or refuses it."""
        return self._with_pending(checkpoint_id, lambda p: p.readiness(
            self.parallelism, self.storage.state, self._unsealed(p), now=time.monotonic(),
            agent_timeout=agent_timeout, silent=silent), None)

    def _unsealed(self, pending: PendingCheckpoint) -> dict[str, str]:
        """The merged files the current acks of ``pending`` need beyond the size a seal reported
        (path -> the agent that writes it, "" if no ack listed it)."""
        return pending.unsealed_by(self._done.get(pending.base_id), self._done.sizes)

    # --- the protocol ------------------------------------------------------------------------
    def begin(self, checkpoint_id: int, *, by_task: bool = False, query: str | None = None,
              unaligned: bool = False) -> BeginResult:
        """Start (or restart) checkpoint ``checkpoint_id``; return the base its attempts restore.

        ``by_task``: a task asks (the checkpoint is not pending), not the driver; an aborted
        checkpoint is then refused, since only the driver applies a batch again. ``query``: the streaming
        query (Spark's query id) whose batch this is: one state belongs to one query (``begin_rules.py``).
        ``unaligned``: the alignment the caller would run a new checkpoint with (FLIP-76). The first
        begin of a checkpoint records it, with the checkpoint's time, in the begun record
        (:mod:`~sparksteward.checkpoint.begun`) before it returns, so every later attempt and delivery
        (after a driver or agent restart too) gets the same time, alignment and cuts; the result says
        which.
        """
        if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
            raise CheckpointOrderError(f"checkpoint id {checkpoint_id!r} must be an int >= 0")
        with self._begun_io, self._lock:   # _begun_io first: a cut's write of the begun record takes it so
            return self._begin(checkpoint_id, by_task, query, unaligned)

    def _begin(self, checkpoint_id: int, by_task: bool, query: str | None, unaligned: bool) -> BeginResult:
        """:meth:`begin`; the caller holds ``_begun_io``, then ``_lock``."""
        self.lease.check()
        last = self.last_completed
        check_begin(self.storage.state, checkpoint_id, last=last, latest=self._done.get(last), query=query,
                    pending_queries=(p.query for p in self._pending.values()), by_task=by_task,
                    begun_here=checkpoint_id in self._begun_here,
                    aborted=checkpoint_id in self._aborted and checkpoint_id not in self._pending)
        rerun = checkpoint_id == last
        base_id = self._done.newest_before(checkpoint_id)
        if rerun:
            recorded = self._done.records[checkpoint_id].properties.get("base")
            if recorded is not None and recorded not in self._done.records:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} completed already and cannot "
                    f"be re-run: its base checkpoint {recorded} was subsumed when checkpoint "
                    f"{self._latest_begun} began")
            base_id = recorded
        if rerun:   # the completed record holds its time and cuts
            when = time_of(self._done.records[checkpoint_id]) or CheckpointTime.choose(self.clock.now())
        else:
            prev, delay = self._done.get(self._done.last) or self.restored, (self.event_time or {}).get("delay_ms")
            begun = self._begun.begun(checkpoint_id, self.parallelism, unaligned, self.clock.now(),
                                      (time_of(prev), time_of(self.restored)), advanced_watermark(prev, delay))
            when, unaligned = begun.time, begun.unaligned
        self._aborted.discard(checkpoint_id)
        self._begun_here.add(checkpoint_id)
        self._abort_older(checkpoint_id)
        pending = self._pending.get(checkpoint_id)
        if pending is None:
            self._pending[checkpoint_id] = PendingCheckpoint(checkpoint_id, base_id, rerun, query=query, time=when)
        else:  # a new attempt: earlier acks are replaced as the new ones arrive
            pending.new_attempt(query)
        if not by_task and not rerun:   # the record state.begin hands this attempt's tasks lists these drops
            from sparksteward.state.declared import pending_drops  # pyarrow: not when the agent starts

            self._drops_given[checkpoint_id] = pending_drops(self.states)
        if rerun:
            log.info("checkpoint %d of %s completed already: this re-run restores the same base and keeps the "
                     "first result", checkpoint_id, self.storage.state)
        if self._latest_begun is None or checkpoint_id > self._latest_begun:
            self._latest_begun = checkpoint_id
        self._subsume()
        base = self._done.get(base_id)
        return BeginResult(checkpoint_id, base, self._done.known(base), rerun, self._pending[checkpoint_id].attempt,
                           when, unaligned, self.states)

    # --- unaligned cuts (FLIP-76) ----------------------------------------------------------------
    def cut(self, checkpoint_id: int, subtask: int, proposed: Cut | None = None) -> Cut | None:
        """The cut of ``subtask`` in checkpoint ``checkpoint_id`` (``UnalignedCuts``): ``proposed`` is recorded
        if no attempt recorded one; None when neither. Returns once it is durable."""
        return self._begun.cut(checkpoint_id, lambda cuts, completed: cuts.cut(
            checkpoint_id, subtask, self.parallelism, proposed, completed))

    def amend_cut(self, checkpoint_id: int, subtask: int, cut: Cut) -> Cut:
        """``subtask`` could not defer past ``cut`` (its channel state would pass the byte cap): from now
        on it processes everything. Returns the cut that stands, once it is durable."""
        return self._begun.cut(checkpoint_id, lambda cuts, completed: cuts.amend(
            checkpoint_id, subtask, self.parallelism, cut, completed))

    def base(self, checkpoint_id: int) -> BeginResult:
        """The base of pending checkpoint ``checkpoint_id``, without starting a new attempt: what a task
        (a first, retried or speculative one) asks before it restores its subtask."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not pending: call begin first")
            base = self._done.get(pending.base_id)
            return BeginResult(checkpoint_id, base, self._done.known(base), pending.rerun, pending.attempt)

    def open_subtask(self, checkpoint_id: int, subtask: int | None = None, agent: str = "") -> BeginResult:
        """A task opens ``subtask`` of ``checkpoint_id`` on executor agent ``agent``: the base its attempt
        restores (:meth:`base`). A checkpoint that is not pending is begun (:meth:`begin` ``by_task``: a
        second action on a lazy output after commit re-runs it from the same base; an aborted one is
        refused), once, even when every task asks at once. ``agent`` is then expected to ack the subtask
        (:meth:`working_on`)."""
        with self._lock:   # the common case, without waiting for a write of the begun record
            if checkpoint_id in self._pending:
                return self._open(checkpoint_id, subtask, agent)
        with self._begun_io, self._lock:   # lock order: _begun_io first, so never under _lock
            return self._open(checkpoint_id, subtask, agent)

    def _open(self, checkpoint_id: int, subtask: int | None, agent: str) -> BeginResult:
        # the caller holds _lock, and _begun_io too unless checkpoint_id is pending
        pending = checkpoint_id in self._pending
        begun = self.base(checkpoint_id) if pending else self._begin(checkpoint_id, True, None, False)
        opened = self._pending.get(checkpoint_id)
        if subtask is not None and opened is not None:
            opened.opens[subtask] = opened.opens.get(subtask, 0) + 1
        if subtask is not None and agent:
            self.working_on(checkpoint_id, subtask, agent)
        return begun

    def ack(self, checkpoint_id: int, result: UploadResult | SubtaskHandle,
            uploaded: tuple[str, ...] = (), merged: tuple[str, ...] = (), agent: str = "",
            attempt: str | None = None, stats: SubtaskStats | None = None) -> AckResult:
        """Record subtask ``result.handle.subtask``'s handle for a pending checkpoint. ``merged``: the
        physical files its segments went to, which ``agent`` seals later. ``attempt``: the token of the
        attempt the subtask ran in (:class:`BeginResult`); an ack of another attempt is refused like a late
        one. None only from this process (tests, tools). ``stats``: what the subtask reports of its upload
        (a re-run keeps the first result's). The ack clears a failure reported for the same subtask (a
        retry or a copy made it). Returns how the checkpoint took it; a refused ack raises."""
        handle = result.handle if isinstance(result, UploadResult) else result
        uploaded = result.uploaded if isinstance(result, UploadResult) else tuple(uploaded)
        merged = result.merged if isinstance(result, UploadResult) else tuple(merged)
        who = f"ack of subtask {handle.subtask} of checkpoint {checkpoint_id} of state {self.storage.state!r}"
        check_uploads(who, handle, uploaded, merged)   # see peer_paths.py: before anything is recorded
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is not None:   # a late ack is refused below; only its uploads are kept, to delete
                check_handle(who, handle, pending.base_id, self._done.get(pending.base_id), self._done.claimed)
                self._seals.check_writer(who, pending, merged, agent)
            if pending is not None and attempt is not None and attempt != pending.attempt:
                # an ack of a replaced attempt (a driver restart, a new begin): refused
                pending.take_files(uploaded, merged, agent, replaced=True)
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was begun again since this ack's "
                    f"attempt: the ack of subtask {handle.subtask} is refused")
            if pending is None:  # a replaced or aborted attempt: nothing may keep its files
                self._late.update(uploaded, merged)
                self._delete_late()
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not pending in the attempt "
                    f"this ack belongs to (never begun, already completed or aborted, or begun again since): the "
                    f"ack of subtask {handle.subtask} is refused and its uploaded files deleted")
            pending.take_files(uploaded, merged, agent)   # even if refused below: deleted on abort
            check_subtask(handle, self.parallelism, self.max_parallelism)
            self.deleter.note_acked(f.path for f in handle.all_files)   # a queued delete spares them
            self._seals.acked(agent, merged)   # across: appended to until the agent closes it
            return pending.acknowledge(handle, merged, agent, stats)

    # --- seals (FLIP-306, see seals.py) and the tasks at work -------------------------------------
    def seal_wanted(self, checkpoint_id: int) -> str:
        """What an agent holding unsealed files of ``checkpoint_id`` does: ``MergedFileSeals.wanted``."""
        return self._with_pending(checkpoint_id, lambda p: self._seals.wanted(p, self.parallelism), "discard")

    def sealed(self, checkpoint_id: int, files: Mapping[str, int], agent: str = "",
               attempt: str | None = None) -> None:
        """``files`` (merged path -> size) of ``checkpoint_id`` are durable, says ``agent`` (``MergedFileSeals.take``);
        those of a checkpoint no longer pending are deleted once nothing is pending."""
        self._seals.check_paths(files)
        with self._lock:
            if self._seals.take(checkpoint_id, self._pending.get(checkpoint_id), files, agent, attempt):
                self._late.update(files)
                self._delete_late()

    def files_closed(self, agent: str, paths: set[str] | None = None) -> None:
        """``across`` mode: ``agent`` stopped appending to ``paths`` (None: to all, e.g. it went silent): no
        longer pinned by its ack, they are subject to the reference counts again."""
        with self._lock:
            released = self._seals.close(agent, paths)
            if released:
                self._delete_unreferenced(released)

    def attempt(self, checkpoint_id: int) -> str | None:
        """The token of the current attempt of pending ``checkpoint_id`` (None if not pending)."""
        return self._with_pending(checkpoint_id, lambda p: p.attempt, None)

    def fail(self, checkpoint_id: int, attempt: str, who: str, message: str,
             subtask: int | None = None, agent: str = "", others: int = 0) -> str | None:
        """``who`` reports that an upload or a seal of ``checkpoint_id`` failed: commit aborts the
        checkpoint, unless another copy of the subtask may still ack (see
        :meth:`PendingCheckpoint.fatal_failures`; ``others``: copies of the subtask still open or
        uploading on the reporting ``agent``). Returns why the report is ignored (its attempt is
        over, or another copy of the subtask acked), else None."""
        over: str | None = "its attempt is over"
        return self._with_pending(checkpoint_id, lambda p: over if attempt != p.attempt else
                                  p.report_failure(who, message, subtask, agent, others, time.monotonic()), over)

    def working_on(self, checkpoint_id: int, subtask: int, agent: str) -> None:
        """``agent`` opened or uploads ``subtask`` of ``checkpoint_id`` (nothing if it is not pending)."""
        self._with_pending(checkpoint_id, lambda p: p.working_on(subtask, agent, time.monotonic()), None)

    def stage_started(self, checkpoint_id: int) -> float:
        """When the state stage of the current attempt of ``checkpoint_id`` started: the first call's
        monotonic time (now, if it is not pending)."""
        now = time.monotonic()
        return self._with_pending(checkpoint_id, lambda p: p.stage_start(now), now)

    def complete(self, checkpoint_id: int) -> CheckpointMetadata:
        return self.complete_attempt(checkpoint_id).metadata

    def complete_attempt(self, checkpoint_id: int) -> Completion:
        """Complete a fully acked checkpoint (write ``_metadata`` atomically, then subsume); return its
        record and a copy of the attempt it completed (stats, seals, query). :meth:`complete`: the record."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                if checkpoint_id in self._done.records:
                    return Completion(self._done.records[checkpoint_id], None)
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was never begun (or was aborted)")
            unsealed = self._unsealed(pending)
            ready = pending.fully_acknowledged(self.parallelism, self.storage.state, unsealed)
            if ready.reason:
                raise CheckpointError(ready.reason)
            attempt = pending.view(unsealed, self.parallelism)
            if pending.rerun:  # the first result stands; this attempt's extra files go
                meta = self._done.records[checkpoint_id]
                del self._pending[checkpoint_id]
                self._delete_unreferenced(pending.uploaded)
                self._delete_late()
                return Completion(meta, attempt)
            subtasks = tuple(pending.acks[i] for i in range(self.parallelism))
            referenced = {f.path for h in subtasks for f in h.all_files}
            if referenced & self.deleter.in_progress():   # a re-upload of a file being deleted: wait, then look
                if not self.deleter.wait_idle_for(referenced, timeout=_DELETE_WAIT):
                    raise CheckpointError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: files it "
                        f"references are still being deleted after {_DELETE_WAIT:g} s (is the store answering?)")
                return self.complete_attempt(checkpoint_id)   # the lock was released: look at everything again
            if missing_files := self._done.missing(referenced):   # a checkpoint on a missing file cannot be restored
                raise CheckpointError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: it references "
                    f"{missing_files[:5]} ({len(missing_files)} files), which are not in the store (deleted after "
                    f"their upload). Apply the batch again with the same checkpoint_id")
            self.lease.check()
            self._done.sealed(pending.sealed)   # the durable size each segment lies within
            # the declared variables and the drops not yet run by a completed checkpoint's tasks, for every reader
            from sparksteward.state.declared import drops_ran, recorded_form  # pyarrow: not when the agent starts

            states = drops_ran(self.states, self._drops_given.pop(checkpoint_id, ()))
            properties = pending.record_properties(
                referenced, key_column=self.key_column, cuts=self._begun.cuts.to_property(checkpoint_id),
                event_time=self.event_time,
                claimed=self._done.claimed, sizes=self._done.sizes, states=recorded_form(states))
            meta = CheckpointMetadata(
                state=self.storage.state, checkpoint_id=checkpoint_id, parallelism=self.parallelism,
                max_parallelism=self.max_parallelism, key_type=self.key_type,
                subtasks=subtasks, created_at=self.clock.now(), properties=properties)
            self.storage.write_metadata(meta)
            self.states = states
            self._done.add(meta)
            del self._pending[checkpoint_id]
            self._delete_unreferenced(pending.uploaded)  # uploads of replaced attempts
            self._abort_older(checkpoint_id)
            self._subsume()
            self._aborted = {c for c in self._aborted if c > checkpoint_id}
            self._begun.cuts.completed(checkpoint_id)
            self._delete_late()
            self._done.control_space()
            return Completion(meta, attempt)

    def abort(self, checkpoint_id: int) -> int:
        """Drop a pending checkpoint and delete the files only it uploaded; return how many."""
        with self._lock:
            pending = self._pending.pop(checkpoint_id, None)
            if pending is None:
                return 0
            self._aborted.add(checkpoint_id)
            deleted = self._delete_unreferenced(pending.uploaded)
            self._subsume()
            self._delete_late()
            log.info("aborted checkpoint %d of %s; deleted %d files", checkpoint_id, self.storage.state, deleted)
            return deleted

    def rescale(self, parallelism: int) -> int:
        """Change the parallelism of the next checkpoints (their subtasks restore from a base taken at the
        old one, ``rebuild_subtask``); return the previous one. Refused while a checkpoint is pending:
        its acks belong to the old parallelism."""
        with self._lock:
            validate_parallelism(parallelism, self.max_parallelism)
            if self._pending and parallelism != self.parallelism:
                pending = sorted(self._pending)
                raise CheckpointOrderError(
                    f"keyed state {self.storage.state!r} cannot change parallelism {self.parallelism} -> "
                    f"{parallelism} while checkpoints {pending} are pending: commit or abort them first")
            old, self.parallelism = self.parallelism, parallelism
            if old != parallelism:
                self._begun.cuts.clear()   # cuts name subtasks of the old parallelism
                log.info("state %s rescales %d -> %d from its next checkpoint", self.storage.state, old, parallelism)
            return old

    def _abort_older(self, checkpoint_id: int) -> None:
        """Abort the pending checkpoints older than ``checkpoint_id``: no batch goes back to them."""
        for cid in [c for c in self._pending if c < checkpoint_id]:
            pending = self._pending.pop(cid)
            self._aborted.add(cid)
            self._delete_unreferenced(pending.uploaded)
            log.info("checkpoint %d of %s aborted: checkpoint %d began or completed", cid, self.storage.state,
                     checkpoint_id)

    def _delete_late(self) -> None:
        """Delete the uploads of refused late acks once no checkpoint is pending."""
        if self._late and not self._pending:
            late, self._late = self._late, set()
            n = self._delete_unreferenced(late)
            if n:
                log.info("deleted %d files of late acks of %s", n, self.storage.state)

    # --- retention ---------------------------------------------------------------------------
    def _subsume(self) -> None:
        """Retention beyond the newest and the pinned keeps the bases of pending checkpoints, and while
        nothing newer has begun the base of the last completed one (a re-run needs it)."""
        keep = {p.base_id for p in self._pending.values()}
        last = self._done.last
        if last is not None and (self._latest_begun is None or self._latest_begun <= last):
            keep.add(self._done.newest_before(last))
        self._done.subsume({k for k in keep if k is not None}, self._in_flight())

    def _delete_unreferenced(self, paths: set[str] | list[str]) -> int:
        return self._done.delete_unreferenced(paths, self._in_flight())

    def _in_flight(self) -> set[str]:
        """Files a pending ack or an agent's open ``across`` file needs: never deleted."""
        held = {f.path for p in self._pending.values() for h in p.acks.values() for f in h.all_files}
        held.update(self._seals.held())
        return held

    def flush_deletions(self, timeout: float = 60.0) -> bool:
        """Wait (without holding the caller's locks) until the queued deletes are done; False on timeout."""
        return self.deleter.flush(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued deletes (up to ``timeout``) and stop the deleter's thread. Idempotent."""
        self.deleter.close(timeout)

