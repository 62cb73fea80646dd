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

**Files.** The coordinator counts references to shared files from retained checkpoints. Subsuming a
checkpoint deletes its ``_metadata`` first and then the files whose count reached zero, so a crash in
between leaves orphans, never a record pointing at deleted files. On start it rebuilds the counts
from the retained ``_metadata`` files and sweeps every shared file none of them references (orphans
of a crashed upload or subsumption), unless a record could not be read (then nothing is swept, so
the files of a newer version's checkpoint are never touched).

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

**Claimed files.** Absolute-URL files come from a CLAIMed checkpoint of another state
(``restored/_metadata`` with ``claim_mode: claim``); this state owns exactly the files that record
lists. Every checkpoint that still references some of them records them in its ``claimed`` property,
so ownership survives the subsumption of ``restored/`` and a restart. When the restored record is
subsumed, the source's ``_metadata`` it claimed is deleted (a record never points at deleted files);
when the last retained checkpoint referencing a claimed file is subsumed, the file is deleted. Any
other absolute URL is never deleted here. A crash between the two leaves claimed files behind (they
are outside this state's directory, so the start-up sweep does not see them).

Thread-safe: one lock around every operation (the agent calls it from connection threads).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from sparksteward.checkpoint.lease import CallerIsTheOnlyWriter, Fence
from sparksteward.checkpoint.pending import PendingCheckpoint
from sparksteward.checkpoint.merging import MergingMode, MergingOptions, SpaceStats, choose_no_reuse, is_merged, physical_sizes, space_stats
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.rescale import check_max_parallelism
from sparksteward.checkpoint.stats import SubtaskStats
from sparksteward.checkpoint.storage import DATA_PATH_FORMS, RESTORED, CheckpointStorage, UploadResult, is_data_path
from sparksteward.clock import Clock, SystemClock
from sparksteward.errors import (
    CheckpointError,
    CheckpointOrderError,
    InvalidRecordError,
    StateEncodingError,
    StewardError,
)
from sparksteward.state.keygroups import KeyType, key_group_range, validate_parallelism

__all__ = ["BeginResult", "CheckpointCoordinator"]

log = logging.getLogger("sparksteward.checkpoint.coordinator")

_DELETE_WAIT = 120.0     # how long complete() waits for a delete of a file it references to finish
_MAX_DELETED = 100_000   # deleted paths remembered, so that complete() refuses a record naming one


@dataclass(frozen=True, slots=True)
class BeginResult:
    """What every attempt of checkpoint ``checkpoint_id`` starts from."""

    checkpoint_id: int
    base: CheckpointMetadata | None       # None: start from an empty state
    known: Mapping[str, tuple[str, int]]  # checksum -> (path, offset) of every file the base holds that
                                          # the next checkpoint may reuse (space control leaves some out)
    rerun: bool                           # True: checkpoint_id already completed (a re-run)
    attempt: str = ""                     # this attempt's token: acks and failures must carry it


@dataclass
class _DeleteJob:
    """A delete for the deleter thread: a subsumed checkpoint's record (and the source record a CLAIM
    restore took over), or data files, which wait for the record job ``after`` and stay if it failed."""

    files: list[str] = field(default_factory=list)
    checkpoint_id: int | None = None
    record: CheckpointMetadata | None = None
    after: int | None = None
    seq: int = 0


class CheckpointCoordinator:
    """Pending and completed checkpoints of one state, and the reference counts of its files."""

    def __init__(self, storage: CheckpointStorage, parallelism: int, max_parallelism: int, *,
                 key_type: KeyType | str = KeyType.STRING, num_retained: int = 1,
                 clock: Clock | None = None, merging: MergingOptions | None = None,
                 lease: Fence | None = None, orphan_grace: float = 0.0, background_deletes: bool = False) -> None:
        validate_parallelism(parallelism, max_parallelism)
        if isinstance(num_retained, bool) or not isinstance(num_retained, int) or num_retained < 1:
            raise CheckpointError(f"num_retained={num_retained!r} must be an int >= 1")
        self.storage = storage
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.key_type = KeyType.parse(key_type)
        self.num_retained = num_retained
        self.clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._completed: dict[int, CheckpointMetadata] = {}
        self._pending: dict[int, PendingCheckpoint] = {}
        self._refs: Counter[str] = Counter()
        self._latest_begun: int | None = None
        self._claimed: set[str] = set()   # absolute URLs this state owns (CLAIM)
        self._pins: Counter[int] = Counter()  # checkpoints a savepoint is copying
        self._aborted: set[int] = set()       # aborted ids not begun again by the driver
        self._late: set[str] = set()          # uploads of refused late acks, deleted once nothing is pending
        self.merging = merging or MergingOptions(enabled=False)
        self._sizes: dict[str, int] = {}      # merged physical path -> size (from records and seals)
        self._no_reuse: set[str] = set()      # merged files whose live segments the next checkpoint rewrites
        self._open: dict[str, set[str]] = {}  # agent -> across-mode merged files it still appends to
        self.swept: int = 0
        self.lease: Fence = lease or CallerIsTheOnlyWriter()
        self.orphan_grace = float(orphan_grace)
        self._begun_here: set[int] = set()   # ids the driver began in this coordinator's life (a task may
                                              # re-begin only those: never a pending checkpoint on a fresh one)
        self._cuts: dict[int, dict[int, int]] = {}   # checkpoint -> subtask -> its cut (FLIP-76), kept across
                                                      # the attempts of that checkpoint until a newer completes
        self._deleted: dict[str, None] = {}   # files this coordinator deleted, not seen again since
                                              # (oldest first, at most _MAX_DELETED)
        # background deletes: the storage I/O of a deletion runs on a thread of its own, outside the lock
        self.background_deletes = background_deletes
        self._jobs: collections.deque[_DeleteJob] = collections.deque()   # queued deletes, in order
        self._failed_records: set[int] = set()   # record jobs that failed: the files after them stay
        self._job_seq = 0
        self._deleting: set[str] = set()      # data files being deleted now
        self._busy = False                    # the deleter thread is working on a job
        self._acked_since: set[str] = set()   # files acks referenced while the deleter works: they stay
        self._deletions = threading.Condition(self._lock)
        self._deleter: threading.Thread | None = None
        self._closing = False
        self._recover()

    # --- start -------------------------------------------------------------------------------
    def _recover(self) -> None:
        unreadable = []
        ids = self.storage.checkpoint_ids()
        if self.storage.has_restored():  # the restore_from starting point, kept as checkpoint RESTORED (-1)
            ids.insert(0, RESTORED)
        for cid in ids:
            try:
                meta = self.storage.read_metadata(cid)
            except StewardError as exc:
                log.warning("checkpoint %d of %s is unreadable, keeping its files: %s", cid, self.storage.state, exc)
                unreadable.append(cid)
                continue
            self._check_compatible(meta)
            self._completed[cid] = meta
            self._refs.update(meta.physical_paths())
            self._claimed.update(_claimed_by(meta))
            self._sizes.update(physical_sizes([meta]))
        self._subsume()
        self._control_space()
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
            orphans = sorted(p for p, t in ages.items() if self._refs[p] <= 0 and now - t >= self.orphan_grace
                             and not any(p in held for held in self._open.values()))
            self._remember_deleted(orphans)
            if orphans:
                self._enqueue(_DeleteJob(files=orphans))
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
            return max((c for c in self._completed if c != RESTORED), default=None)

    def retained(self) -> list[int]:
        """Retained completed checkpoints; ``RESTORED`` (-1) while the restored starting point is kept."""
        with self._lock:
            return sorted(self._completed)

    @property
    def restored(self) -> CheckpointMetadata | None:
        with self._lock:
            return self._completed.get(RESTORED)

    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def completed(self, checkpoint_id: int) -> CheckpointMetadata:
        with self._lock:
            try:
                return self._completed[checkpoint_id]
            except KeyError:
                raise CheckpointError(f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not a "
                                      f"retained completed checkpoint (retained: {sorted(self._completed)})") from None

    def references(self, path: str) -> int:
        with self._lock:
            return self._refs[path]

    def claimed(self) -> set[str]:
        """The absolute URLs this state took over with CLAIM and has not deleted yet."""
        with self._lock:
            return set(self._claimed)

    def pin(self, checkpoint_id: int) -> CheckpointMetadata:
        """Keep completed checkpoint ``checkpoint_id`` (and its files) until :meth:`unpin`; return it."""
        with self._lock:
            meta = self.completed(checkpoint_id)
            self._pins[checkpoint_id] += 1
            return meta

    def unpin(self, checkpoint_id: int) -> None:
        with self._lock:
            self._pins[checkpoint_id] -= 1
            if self._pins[checkpoint_id] <= 0:
                del self._pins[checkpoint_id]
            self._subsume()

    # --- the protocol ------------------------------------------------------------------------
    def begin(self, checkpoint_id: int, *, by_task: bool = False, query: str | None = None) -> BeginResult:
        """Start (or restart) checkpoint ``checkpoint_id``; return the base its attempts restore.

        ``by_task``: a task asks (the checkpoint is not pending), not the driver; an aborted
        checkpoint is then refused, since only the driver applies a batch again.
        ``query``: the streaming query (Spark's query id) whose batch this is. One state belongs to one
        query: a batch of another query than the one that wrote the latest checkpoint, or than the one
        with a pending checkpoint, is refused.
        """
        if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
            raise CheckpointOrderError(f"checkpoint id {checkpoint_id!r} must be an int >= 0")
        with self._lock:
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
            base_id = max((c for c in self._completed if c < checkpoint_id), default=None)
            if rerun:
                recorded = self._completed[checkpoint_id].properties.get("base")
                if recorded is not None and recorded not in self._completed:
                    raise CheckpointOrderError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} completed already and cannot "
                        f"be re-run: its base checkpoint {recorded} was subsumed when checkpoint "
                        f"{self._latest_begun} began")
                base_id = recorded
            self._aborted.discard(checkpoint_id)
            self._begun_here.add(checkpoint_id)
            self._abort_older(checkpoint_id)
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                self._pending[checkpoint_id] = PendingCheckpoint(checkpoint_id, base_id, rerun, query=query)
            else:  # a new attempt: earlier acks are replaced as the new ones arrive
                pending.new_attempt(query)
            if rerun:
                log.info("checkpoint %d of %s completed already: this re-run restores the same base and keeps the "
                         "first result", checkpoint_id, self.storage.state)
            if self._latest_begun is None or checkpoint_id > self._latest_begun:
                self._latest_begun = checkpoint_id
            self._subsume()
            base = self._completed.get(base_id) if base_id is not None else None
            return BeginResult(checkpoint_id, base, self._known(base), rerun, self._pending[checkpoint_id].attempt)

    def _check_query(self, checkpoint_id: int, query: str) -> None:
        """Refuse a batch of ``query`` when the state belongs to another streaming query."""
        latest = max((c for c in self._completed if c != RESTORED), default=None)
        owner = _query_of(self._completed[latest]) if latest is not None else None
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
        """The cut of ``subtask`` in checkpoint ``checkpoint_id``: the first key group whose new input
        it defers (the end of its key-group range: nothing deferred). The first attempt to propose one
        records it; every later attempt, a re-run of the completed checkpoint included, gets the same.
        None when nothing is recorded and nothing is proposed."""
        with self._lock:
            done = self._completed.get(checkpoint_id)
            if done is not None:   # a re-run keeps the first result: no cut recorded means none was made
                return _cuts_of(done).get(subtask, key_group_range(self.max_parallelism, done.parallelism,
                                                                   subtask).stop)
            cuts = self._cuts.setdefault(checkpoint_id, {})
            if proposed is not None and subtask not in cuts:
                expected = key_group_range(self.max_parallelism, self.parallelism, subtask)
                if not expected.start <= proposed <= expected.stop:
                    raise InvalidRecordError(f"cut {proposed} of subtask {subtask} lies outside its key groups "
                                             f"{expected}")
                cuts[subtask] = proposed
            return cuts.get(subtask)

    def amend_cut(self, checkpoint_id: int, subtask: int, cut: int) -> int:
        """``subtask`` could not defer past ``cut`` (its channel state would pass the byte cap, which
        every attempt at that cut finds alike): from now on it processes everything. Returns the cut
        that stands."""
        with self._lock:
            recorded = self.cut(checkpoint_id, subtask)
            stop = key_group_range(self.max_parallelism, self.parallelism, subtask).stop
            if recorded == cut and checkpoint_id not in self._completed:
                self._cuts[checkpoint_id][subtask] = stop
                return stop
            return recorded if recorded is not None else stop

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
            base = self._completed.get(pending.base_id) if pending.base_id is not None else None
            return BeginResult(checkpoint_id, base, self._known(base), pending.rerun, pending.attempt)

    def _known(self, base: CheckpointMetadata | None) -> dict[str, tuple[str, int]]:
        if base is None:
            return {}
        return {f.checksum: (f.path, f.offset) for f in base.files() if f.path not in self._no_reuse}

    def ack(self, checkpoint_id: int, result: UploadResult | SubtaskHandle,
            uploaded: tuple[str, ...] = (), merged: tuple[str, ...] = (), agent: str = "",
            attempt: str | None = None, stats: SubtaskStats | None = None) -> None:
        """Record subtask ``result.handle.subtask``'s handle for a pending checkpoint.

        ``merged``: the physical files its segments went to, which ``agent`` seals later.
        ``attempt``: the token of the attempt the subtask ran in (:class:`BeginResult`); an ack of
        another attempt is refused like a late one. None only from this process (tests, tools).
        ``stats``: what the subtask reports of its upload (a re-run keeps the first result's). The
        ack clears a failure reported for the same subtask (a retry or a copy made it).
        """
        handle = result.handle if isinstance(result, UploadResult) else result
        uploaded = result.uploaded if isinstance(result, UploadResult) else tuple(uploaded)
        merged = result.merged if isinstance(result, UploadResult) else tuple(merged)
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            self._check_ack_paths(checkpoint_id, pending, handle, uploaded, merged, agent)
            uploaded = (*uploaded, *merged)
            if pending is not None and attempt is not None and attempt != pending.attempt:
                # an ack of a replaced attempt (a driver restart, a new begin): refused. Its files go
                # with this checkpoint's end unless referenced, and its agent still seals the merged
                # files it shares with the current attempt's segments
                pending.uploaded.update(uploaded)
                for p in merged:
                    pending.writers.setdefault(p, agent)
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was begun again since this ack's "
                    f"attempt: the ack of subtask {handle.subtask} is refused")
            if pending is None:  # a replaced or aborted attempt: nothing may keep its files
                self._late.update(uploaded)
                self._delete_late()
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not pending in the attempt "
                    f"this ack belongs to (never begun, already completed or aborted, or begun again since): the "
                    f"ack of subtask {handle.subtask} is refused and its uploaded files deleted")
            pending.uploaded.update(uploaded)  # even a refused ack's uploads are cleaned up on abort
            for p in merged:   # and its agent may seal them
                pending.writers[p] = agent
                sealer, size = pending.early.pop(p, ("", 0))
                if sealer == agent:   # its agent sealed it before this ack arrived: the seal stands
                    pending.sealed[p] = max(pending.sealed.get(p, 0), size)
                    pending.uploaded.add(p)
            if not 0 <= handle.subtask < self.parallelism:
                raise InvalidRecordError(f"ack for subtask {handle.subtask} of a state with parallelism "
                                         f"{self.parallelism}")
            expected = key_group_range(self.max_parallelism, self.parallelism, handle.subtask)
            if handle.key_groups != expected:
                raise InvalidRecordError(
                    f"subtask {handle.subtask} acked key groups {handle.key_groups}, expected {expected}")
            pending.acks[handle.subtask] = handle
            pending.failures.pop(f"subtask {handle.subtask}", None)
            if stats is not None and not pending.rerun:
                pending.stats[handle.subtask] = stats
            if self._busy or self._jobs:   # the deleter spares what this ack references from now on
                self._acked_since.update(f.path for f in handle.all_files)
            if merged and self.merging.mode is MergingMode.ACROSS:   # appended to until the agent closes it
                self._open.setdefault(agent, set()).update(merged)
            for p in merged:
                if p not in pending.sealed:
                    pending.unsealed[p] = agent

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
        base = self._completed.get(pending.base_id) if pending.base_id is not None else None
        held = base.physical_paths() if base is not None else set()
        bad = sorted(p for p in referenced if not is_data_path(p) and p not in held and p not in self._claimed)
        if bad:
            raise InvalidRecordError(
                f"{who}: its handle references {bad}, which are neither data files ({DATA_PATH_FORMS}) nor "
                f"files its base checkpoint {pending.base_id} or a claimed checkpoint holds")
        taken = sorted(p for p in merged if pending.writers.get(p, agent) != agent
                       or any(p in files for a, files in self._open.items() if a != agent))
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
            foreign = sorted(p for p in files if pending is not None and pending.writers.get(p, agent) != agent)
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
            for p, size in files.items():
                if p not in pending.writers:   # sealed before the ack listing it arrived (a seal covers the
                    pending.early[p] = (agent, int(size))   # whole pool): it counts once that agent acks it
                    continue
                pending.unsealed.pop(p, None)
                pending.sealed[p] = max(pending.sealed.get(p, 0), int(size))
                pending.uploaded.add(p)

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
            return {p: pending.writers.get(p) or pending.unsealed.get(p, "") for p in self._not_durable(pending)}

    def _not_durable(self, pending: PendingCheckpoint) -> set[str]:
        """Merged files that a segment (state or channel state) of the current acks of ``pending``
        lies beyond the durable size of: the largest a seal of this checkpoint or a retained record
        reported. ``across`` files grow across checkpoints, so a file a retained checkpoint holds
        needs a seal again for the segments appended since; a checkpoint never completes pointing at
        bytes that are missing or not synced. A segment the base itself references is durable (a
        record written before sizes were checked may list a smaller size)."""
        base = self._completed.get(pending.base_id) if pending.base_id is not None else None
        reused = {(f.path, f.offset, f.length) for f in base.files()} if base is not None else set()
        out = set()
        for h in pending.acks.values():
            for f in h.all_files:
                if not is_merged(f.path) or f.path in out:
                    continue
                durable = max(pending.sealed.get(f.path, -1), self._sizes.get(f.path, -1))
                if f.offset + f.length > durable and (f.path, f.offset, f.length) not in reused:
                    out.add(f.path)
        return out

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
        """Physical against live bytes of the retained checkpoints' merged files."""
        with self._lock:
            metas = list(self._completed.values())
        return space_stats(metas)

    def no_reuse(self) -> set[str]:
        with self._lock:
            return set(self._no_reuse)

    def _control_space(self) -> None:
        chosen = choose_no_reuse(self._completed.values(), self.merging.max_space_amplification) \
            if self.merging.enabled else set()
        if chosen - self._no_reuse:
            log.info("space control of %s: %d merged files marked no-reuse (%s)", self.storage.state,
                     len(chosen), self.space().to_json())
        self._no_reuse = chosen

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
             subtask: int | None = None) -> str | None:
        """``who`` reports that an upload or a seal of ``checkpoint_id`` failed: commit aborts the
        checkpoint. Returns why the report is ignored (its attempt is over, or another copy of the
        subtask acked), else None."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None or attempt != pending.attempt:
                return "its attempt is over"
            if subtask is not None and subtask in pending.acks:
                return "another copy of it acked"
            pending.failures[who] = f"{who}: {message}"
            return None

    def working_on(self, checkpoint_id: int, subtask: int, agent: str) -> None:
        """``agent`` opened or uploads ``subtask`` of ``checkpoint_id`` (nothing if it is not pending)."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is not None:
                pending.working[subtask] = agent

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
                if checkpoint_id in self._completed:
                    return self._completed[checkpoint_id]
                raise CheckpointOrderError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} was never begun (or was aborted)")
            waiting = self.waiting_for(checkpoint_id)
            if waiting is not None:
                raise CheckpointError(waiting)
            if pending.rerun:  # the first result stands; this attempt's extra files go
                meta = self._completed[checkpoint_id]
                del self._pending[checkpoint_id]
                self._delete_unreferenced(pending.uploaded)
                self._delete_late()
                return meta
            subtasks = tuple(pending.acks[i] for i in range(self.parallelism))
            referenced = {f.path for h in subtasks for f in h.all_files}
            if referenced & self._deleting:   # a re-upload of a file being deleted: wait for the delete, then look
                if not self._deletions.wait_for(lambda: not referenced & self._deleting, timeout=_DELETE_WAIT):
                    raise CheckpointError(
                        f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: files it "
                        f"references are still being deleted after {_DELETE_WAIT:g} s (is the store answering?)")
                return self.complete(checkpoint_id)   # the lock was released: look at everything again
            # a file deleted here since some upload of it: an ack cannot tell whether its upload came
            # before the deletion (a lost attempt's late ack) or after, so look
            once_deleted = sorted(referenced & self._deleted.keys())
            missing_files = [p for p in once_deleted if not self.storage.location.exists(
                self.storage.location.path(*p.split("/")))]
            for p in once_deleted:
                if p not in missing_files:
                    del self._deleted[p]
            if missing_files:
                raise CheckpointError(
                    f"checkpoint {checkpoint_id} of state {self.storage.state!r} cannot complete: it references "
                    f"{missing_files[:5]} ({len(missing_files)} files), which were deleted after their upload. "
                    f"Apply the batch again with the same checkpoint_id")
            self.lease.check()
            properties: dict[str, object] = {"base": pending.base_id}
            if pending.query is not None:
                properties["query"] = pending.query
            if self._cuts.get(checkpoint_id):
                properties["cuts"] = {str(i): c for i, c in sorted(self._cuts[checkpoint_id].items())}
            claimed = sorted(referenced & self._claimed)
            if claimed:
                properties["claimed"] = claimed
            for p, size in pending.sealed.items():   # the durable size each segment lies within
                self._sizes[p] = max(self._sizes.get(p, 0), size)
            merged = sorted(p for p in referenced if is_merged(p))
            if merged:
                properties["merged"] = {p: self._sizes.get(p, 0) for p in merged}
            meta = CheckpointMetadata(
                state=self.storage.state, checkpoint_id=checkpoint_id, parallelism=self.parallelism,
                max_parallelism=self.max_parallelism, key_type=self.key_type,
                subtasks=subtasks, created_at=self.clock.now(), properties=properties)
            self.storage.write_metadata(meta)
            self._completed[checkpoint_id] = meta
            self._refs.update(meta.physical_paths())
            del self._pending[checkpoint_id]
            self._delete_unreferenced(pending.uploaded)  # uploads of replaced attempts
            self._abort_older(checkpoint_id)
            self._subsume()
            self._aborted = {c for c in self._aborted if c > checkpoint_id}
            self._cuts = {c: v for c, v in self._cuts.items() if c > checkpoint_id}
            self._delete_late()
            self._control_space()
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
        keep = set(sorted(self._completed)[-self.num_retained:])
        keep.update(self._pins)
        keep.update(p.base_id for p in self._pending.values() if p.base_id is not None)
        last = self.last_completed
        if last is not None and (self._latest_begun is None or self._latest_begun <= last):
            # nothing newer has begun: a re-run of `last` may still come, and it needs last's base
            base = max((c for c in self._completed if c < last), default=None)
            if base is not None:
                keep.add(base)
        return keep

    def _subsume(self) -> None:
        keep = self._protected()
        for cid in sorted(self._completed):
            if cid in keep:
                continue
            meta = self._completed.pop(cid)
            claimed_record = cid == RESTORED and meta.properties.get("claim_mode") == "claim"
            # the record first, then its files: the files wait for the record
            record = self._enqueue(_DeleteJob(record=meta if claimed_record else None, checkpoint_id=cid))
            self._refs.subtract(meta.physical_paths())
            gone = [p for p in meta.physical_paths() if self._refs[p] <= 0]
            for p in gone:
                del self._refs[p]
                self._sizes.pop(p, None)
            self._delete_unreferenced(gone, after=record)
            log.info("subsumed checkpoint %d of %s", cid, self.storage.state)

    def _remember_deleted(self, paths: list[str]) -> None:
        for p in paths:
            self._deleted.pop(p, None)
            self._deleted[p] = None
        while len(self._deleted) > _MAX_DELETED:
            del self._deleted[next(iter(self._deleted))]

    def _delete_unreferenced(self, paths: set[str] | list[str], after: int | None = None) -> int:
        """Delete what no retained checkpoint, no pending ack and no open ``across`` file needs among
        ``paths``: data files of this root, and absolute URLs only if this state claimed them. Nothing
        without the writer lease: another writer may hold the state now. The data files go through
        :meth:`_enqueue` (after the record job ``after``, if given); returns how many."""
        try:
            self.lease.check()
        except CheckpointError as exc:
            log.warning("not deleting %d files of %s: %s", len(paths), self.storage.state, exc)
            return 0
        in_flight = self._in_flight()
        unused = [p for p in paths if self._refs[p] <= 0 and p not in in_flight]
        foreign = sorted(p for p in unused if not is_data_path(p) and "://" not in p)
        if foreign:
            log.error("not deleting %s of %s: only data files (%s) are deleted", foreign, self.storage.state,
                      DATA_PATH_FORMS)
        doomed = sorted(p for p in unused if is_data_path(p))
        self._remember_deleted(doomed)
        if doomed:
            self._enqueue(_DeleteJob(files=doomed, after=after))
        n = len(doomed)
        claimed = sorted(p for p in unused if "://" in p and p in self._claimed)
        if claimed:
            n += self.storage.delete_claimed(claimed)
            self._claimed.difference_update(claimed)
            log.info("deleted %d claimed files of %s no retained checkpoint references", len(claimed),
                     self.storage.state)
        return n

    # --- background deletes ----------------------------------------------------------------------
    def _in_flight(self) -> set[str]:
        """Files a pending ack or an agent's open ``across`` file needs: never deleted."""
        held = {f.path for p in self._pending.values() for h in p.acks.values() for f in h.all_files}
        held.update(*self._open.values())
        return held

    def _enqueue(self, job: _DeleteJob) -> int:
        """Hand a delete to the deleter thread, or with ``background_deletes`` off run it now (the
        caller holds the lock); returns the job's number."""
        self._job_seq += 1
        job.seq = self._job_seq
        if not self.background_deletes:
            self._run(job)
            return job.seq
        self._jobs.append(job)
        if self._deleter is None or not self._deleter.is_alive():
            self._deleter = threading.Thread(target=self._delete_loop, daemon=True,
                                             name=f"steward-deletes-{self.storage.state}")
            self._deleter.start()
        self._deletions.notify_all()
        return job.seq

    def _delete_loop(self) -> None:
        while True:
            with self._lock:
                self._deletions.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._busy = False
                    self._deletions.notify_all()

    def _run(self, job: _DeleteJob) -> None:
        """One delete job: the record, then the files still unreferenced (under the lease, and only if
        the record they wait for is gone). The storage I/O runs outside the lock unless the caller
        holds it (``background_deletes`` off)."""
        files: list[str] = []
        with self._lock:
            if job.after in self._failed_records:
                log.warning("not deleting %d files of %s: the record they belonged to could not be "
                            "deleted (the orphan sweep retries once it is)", len(job.files), self.storage.state)
            elif job.files:
                try:
                    self.lease.check()
                    files = job.files
                except CheckpointError as exc:   # another writer may hold the state now: not ours to delete
                    log.warning("not deleting %d files of %s: %s", len(job.files), self.storage.state, exc)
        if job.checkpoint_id is not None:
            self._delete_record(job)
        if files:
            with self._lock:
                held = self._in_flight()
                self._acked_since = set()
            for path in files:
                self._delete_one(path, held)

    def _delete_record(self, job: _DeleteJob) -> None:
        """A subsumed checkpoint's record (and a CLAIMed source record); the files after it wait for it."""
        assert job.checkpoint_id is not None  # the caller's guard
        try:
            self.storage.delete_checkpoint_dir(job.checkpoint_id)
            if job.record is not None:
                self._delete_claimed_record(job.record)
        except Exception as exc:  # noqa: BLE001 - the record stays (recovery subsumes it again), its files too
            log.warning("deleting checkpoint %s of %s failed (recovery subsumes it again): %s", job.checkpoint_id,
                        self.storage.state, exc)
            with self._lock:
                self._failed_records.add(job.seq)

    def _delete_one(self, path: str, held: set[str]) -> None:
        """Delete ``path`` unless a record or a pending ack (``held``, and the acks since) references it
        again since it was queued. While the delete runs, ``complete()`` of a checkpoint referencing it
        waits, then finds it gone (see there): a re-upload racing the delete costs a retry, never a
        lost file."""
        with self._lock:
            if self._refs[path] > 0 or path in held or path in self._acked_since:
                return
            self._deleting.add(path)
        try:
            self.storage.delete_files([path])
        except Exception as exc:  # noqa: BLE001 - left as an orphan: the sweep deletes it after the grace
            log.warning("deleting %s of %s failed (the orphan sweep retries): %s", path, self.storage.state, exc)
        finally:
            with self._lock:
                self._deleting.discard(path)
                self._deletions.notify_all()

    def flush_deletions(self, timeout: float = 60.0) -> bool:
        """Wait (without holding the caller's locks) until the queued deletes are done; False on timeout."""
        with self._lock:
            return self._deletions.wait_for(lambda: not self._jobs and not self._busy, timeout=timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued deletes (up to ``timeout``) and stop the deleter thread. Idempotent."""
        self.flush_deletions(timeout)
        with self._lock:
            self._closing = True
            self._deletions.notify_all()
            deleter = self._deleter
        if deleter is not None:
            deleter.join(timeout)

    def _delete_claimed_record(self, meta: CheckpointMetadata) -> None:
        """Delete the source ``_metadata`` a subsumed CLAIM restore took over (its files go as their
        references drop), so the source never lists files this state deletes."""
        url = meta.properties.get("claimed_metadata")
        if not isinstance(url, str) or "://" not in url or not url.endswith("/_metadata"):
            return
        self.storage.delete_claimed([url])
        log.info("deleted the claimed record %s of %s", url, self.storage.state)
        parent = url.split("://", 1)[1].rsplit("/", 1)[0] if url.startswith("file://") else None
        if parent:
            with contextlib.suppress(OSError):
                os.rmdir(parent)  # the empty chk-N directory, locally (object stores have none)


def _cuts_of(meta: CheckpointMetadata) -> dict[int, int]:
    cuts = meta.properties.get("cuts")
    if not isinstance(cuts, dict):
        return {}
    return {int(k): int(v) for k, v in cuts.items() if str(k).isdigit() and isinstance(v, int)}


def _query_of(meta: CheckpointMetadata) -> str | None:
    query = meta.properties.get("query")
    return query if isinstance(query, str) else None


def _claimed_by(meta: CheckpointMetadata) -> set[str]:
    """The absolute URLs a record says this state owns: every file of a CLAIMed restored record, and
    the ``claimed`` list of a later checkpoint (only URLs the record itself references)."""
    absolute = {p for p in meta.physical_paths() if "://" in p}
    if meta.properties.get("claim_mode") == "claim" and "restored_from" in meta.properties:
        return absolute
    listed = meta.properties.get("claimed")
    return absolute & set(listed) if isinstance(listed, list) else set()
