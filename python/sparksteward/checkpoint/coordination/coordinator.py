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

**Late acks.** A late ack (of a replaced or aborted attempt, after its checkpoint completed or was
aborted) is refused and its uploads are deleted once nothing is pending: an upload of a pending
attempt, not acked yet, may hold the same content (files are named by content), so while one is
pending the deletion waits for it to complete or abort.

**Paths from peers.** An ack may name as uploads only data files (``shared/<checksum>``,
``merged/<32 hex>``) its handle references, and its handle only data files or what its base or a
claimed checkpoint holds; a seal only merged files its agent's acks listed. Anything else is refused
before it is recorded, and deletion reaches only data files and the URLs this state claimed.

**Merged files (FLIP-306).** A subtask's small files are segments of ``merged/<uuid>`` physical
files that its executor agent writes for all the subtasks that ran there. An ack lists them as
*unsealed*; once every subtask has acked, :meth:`seal_wanted` tells the agents to seal (fsync and
upload), and ``complete`` waits for :meth:`sealed` until every segment the acks reference (state and
channel state) lies within a size a seal reported (``across`` files grow across checkpoints, so a
file a retained checkpoint holds is sealed again for what was appended since). The record lists that
durable size of each physical file in ``properties.merged``. A physical file is counted like any
other path: it goes once no retained checkpoint references it. After each completion, space control (``max_space_amplification``) marks
the most wasteful physical files no-reuse: ``known`` leaves their segments out, so the next
checkpoint writes them again, and the old files go with the checkpoints that reference them.
``across``-mode files that an agent still appends to are never deleted while it says they are open.

Thread-safe: one lock around every operation (the agent calls it from connection threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from sparksteward.checkpoint.begun import BegunRecord, CheckpointTime, read_begun, time_of
from sparksteward.checkpoint.coordination.completed import CompletedCheckpoints
from sparksteward.checkpoint.unaligned.coordinator_cuts import UnalignedCuts, translate_cuts
from sparksteward.checkpoint.coordination.deleter import FileDeleter
from sparksteward.checkpoint.lease import CallerIsTheOnlyWriter, Fence
from sparksteward.checkpoint.coordination.pending import AckResult, PendingCheckpoint
from sparksteward.checkpoint.filemerging.file_merger import MergingMode, MergingOptions, SpaceStats, is_merged, space_stats
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.task.subtask_restore import check_max_parallelism
from sparksteward.checkpoint.coordination.stats import SubtaskStats
from sparksteward.checkpoint.storage import DATA_PATH_FORMS, RESTORED, CheckpointStorage, UploadResult, is_data_path
from sparksteward.clock import Clock, SystemClock
from sparksteward.errors import (
    CheckpointError,
    CheckpointOrderError,
    InvalidRecordError,
    StateEncodingError,
)
from sparksteward.state.declared import drops_ran, pending_drops, recorded_form
from sparksteward.state.keygroups import KeyType, key_group_range, validate_parallelism

__all__ = ["BeginResult", "CheckpointCoordinator"]

log = logging.getLogger("sparksteward.checkpoint.coordination.coordinator")
_T = TypeVar("_T")

_DELETE_WAIT = 120.0     # how long complete() waits for a delete of a file it references to finish


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


class CheckpointCoordinator:
    """Pending and completed checkpoints of one state, and the reference counts of its files."""

    def __init__(self, storage: CheckpointStorage, parallelism: int, max_parallelism: int, *,
                 key_type: KeyType | str = KeyType.STRING, num_retained: int = 1,
                 clock: Clock | None = None, merging: MergingOptions | None = None,
                 lease: Fence | None = None, orphan_grace: float = 0.0, background_deletes: bool = False) -> None:
        validate_parallelism(parallelism, max_parallelism)
        self.storage = storage
        #: the declared state variables (``properties.states`` of every checkpoint completed from now on,
        #: see :mod:`sparksteward.state.declared`); None when the state declares none
        self.states: dict[str, object] | None = None
        #: the key column every checkpoint from now on records (``properties.key``); None: unknown
        self.key_column: str | None = None
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
        self._open: dict[str, set[str]] = {}  # agent -> across-mode merged files it still appends to
        self.swept: int = 0
        self.lease: Fence = lease or CallerIsTheOnlyWriter()
        self.orphan_grace = float(orphan_grace)
        self._begun_here: set[int] = set()   # ids the driver began in this coordinator's life (a task may
                                              # re-begin only those: never a pending checkpoint on a fresh one)
        self._cuts = UnalignedCuts(max_parallelism)   # FLIP-76, kept across the attempts of a checkpoint
        # the newest begun checkpoint's time, alignment and cuts, durable in <root>/_begun (checkpoint/begun.py);
        # _begun_io orders its writes (taken before _lock, never under it): many cuts go in one write
        self._begun: BegunRecord | None = None
        self._begun_io = threading.Lock()
        self._cuts_made = 0      # cuts recorded in memory so far, and how many of them are durable
        self._cuts_durable = 0
        # the storage I/O of a deletion runs on the deleter's thread, outside the lock
        self.deleter = FileDeleter(storage, self.lease, self._lock, needed=lambda p: self._done.refs[p] > 0,
                                   held=self._in_flight, background=background_deletes)
        self._done = CompletedCheckpoints(storage, self.deleter, self.lease, num_retained=num_retained,
                                          merging=self.merging)
        with self._lock:   # its subsume queues deletes, which notify the deleter's thread under the lock
            self._recover()

    # --- start -------------------------------------------------------------------------------
    def _recover(self) -> None:
        unreadable = self._done.load(self._check_compatible)
        self._begun = read_begun(self.storage.location)
        self._subsume()
        self._done.control_space()
        if unreadable:
            log.warning("not sweeping orphans of %s: checkpoints %s could not be read", self.storage.state, unreadable)
            return
        self.swept = self.sweep()

    def sweep(self) -> int:
        """Delete the files of this state that no retained checkpoint references and that are older
        than ``orphan_grace`` (orphans of a crashed upload, an abandoned attempt or a subsumption cut
        short); return how many. Only under a held lease, and only while nothing is pending: an
        upload of a pending attempt is not known before its ack. The listing runs outside the lock:
        a file uploaded since is not in it, and one a checkpoint completed on since is referenced."""
        if self._pending:
            return 0
        ages = self.storage.file_times()
        with self._lock:
            try:
                self.lease.check()
            except CheckpointError as exc:
                log.warning("not sweeping orphans of %s: %s", self.storage.state, exc)
                return 0
            if self._pending:
                return 0
            now = self.clock.now()
            orphans = sorted(p for p, t in ages.items() if self._done.refs[p] <= 0 and now - t >= self.orphan_grace
                             and not any(p in held for held in self._open.values()))
            if orphans:
                self.deleter.delete_files(orphans)
            n = len(orphans)
        if n:
            log.info("swept %d orphaned files of %s (older than %g s, referenced by no retained checkpoint)",
                     n, self.storage.state, self.orphan_grace)
        return n

    def _check_compatible(self, meta: CheckpointMetadata) -> None:
        check_max_parallelism(meta, self.max_parallelism)
        if meta.key_type is not self.key_type:
            raise StateEncodingError(
                f"state {meta.state!r} was checkpointed with {meta.key_type.value} keys (checkpoint "
                f"{meta.checkpoint_id}) and cannot continue with {self.key_type.value} keys: cast the key column "
                f"to {meta.key_type.value}, or start a new state")

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

    def completed(self, checkpoint_id: int) -> CheckpointMetadata:
        with self._lock:
            try:
                return self._done.records[checkpoint_id]
            except KeyError:
                raise CheckpointError(f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not a retained "
                                      f"completed checkpoint (retained: {sorted(self._done.records)})") from None

    def references(self, path: str) -> int:
        with self._lock:
            return self._done.refs[path]

    def claimed(self) -> set[str]:
        """The absolute URLs this state took over with CLAIM and has not deleted yet."""
        with self._lock:
            return set(self._done.claimed)

    def pin(self, checkpoint_id: int) -> CheckpointMetadata:
        """Keep completed checkpoint ``checkpoint_id`` (and its files) until :meth:`unpin`; return it."""
        with self._lock:
            meta = self.completed(checkpoint_id)
            self._done.pins[checkpoint_id] += 1
            return meta

    def unpin(self, checkpoint_id: int) -> None:
        with self._lock:
            pins = self._done.pins
            pins[checkpoint_id] -= 1
            if pins[checkpoint_id] <= 0:
                del pins[checkpoint_id]
            self._subsume()

    # --- the protocol ------------------------------------------------------------------------
    def begin(self, checkpoint_id: int, *, by_task: bool = False, query: str | None = None,
              unaligned: bool = False) -> BeginResult:
        """Start (or restart) checkpoint ``checkpoint_id``; return the base its attempts restore.

        ``by_task``: a task asks (the checkpoint is not pending), not the driver; an aborted
        checkpoint is then refused, since only the driver applies a batch again.
        ``query``: the streaming query (Spark's query id) whose batch this is. One state belongs to one
        query: a batch of another query than the one that wrote the latest checkpoint, or than the one
        with a pending checkpoint, is refused.
        ``unaligned``: the alignment the caller would run a new checkpoint with (FLIP-76). The first
        begin of a checkpoint records it, with the checkpoint's time, in the begun record
        (:mod:`~sparksteward.checkpoint.begun`) before it returns, so every later attempt and delivery
        (after a driver or agent restart too) gets the same time, alignment and cuts; the result says
        which.
        """
        if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
            raise CheckpointOrderError(f"checkpoint id {checkpoint_id!r} must be an int >= 0")
        with self._begun_io, self._lock:   # _begun_io first: a cut's write of the begun record takes it so
            self.lease.check()
            last = self.last_completed
            if query is not None:
                self._check_query(checkpoint_id, query)
            if last is not None and checkpoint_id < last:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} is older than its last completed "
                    f"checkpoint {last}: a batch that old cannot be applied again (its base is gone). Restart "
                    f"the query from a Spark checkpoint that is not older than batch {last}")
            if by_task and checkpoint_id not in self._begun_here:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was not begun by this driver agent "
                    f"(it restarted since, or the batch was never applied here): a task cannot start it; apply the "
                    f"batch again with checkpoint_id={checkpoint_id}")
            if by_task and checkpoint_id in self._aborted and checkpoint_id not in self._pending:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was aborted: a task of the "
                    f"abandoned attempt cannot start it again; apply the batch again with "
                    f"checkpoint_id={checkpoint_id}")
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
                when = time_of(self._done.records[checkpoint_id]) or CheckpointTime.choose(self.clock.now(), None)
            else:
                begun = self._begun_record(checkpoint_id, unaligned)
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
                self._drops_given[checkpoint_id] = pending_drops(self.states)
            if rerun:
                log.info("checkpoint %d of %s completed already: this re-run restores the same base and keeps the "
                         "first result", checkpoint_id, self.storage.state)
            if self._latest_begun is None or checkpoint_id > self._latest_begun:
                self._latest_begun = checkpoint_id
            self._subsume()
            base = self._done.get(base_id)
            return BeginResult(checkpoint_id, base, self._done.known(base), rerun, self._pending[checkpoint_id].attempt,
                               when, unaligned)

    def _begun_record(self, checkpoint_id: int, unaligned: bool) -> BegunRecord:
        """The begun record of ``checkpoint_id``: the one an earlier delivery made durable (its cuts
        taken into this coordinator, translated to this parallelism), or a new one, written before
        this returns. A new one's time is the clock's, but never below the time of the previous
        checkpoint or of any checkpoint begun before. The caller holds ``_begun_io`` and the lock."""
        rec = self._begun
        if rec is not None and rec.checkpoint_id == checkpoint_id:
            if rec.parallelism != self.parallelism or self._cuts.to_property(checkpoint_id) is None:
                cuts = translate_cuts(rec.cuts, rec.parallelism, self.parallelism, self.max_parallelism,
                                      f"checkpoint {checkpoint_id} of state {self.storage.state!r}")
                self._cuts.load(checkpoint_id, cuts)
                if rec.parallelism != self.parallelism:
                    rec = rec.with_cuts(cuts, self.parallelism)
                    rec.write(self.storage.location)
                    self._begun = rec
            return rec
        floor = max((t for t in (time_of(self._done.get(self._done.last)), time_of(self.restored),
                                 rec.time if rec is not None else None) if t is not None),
                    key=lambda t: t.processing_ms, default=None)
        rec = BegunRecord(checkpoint_id, self.parallelism, CheckpointTime.choose(self.clock.now(), floor), unaligned)
        rec.write(self.storage.location)   # durable before any task of the checkpoint runs
        self._begun = rec
        return rec

    def _check_query(self, checkpoint_id: int, query: str) -> None:
        """Refuse a batch of ``query`` when the state belongs to another streaming query."""
        latest = self._done.last
        owner = _query_of(self._done.records[latest]) if latest is not None else None
        others = sorted({p.query for p in self._pending.values() if p.query not in (None, query)})
        if owner not in (None, query) or others:
            holder = owner if owner not in (None, query) else others[0]
            where = f"its checkpoint {latest}" if owner not in (None, query) else "a pending checkpoint"
            raise CheckpointOrderError(
                f"batch {checkpoint_id} of streaming query {query} cannot use keyed state {self.storage.state!r}: "
                f"{where} belongs to streaming query {holder}, and one state belongs to one query (a batch "
                f"id of another query means other rows, so taking it for a re-run would lose them). Give this "
                f"query its own state name; to start it from this state's data, take a savepoint "
                f"(ks.savepoint(url)) and open a new state with restore_from=url")

    # --- unaligned cuts (FLIP-76) ----------------------------------------------------------------
    def cut(self, checkpoint_id: int, subtask: int, proposed: int | None = None) -> int | None:
        """The cut of ``subtask`` in checkpoint ``checkpoint_id`` (see :mod:`~sparksteward.checkpoint.unaligned.coordinator_cuts`):
        ``proposed`` is recorded if no attempt recorded one; None when neither."""
        return self._durable_cut(checkpoint_id, lambda completed: self._cuts.cut(
            checkpoint_id, subtask, self.parallelism, proposed, completed))

    def amend_cut(self, checkpoint_id: int, subtask: int, cut: int) -> int:
        """``subtask`` could not defer past ``cut`` (its channel state would pass the byte cap): from now
        on it processes everything. Returns the cut that stands."""
        return self._durable_cut(checkpoint_id, lambda completed: self._cuts.amend(
            checkpoint_id, subtask, self.parallelism, cut, completed))

    def _durable_cut(self, checkpoint_id: int, decide: Callable[[CheckpointMetadata | None], _T]) -> _T:
        """``decide(completed)`` (under the lock) the cut that stands, then return it once every cut
        recorded so far is durable (an earlier write may have failed); a completed checkpoint's cuts
        (a re-run) are in its record already."""
        with self._lock:
            completed = self._done.get(checkpoint_id)
            stands = decide(completed)
            if self._cuts.recorded_new:
                self._cuts_made += 1
            made = self._cuts_made if completed is None and self._cuts_made > self._cuts_durable else 0
        if made:
            self._make_cuts_durable(checkpoint_id, made)
        return stands

    def _make_cuts_durable(self, checkpoint_id: int, made: int) -> None:
        """Return once the first ``made`` cuts recorded are in the begun record (one write takes every
        cut recorded by then: the subtasks that wait meanwhile need no write of their own). A task
        goes on only after this, so no output past a cut reaches a sink before the cut is durable."""
        with self._begun_io:
            if self._cuts_durable >= made:
                return
            with self._lock:
                rec, upto = self._begun, self._cuts_made
                if rec is None or rec.checkpoint_id != checkpoint_id:
                    raise CheckpointOrderError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} is no longer the newest begun "
                        f"(checkpoint {rec.checkpoint_id if rec else None} is): its cut is not recorded")
                self.lease.check()
                rec = rec.with_cuts(self._cuts.of(checkpoint_id))
            rec.write(self.storage.location)   # outside the lock: acks and heartbeats go on meanwhile
            with self._lock:
                self._begun = rec
                self._cuts_durable = upto

    def base(self, checkpoint_id: int) -> BeginResult:
        """The base of pending checkpoint ``checkpoint_id``, without starting a new attempt.

        What a task (a first, retried or speculative one) asks before it restores its subtask; only
        the driver's ``begin`` starts an attempt.
        """
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not pending: call begin first")
            base = self._done.get(pending.base_id)
            return BeginResult(checkpoint_id, base, self._done.known(base), pending.rerun, pending.attempt)

    def ack(self, checkpoint_id: int, result: UploadResult | SubtaskHandle,
            uploaded: tuple[str, ...] = (), merged: tuple[str, ...] = (), agent: str = "",
            attempt: str | None = None, stats: SubtaskStats | None = None) -> AckResult:
        """Record subtask ``result.handle.subtask``'s handle for a pending checkpoint.

        ``merged``: the physical files its segments went to, which ``agent`` seals later.
        ``attempt``: the token of the attempt the subtask ran in (:class:`BeginResult`); an ack of
        another attempt is refused like a late one. None only from this process (tests, tools).
        ``stats``: what the subtask reports of its upload (a re-run keeps the first result's). The
        ack clears a failure reported for the same subtask (a retry or a copy made it). Returns how
        the checkpoint took it; a refused ack raises.
        """
        handle = result.handle if isinstance(result, UploadResult) else result
        uploaded = result.uploaded if isinstance(result, UploadResult) else tuple(uploaded)
        merged = result.merged if isinstance(result, UploadResult) else tuple(merged)
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            self._check_ack_paths(checkpoint_id, pending, handle, uploaded, merged, agent)
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
            if not 0 <= handle.subtask < self.parallelism:
                raise InvalidRecordError(f"ack for subtask {handle.subtask} of a state with parallelism "
                                         f"{self.parallelism}")
            expected = key_group_range(self.max_parallelism, self.parallelism, handle.subtask)
            if handle.key_groups != expected:
                raise InvalidRecordError(
                    f"subtask {handle.subtask} acked key groups {handle.key_groups}, expected {expected}")
            self.deleter.note_acked(f.path for f in handle.all_files)   # a queued delete spares them
            if merged and self.merging.mode is MergingMode.ACROSS:   # appended to until the agent closes it
                self._open.setdefault(agent, set()).update(merged)
            return pending.acknowledge(handle, merged, agent, stats)

    def _check_ack_paths(self, checkpoint_id: int, pending: PendingCheckpoint | None, handle: SubtaskHandle,
                         uploaded: tuple[str, ...], merged: tuple[str, ...], agent: str) -> None:
        """Refuse an ack naming a path it has no business with, before anything of it is recorded
        (what an ack records is deleted on abort): its uploads and merged files are data files its
        handle references, the handle references data files or what its base or a claimed
        checkpoint holds, and no other agent writes its merged files."""
        who = f"ack of subtask {handle.subtask} of checkpoint {checkpoint_id} of state {self.storage.state!r}"
        bad = [p for p in merged if not is_merged(p)]
        if bad:
            raise InvalidRecordError(f"{who}: {bad} are not merged/ paths (merged/<32 hex>)")
        referenced = {f.path for f in handle.all_files}
        bad = [p for p in (*uploaded, *merged) if not is_data_path(p) or p not in referenced]
        if bad:
            raise InvalidRecordError(
                f"{who}: uploaded files {bad} are not data files its handle references; an upload is a "
                f"file of the handle named {DATA_PATH_FORMS}")
        if pending is None:
            return   # refused as late by the caller; only its uploads (checked above) are kept, to delete
        base = self._done.get(pending.base_id)
        held = base.physical_paths() if base is not None else set()
        bad = sorted(p for p in referenced if not is_data_path(p) and p not in held and p not in self._done.claimed)
        if bad:
            raise InvalidRecordError(
                f"{who}: its handle references {bad}, which are neither data files ({DATA_PATH_FORMS}) nor "
                f"files its base checkpoint {pending.base_id} or a claimed checkpoint holds")
        taken = sorted(set(pending.foreign(merged, agent))
                       | {p for p in merged if any(p in files for a, files in self._open.items() if a != agent)})
        if taken:
            raise InvalidRecordError(f"{who}: merged files {taken} are written by another executor agent, "
                                     f"not {agent!r}")

    def seal_wanted(self, checkpoint_id: int) -> str:
        """What an agent holding unsealed files of ``checkpoint_id`` should do: ``seal`` (every subtask
        acked), ``wait``, or ``discard`` (the checkpoint is not pending, or is a re-run whose first
        result stands)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None or pending.rerun:
                return "discard"
            return "seal" if len(pending.acks) >= self.parallelism else "wait"

    def sealed(self, checkpoint_id: int, files: Mapping[str, int], agent: str = "",
               attempt: str | None = None) -> None:
        """``files`` (merged path -> size) of ``checkpoint_id`` are durable in the store, says
        ``agent``: only files its acks of a pending checkpoint listed are taken. A seal of another
        ``attempt`` than the pending one (it was asked for before an abort or a coordinator restart)
        records nothing and deletes nothing: the current attempt's own seal follows."""
        bad = [p for p in files if not is_merged(p)]
        if bad:
            raise InvalidRecordError(f"sealed files {bad} are not merged/ paths (merged/<32 hex>)")
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is not None and attempt is not None and attempt != pending.attempt:
                log.info("seal of %d merged files of checkpoint %d of %s by %r ignored: it belongs to a "
                         "replaced attempt", len(files), checkpoint_id, self.storage.state, agent)
                return
            foreign = pending.foreign(files, agent) if pending is not None else []
            if foreign:
                raise InvalidRecordError(
                    f"seal of checkpoint {checkpoint_id} of state {self.storage.state!r} by executor agent "
                    f"{agent!r}: {foreign} are not merged files its acks listed; an agent seals only the "
                    f"files it wrote")
            if pending is None or pending.rerun:   # too late: nothing will reference them
                if pending is not None:
                    pending.uploaded.update(files)
                else:
                    self._late.update(files)
                    self._delete_late()
                return
            pending.seal(files, agent)

    def attempt(self, checkpoint_id: int) -> str | None:
        """The token of the current attempt of pending ``checkpoint_id`` (None if not pending)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            return pending.attempt if pending is not None else None

    def acked(self, checkpoint_id: int) -> set[int]:
        """The subtasks whose ack pending checkpoint ``checkpoint_id`` holds (empty if not pending)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            return set(pending.acks) if pending is not None else set()

    def sealed_files(self, checkpoint_id: int) -> dict[str, int]:
        """The merged files agents sealed so far for pending checkpoint ``checkpoint_id`` (path -> size)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            return dict(pending.sealed) if pending is not None else {}

    def unsealed(self, checkpoint_id: int) -> dict[str, str]:
        """The merged files the current acks of ``checkpoint_id`` need beyond the size a seal reported
        (path -> the agent that writes it, "" if no ack listed it)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                return {}
            return {p: pending.writers.get(p) or pending.unsealed.get(p, "") for p in pending.not_durable(self._done.get(pending.base_id), self._done.sizes)}

    def files_closed(self, agent: str, paths: set[str] | None = None) -> None:
        """``across`` mode: ``agent`` stopped appending to ``paths`` (None: to all, e.g. it went
        silent), so they are subject to the reference counts again. Until then an ack pins them."""
        with self._lock:
            held = self._open.get(agent, set())
            released = set(held) if paths is None else held & set(paths)
            held -= released
            if not held:
                self._open.pop(agent, None)
            if released:
                self._delete_unreferenced(released)

    def space(self) -> SpaceStats:
        """Physical against live bytes of the retained checkpoints' merged files (computed outside the
        lock: the metrics poll it while acks arrive)."""
        with self._lock:
            metas = list(self._done.records.values())
        return space_stats(metas)

    def no_reuse(self) -> set[str]:
        with self._lock:
            return set(self._done.no_reuse)

    def waiting_for(self, checkpoint_id: int) -> str | None:
        """What pending checkpoint ``checkpoint_id`` waits for before :meth:`complete` can write its
        record (acks of every subtask, then seals of the merged files they need), as the sentence
        ``complete`` would raise; None when it is fully acknowledged (or not pending: ``complete``
        then returns its record or refuses it)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                return None
            missing = pending.missing(self.parallelism)
            if missing:
                return (f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: subtasks "
                        f"{missing} of {self.parallelism} have not acked (their task failed or is still uploading)")
            unsealed = self.unsealed(checkpoint_id)
            if unsealed and not pending.rerun:
                return (f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: "
                        f"{len(unsealed)} merged files are not sealed yet by executor agents "
                        f"{sorted(set(unsealed.values()))}")
            return None

    def pending_checkpoint(self, checkpoint_id: int) -> PendingCheckpoint | None:
        """The pending checkpoint ``checkpoint_id`` itself (its stats, seals and failures are read
        by the caller, which holds the state's lock, as every caller of a mutating method does)."""
        with self._lock:
            return self._pending.get(checkpoint_id)

    def fail(self, checkpoint_id: int, attempt: str, who: str, message: str,
             subtask: int | None = None, agent: str = "", others: int = 0) -> str | None:
        """``who`` reports that an upload or a seal of ``checkpoint_id`` failed: commit aborts the
        checkpoint, unless another copy of the subtask may still ack (see
        :meth:`PendingCheckpoint.fatal_failures`; ``others``: copies of the subtask still open or
        uploading on the reporting ``agent``). Returns why the report is ignored (its attempt is
        over, or another copy of the subtask acked), else None."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None or attempt != pending.attempt:
                return "its attempt is over"
            if subtask is not None and subtask in pending.acks:
                return "another copy of it acked"
            pending.failures[who] = f"{who}: {message}"
            if subtask is not None:
                pending.failed[subtask] = (agent, max(0, int(others)), time.monotonic())
                pending.copies.get(subtask, {}).pop(agent, None)   # its word from before the failure
            return None

    def fatal_failures(self, checkpoint_id: int, agent_timeout: float) -> dict[str, str]:
        """The failures reported for pending ``checkpoint_id`` that doom its attempt (who -> what)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            return {} if pending is None else pending.fatal_failures(time.monotonic(), agent_timeout)

    def working_on(self, checkpoint_id: int, subtask: int, agent: str) -> None:
        """``agent`` opened or uploads ``subtask`` of ``checkpoint_id`` (nothing if it is not pending)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is not None:
                pending.working[subtask] = agent
                pending.copies.setdefault(subtask, {})[agent] = time.monotonic()

    def stage_started(self, checkpoint_id: int) -> float:
        """When the state stage of the current attempt of ``checkpoint_id`` started: the first call's
        monotonic time (now, if it is not pending)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                return time.monotonic()
            if pending.stage_started is None:
                pending.stage_started = time.monotonic()
            return pending.stage_started

    def complete(self, checkpoint_id: int) -> CheckpointMetadata:
        """Complete a fully acked checkpoint: write ``_metadata`` atomically, then subsume."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                if checkpoint_id in self._done.records:
                    return self._done.records[checkpoint_id]
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was never begun (or was aborted)")
            waiting = self.waiting_for(checkpoint_id)
            if waiting is not None:
                raise CheckpointError(waiting)
            if pending.rerun:  # the first result stands; this attempt's extra files go
                meta = self._done.records[checkpoint_id]
                del self._pending[checkpoint_id]
                self._delete_unreferenced(pending.uploaded)
                self._delete_late()
                return meta
            subtasks = tuple(pending.acks[i] for i in range(self.parallelism))
            referenced = {f.path for h in subtasks for f in h.all_files}
            if referenced & self.deleter.in_progress():   # a re-upload of a file being deleted: wait, then look
                if not self.deleter.wait_idle_for(referenced, timeout=_DELETE_WAIT):
                    raise CheckpointError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: files it "
                        f"references are still being deleted after {_DELETE_WAIT:g} s (is the store answering?)")
                return self.complete(checkpoint_id)   # the lock was released: look at everything again
            # every file no retained checkpoint holds yet must be in the store before a record names it:
            # whoever deleted it (this state's deleter after a lost attempt's late ack, a tool, an
            # operator), a checkpoint on a missing file cannot be restored. One check per new file;
            # the files of retained checkpoints were checked when those completed
            once_deleted = self.deleter.deleted_among(referenced)
            new = {p for p in referenced if self._done.refs[p] <= 0 and "://" not in p} | set(once_deleted)
            missing_files = self.storage.missing(new)
            for p in once_deleted:
                if p not in missing_files:
                    self.deleter.seen(p)
            if missing_files:
                raise CheckpointError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: it references "
                    f"{missing_files[:5]} ({len(missing_files)} files), which are not in the store (deleted after "
                    f"their upload). Apply the batch again with the same checkpoint_id")
            self.lease.check()
            properties: dict[str, object] = {"base": pending.base_id}
            if self.key_column:
                properties["key"] = self.key_column
            if pending.time is not None:
                properties["time"] = pending.time.to_json()
            if pending.query is not None:
                properties["query"] = pending.query
            cuts = self._cuts.to_property(checkpoint_id)
            if cuts:
                properties["cuts"] = cuts
            claimed = sorted(referenced & self._done.claimed)
            if claimed:
                properties["claimed"] = claimed
            self._done.sealed(pending.sealed)   # the durable size each segment lies within
            merged = sorted(p for p in referenced if is_merged(p))
            if merged:
                properties["merged"] = {p: self._done.sizes.get(p, 0) for p in merged}
            # the declared variables and the drops not yet run by a completed checkpoint's tasks, for every reader
            states = drops_ran(self.states, self._drops_given.pop(checkpoint_id, ()))
            recorded = recorded_form(states)
            if recorded:
                properties["states"] = recorded
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
            self._cuts.completed(checkpoint_id)
            self._delete_late()
            self._done.control_space()
            return meta

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
        """Change the parallelism of the next checkpoints; return the previous one.

        The next checkpoint's subtasks restore from a base taken at the old parallelism
        (``rebuild_subtask``). Refused while a checkpoint is pending: its acks belong to the old
        parallelism.
        """
        with self._lock:
            validate_parallelism(parallelism, self.max_parallelism)
            if self._pending and parallelism != self.parallelism:
                pending = sorted(self._pending)
                raise CheckpointOrderError(
                    f"keyed state {self.storage.state!r} cannot change parallelism {self.parallelism} -> "
                    f"{parallelism} while checkpoints {pending} are pending: commit or abort them first")
            old, self.parallelism = self.parallelism, parallelism
            if old != parallelism:
                self._cuts.clear()   # cuts name subtasks of the old parallelism
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
    def _protected(self) -> set[int]:
        """What retention keeps beyond the newest and the pinned: the bases of pending checkpoints,
        and while nothing newer has begun the base of the last completed one (a re-run needs it)."""
        keep = {p.base_id for p in self._pending.values() if p.base_id is not None}
        last = self.last_completed
        if last is not None and (self._latest_begun is None or self._latest_begun <= last):
            base = self._done.newest_before(last)
            if base is not None:
                keep.add(base)
        return keep

    def _subsume(self) -> None:
        self._done.subsume(self._protected(), self._in_flight())

    def _delete_unreferenced(self, paths: set[str] | list[str]) -> int:
        return self._done.delete_unreferenced(paths, self._in_flight())

    def _in_flight(self) -> set[str]:
        """Files a pending ack or an agent's open ``across`` file needs: never deleted."""
        held = {f.path for p in self._pending.values() for h in p.acks.values() for f in h.all_files}
        held.update(*self._open.values())
        return held

    def flush_deletions(self, timeout: float = 60.0) -> bool:
        """Wait (without holding the caller's locks) until the queued deletes are done; False on timeout."""
        return self.deleter.flush(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued deletes (up to ``timeout``) and stop the deleter's thread. Idempotent."""
        self.deleter.close(timeout)


def _query_of(meta: CheckpointMetadata) -> str | None:
    query = meta.properties.get("query")
    return query if isinstance(query, str) else None
