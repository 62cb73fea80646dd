"""The executor agent's side of keyed state: working dirs, the local file cache, the uploader, and the
``state.*`` ops the Python workers call (issue 8); their typed requests and replies are in
:mod:`sparksteward.checkpoint.messages`.

A task (a ``mapInArrow`` partition, see :mod:`sparksteward.keyed_tasks`) does::

    state.open       OpenRequest -> OpenReply: the agent asks the driver agent for the base of
                     checkpoint N (``state.base``), restores the subtask into a fresh working dir from
                     its LocalFileCache, rescaling it when the base has another parallelism, and
                     closes the DB; ``restore`` says which old subtasks and files it read, and how
                     many bytes it downloaded
    ... opens the DB in workdir, runs the user function, takes the sync-phase snapshot ...
    state.task_cut   TaskCutRequest -> CutReply (FLIP-76): the agent asks the driver agent (``state.cut``)
    state.upload     UploadRequest (the task's TaskCounters) -> the snapshot is queued on the
                     SnapshotUploader; when it is uploaded the agent acks the driver agent's
                     coordinator (``state.ack``) with the handle and its SubtaskStats (the task's
                     counters, the files and bytes uploaded and reused, the restore, the local
                     snapshot's bytes and the async phase's time) or reports the failure
                     (``state.fail``); the working dir is deleted at once
    state.release    ReleaseRequest -> the working dir (and an unused snapshot) are deleted (a failed task)

**Replayed channel state** (FLIP-76) is hard-linked from the cache into the open's own ``replay/``
dir, so the cache bound cannot evict it before the task reads it; the links go with the upload or
release.

**Abandoned opens.** A task killed between open and upload never releases its subtask, so the agent
releases it (deletes its dirs, drops it from ``working``) when the driver agent answers a heartbeat
saying its checkpoint is no longer pending (completed or aborted), when the same subtask of a newer
checkpoint of that state opens here, or ``open_timeout`` after the open. Opens of the same subtask and
checkpoint (a retried or speculative task) never release each other. A late ``state.upload`` of a
released token is refused with :class:`~sparksteward.errors.CheckpointOrderError` saying why; a late
``state.release`` is a no-op.

**File merging (FLIP-306, issue 9).** When the state's ``file_merging`` is enabled (the base reply
says), the async phase appends each small new file to this agent's :class:`FileMerger` pool of the
checkpoint instead of uploading it, and acks the segments with the physical files they went to. The
:class:`~sparksteward.checkpoint.task.seal_poller.SealPoller` seals or discards those pools as the driver
agent decides; its polls are the agent's heartbeat for the driver.

The agent owns everything under its ``state-<pid>-*`` root (an owner file marks it): it deletes the
root on exit, and at start it sweeps the roots of agents proven dead on this host (SIGKILL included).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparksteward.checkpoint.filemerging.file_merger import FileMerger, MergingMode, MergingOptions
from sparksteward.checkpoint.messages import (
    AckRequest,
    BaseReply,
    BaseRequest,
    CutReply,
    CutRequest,
    FailRequest,
    OpenReply,
    OpenRequest,
    ReleaseReply,
    ReleaseRequest,
    ReplayFile,
    SubtaskStats,
    TaskCutRequest,
    UploadReply,
    UploadRequest,
    WorkingSubtask,
)
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.seal_poller import SealPoller
from sparksteward.checkpoint.task.subtask_restore import RescaleStats, prepare_subtask
from sparksteward.checkpoint.task.transfer import UploadResult, fetch_file
from sparksteward.checkpoint.task.uploader import SnapshotUploader
from sparksteward.clock import Clock, SystemClock
from sparksteward.errors import (
    AgentUnavailableError,
    CheckpointError,
    CheckpointOrderError,
    InvalidRequestError,
    ParallelismError,
)
from sparksteward.owner import OwnerRecord, private_dir, sweep_dead
from sparksteward.state.keygroups import key_group_range
from sparksteward.state.snapshot import (
    TASK_FLUSH_BYTES,
    WAL_FLUSH_BYTES,
    WAL_FLUSH_FILES,
    CompactionPolicy,
    LocalSnapshot,
)
from sparksteward.wire import AgentServer, Connection, Message
from sparksteward.wire.link import AgentLink

__all__ = ["STATE_DIR_PREFIX", "SubtaskService"]

log = logging.getLogger("sparksteward.checkpoint.task.task_state")

STATE_DIR_PREFIX = "state-"
OPEN_TIMEOUT = 6 * 3600.0   # spark.steward.state.open-timeout
_RELEASED_KEPT = 10_000     # released tokens remembered, so a late upload learns why
_MAX_BASES = 64   # bases of recent attempts kept (one per state and checkpoint)


@dataclass(frozen=True, slots=True)
class _Open:
    name: str
    checkpoint_id: int
    subtask: int
    workdir: Path
    snapshot: Path
    storage: CheckpointStorage
    known: dict[str, tuple[str, int]]
    key_groups: Any
    restore: dict[str, Any] | None = None   # what the restore read (RescaleStats), reported with the ack
    merging: MergingOptions = MergingOptions(enabled=False)
    channel: Path | None = None    # where the task writes its deferred input (FLIP-76)
    replay: Path | None = None     # the links to the base's channel state the task replays
    opened_at: float = 0.0         # clock.now() at the open (the open timeout counts from it)
    attempt: str = ""              # the checkpoint attempt's token, carried by the ack and a failure
    parallelism: int = 0
    pid: int | None = None         # the worker's process (decision 0026)
    discard: tuple[Path, ...] = ()   # dirs of held DBs the worker closes after this open's reply

    def delete(self) -> None:
        """Delete everything of this open on the executor's disk."""
        for d in (self.workdir, self.snapshot, self.replay, *self.discard):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        if self.channel is not None:
            self.channel.unlink(missing_ok=True)


@dataclass(slots=True)
class _Lent:
    """The working dir of a DB a worker keeps open after its upload (decision 0026): the state after
    checkpoint ``checkpoint_id`` of ``subtask``, as the upload of that open sent it (``files``: the
    names and checksums of its handle, set before its ack; None until then or when it failed)."""

    name: str
    subtask: int
    checkpoint_id: int
    parallelism: int
    workdir: Path
    pid: int | None
    files: frozenset[tuple[str, str]] | None = None


def _fingerprint(files: Any) -> frozenset[tuple[str, str]]:
    """What a subtask's files hold: their names and checksums (where they were put does not matter)."""
    return frozenset((f.name, f.checksum) for f in files)


class SubtaskService:
    """Working dirs, cache and uploads of one executor's keyed-state subtasks.

    ``open_timeout``: seconds after which an open subtask that was neither uploaded nor released is
    released (measured on ``clock``). ``agent_timeout``: how long the driver agent waits for this agent's
    heartbeat (``spark.steward.checkpoint.agent-timeout``); the agent beats every second, or four times
    within a shorter timeout, so one late beat never makes it look dead.
    """

    def __init__(self, parent: str | Path, driver_endpoint: str | None, secret: str, *, upload_threads: int = 4,
                 cache_max_bytes: int | None = None, wal_flush_bytes: int = WAL_FLUSH_BYTES,
                 wal_flush_files: int = WAL_FLUSH_FILES, task_flush_bytes: int = TASK_FLUSH_BYTES,
                 open_timeout: float = OPEN_TIMEOUT, clock: Clock | None = None,
                 compaction: CompactionPolicy | None = None, agent_timeout: float = 30.0) -> None:
        parent = private_dir(Path(parent))
        sweep_dead(parent, STATE_DIR_PREFIX)
        self.root = Path(tempfile.mkdtemp(prefix=f"{STATE_DIR_PREFIX}{os.getpid()}-", dir=parent))
        OwnerRecord.current().write(self.root)
        self.cache = LocalFileCache(self.root / "cache", max_bytes=cache_max_bytes)
        self.uploader = SnapshotUploader(upload_threads, cache=self.cache)
        self.wal_flush_bytes = wal_flush_bytes  # a snapshot with more WAL is folded before its upload
        self.wal_flush_files = wal_flush_files  # and one with more WAL files
        self.task_flush_bytes = task_flush_bytes  # a task whose DB holds more WAL flushes it (decision 0022)
        self.compaction = compaction or CompactionPolicy()  # a snapshot with much garbage is compacted first
        self._driver_endpoint = driver_endpoint
        self._link = AgentLink(driver_endpoint or "", secret)   # one reused connection per sending thread
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._released: OrderedDict[str, str] = OrderedDict()   # token -> why the agent released it
        self._bases: OrderedDict[tuple[str, int], BaseReply] = OrderedDict()   # (state, checkpoint) -> its base
        self._lent: dict[str, _Lent] = {}   # token -> the dir of a DB a worker holds open (decision 0026)
        self.open_timeout = open_timeout
        self.clock = clock or SystemClock()
        self._closed = False
        self.agent_id = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"
        self.merger = FileMerger(self.root / "merging")
        self._uploading: dict[int, tuple[str, int, int]] = {}   # upload id -> (state, checkpoint, subtask)
        self.poller = SealPoller(self.merger, self, self._ask, self.agent_id, interval=min(1.0, agent_timeout / 4))
        self.poller.start()

    def register_handlers(self, server: AgentServer) -> None:
        server.serve(OpenRequest, self._op_open)
        server.serve(UploadRequest, self._op_upload)
        server.serve(ReleaseRequest, self._op_release)
        server.serve(TaskCutRequest, self._op_task_cut)

    def _ask(self, request: Message) -> Any:
        """Send ``request`` to the driver agent; its typed reply (sent again on a new connection if one
        breaks before the reply, for a repeatable op)."""
        if not self._driver_endpoint:
            raise AgentUnavailableError("this executor agent has no driver endpoint: keyed state needs the "
                                        "driver agent (is the plugin enabled on the driver?)")
        return self._link.ask(request)

    # --- ops ---------------------------------------------------------------------------------
    def _op_open(self, conn: Connection, req: OpenRequest) -> OpenReply:
        name, cid, subtask, routed = req.name, req.checkpoint_id, req.subtask, req.parallelism
        now_ms = req.now_ms   # the batch's processing time: a rescale drops what expired
        base = self._base(name, cid, subtask, routed)
        p, m = base.parallelism, base.max_parallelism
        if routed is not None and routed != p:
            raise ParallelismError(
                f"the rows of checkpoint {cid} of keyed state {name!r} were routed to {routed} subtasks, but the "
                f"state now has parallelism {p} (it was opened again with another parallelism): apply the batch "
                f"again with the KeyedState of the latest st.keyed_state(...) call")
        if subtask >= p:
            raise InvalidRequestError(f"{req.OP}: subtask {subtask} is out of range for parallelism {p}")
        storage = CheckpointStorage.open(base.checkpoint_dir, name, base.cluster_id)
        meta = base.base
        token = uuid.uuid4().hex
        kept_token, kept, stale = self._claim_held(req, meta, p)
        workdir = kept.workdir if kept is not None else self.root / "work" / token
        replay_dir = self.root / "replay" / token
        discard = tuple(lent.workdir for lent in stale.values() if lent is not None)
        try:
            if kept is None:
                stats = prepare_subtask(storage, meta, p, subtask, workdir, self.cache, max_parallelism=m,
                                        key_type=base.key_type, now_ms=now_ms)
            replay = self._replay(storage, meta, p, subtask, m, replay_dir) if meta is not None else []
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)   # a kept DB goes too: the task fails, the worker closes it
            shutil.rmtree(replay_dir, ignore_errors=True)
            for d in discard:
                shutil.rmtree(d, ignore_errors=True)
            raise
        restore = None
        if kept is not None and meta is not None:
            nothing_read = RescaleStats(subtask, key_group_range(m, p, subtask), subtask, (), (), 0, 0, 0.0,
                                        old_parallelism=meta.parallelism)
            restore = {**nothing_read.to_json(), "base_checkpoint": meta.checkpoint_id, "kept_open": True}
        elif stats is not None and meta is not None:
            restore = {**stats.to_json(), "base_checkpoint": meta.checkpoint_id}
        opened = _Open(name, cid, subtask, workdir, self.root / "snapshots" / token, storage,
                       base.known, key_group_range(m, p, subtask), restore,
                       MergingOptions.from_json(base.merging),
                       self.root / "snapshots" / f"channel-{subtask}-{token}", replay_dir, self.clock.now(),
                       base.attempt, p, req.pid, discard)
        with self._lock:
            if self._closed:
                opened.delete()
                raise CheckpointError("the executor agent is shutting down")
            self._open[token] = opened
            older = [t for t, o in self._open.items() if o.name == name and o.subtask == subtask
                     and o.checkpoint_id < cid]
        self.release(older, f"subtask {subtask} of checkpoint {cid} opened on this executor agent, so no task "
                            f"uploads an older checkpoint's subtask any more")
        return OpenReply(token=token, workdir=str(workdir), snapshot=str(opened.snapshot), parallelism=p,
                         max_parallelism=m, key_type=base.key_type, rerun=base.rerun, restore=restore,
                         alignment=base.alignment, deadline_in=base.deadline_in,
                         channel=str(opened.channel), replay=replay, cut=base.cut, cut_rows=base.cut_rows,
                         attempt=opened.attempt,
                         replay_filter=meta is not None and meta.parallelism != p,
                         flush_wal_above=self.task_flush_bytes or None,
                         kept=kept_token, stale=sorted(stale))

    def _claim_held(self, req: OpenRequest, meta: CheckpointMetadata | None,
                    parallelism: int) -> tuple[str, _Lent | None, dict[str, _Lent | None]]:
        """Decision 0026: of the DBs the worker holds open for this state (``req.held``), the one that is
        exactly the base of this open, if any (taken out of the lent dirs: it becomes this open's), and
        those that can never be a base again or that this agent does not know (``stale``: the worker closes
        them; their dirs go with this open). The dirs of DBs the worker closed on its own go now."""
        kept_token, kept = "", None
        stale: dict[str, _Lent | None] = {}
        with self._lock:
            dropped = [self._lent.pop(t) for t in req.dropped if t in self._lent and self._lent[t].name == req.name]
            for token in req.held:
                lent = self._lent.get(token)
                if lent is None or lent.name != req.name:
                    stale[token] = None   # not this agent's (another executor's, or forgotten): close it
                    continue
                mine = lent.subtask == req.subtask
                if (kept is None and mine and meta is not None and lent.files is not None
                        and lent.checkpoint_id == meta.checkpoint_id and lent.parallelism == parallelism
                        == meta.parallelism and req.subtask < len(meta.subtasks)
                        and lent.files == _fingerprint(meta.subtasks[req.subtask].files)):
                    kept_token, kept = token, self._lent.pop(token)
                elif meta is None or lent.checkpoint_id < meta.checkpoint_id or (
                        mine and lent.checkpoint_id == meta.checkpoint_id):
                    stale[token] = self._lent.pop(token)   # older than the base, or another attempt's
        for lent in dropped:
            shutil.rmtree(lent.workdir, ignore_errors=True)
        return kept_token, kept, stale

    def _base(self, name: str, cid: int, subtask: int, routed: int | None) -> BaseReply:
        """``state.base`` for one subtask; the base record of an attempt crosses the wire once per agent
        (see :mod:`~sparksteward.checkpoint.messages`)."""
        with self._lock:
            held = self._bases.get((name, cid))
        reply: BaseReply = self._ask(BaseRequest(name, cid, subtask, self.agent_id, routed,
                                                 have=held.attempt if held is not None else ""))
        base = reply.resolve(held)
        with self._lock:
            self._bases[(name, cid)] = base
            self._bases.move_to_end((name, cid))
            while len(self._bases) > _MAX_BASES:
                self._bases.popitem(last=False)
        return base

    def _replay(self, storage: CheckpointStorage, meta: CheckpointMetadata, parallelism: int, subtask: int,
                max_parallelism: int, dest: Path) -> list[ReplayFile]:
        """The base's channel state this subtask replays first (FLIP-76): its own, or after a rescale
        that of every old subtask overlapping its key groups; fetched into the cache, verified, and
        hard-linked into ``dest``, which the task reads (the cache may evict its entries any time)."""
        kg = key_group_range(max_parallelism, parallelism, subtask)
        out: list[ReplayFile] = []
        for old in meta.subtasks:
            if old.key_groups.stop <= kg.start or old.key_groups.start >= kg.stop:
                continue
            for f in old.channel_state:
                dest.mkdir(parents=True, exist_ok=True)
                link = dest / str(len(out))
                with self.cache.pinned(f.checksum):
                    path, _, _ = fetch_file(storage, meta, old, f, self.cache)
                    try:
                        os.link(path, link)
                    except OSError:   # a file system without hard links
                        shutil.copyfile(path, link)
                out.append(ReplayFile(f"channel state {f.name} of checkpoint {meta.checkpoint_id}, subtask "
                                      f"{old.subtask} ({storage.url_of(f.path)})", str(link)))
        return out

    def _op_task_cut(self, conn: Connection, req: TaskCutRequest) -> CutReply:
        """FLIP-76: the task of an open subtask proposes its cut; the driver agent answers the cut
        that stands for every attempt of the checkpoint."""
        with self._lock:
            opened = self._open.get(req.token)
        if opened is None:
            raise InvalidRequestError(f"{req.OP}: no open subtask with token {req.token!r} (released already?)")
        reply: CutReply = self._ask(CutRequest(opened.name, opened.checkpoint_id, opened.subtask, req.cut,
                                               req.overflow, req.rows))
        return reply

    def _take(self, token: str, op: str) -> _Open:
        with self._lock:
            opened = self._open.pop(token, None)
            why = self._released.get(token)
        if opened is None and why is not None:
            raise CheckpointOrderError(f"{op}: {why}; its snapshot is not uploaded (the task's attempt was "
                                       f"abandoned; Spark runs the subtask again if its batch still needs it)")
        if opened is None:
            raise InvalidRequestError(f"{op}: no open subtask with token {token!r} (released already?)")
        return opened

    def release(self, tokens: list[str], why: str) -> None:
        """Release the opens ``tokens`` that are still open: their tasks are gone or no longer count."""
        released = []
        with self._lock:
            for token in tokens:
                opened = self._open.pop(token, None)
                if opened is None:
                    continue
                self._released[token] = (f"subtask {opened.subtask} of checkpoint {opened.checkpoint_id} of keyed "
                                         f"state {opened.name!r} was released by the executor agent: {why}")
                while len(self._released) > _RELEASED_KEPT:
                    self._released.popitem(last=False)
                released.append(opened)
        for opened in released:
            opened.delete()
            log.info("released subtask %d of checkpoint %d of %s (never uploaded): %s", opened.subtask,
                     opened.checkpoint_id, opened.name, why)

    def expire(self) -> None:
        """Release the opens older than ``open_timeout``, and delete the lent dirs of workers that are gone."""
        now = self.clock.now()
        with self._lock:
            expired = [t for t, o in self._open.items() if now - o.opened_at >= self.open_timeout]
            gone = [self._lent.pop(t) for t, lent in list(self._lent.items()) if not _alive(lent.pid)]
        for lent in gone:
            shutil.rmtree(lent.workdir, ignore_errors=True)
            log.info("deleted the kept DB of subtask %d of checkpoint %d of %s: its worker %s is gone",
                     lent.subtask, lent.checkpoint_id, lent.name, lent.pid)
        if expired:
            self.release(expired, f"it was open for more than {self.open_timeout:g} s without an upload "
                                  f"(spark.steward.state.open-timeout)")

    def _op_upload(self, conn: Connection, req: UploadRequest) -> UploadReply:
        # every field was checked before the subtask is taken, so a bad one leaves it open (releasable)
        sync_ms, flush_ms = req.sync_ms, req.flush_ms
        opened = self._take(req.token, req.OP)
        channel = (opened.channel,) if opened.channel is not None and opened.channel.is_file() else ()
        lent = None
        linked: frozenset[str] = frozenset()
        if req.keep:   # the worker keeps the DB open (decision 0026): its dir is lent until it comes back or goes
            lent = _Lent(opened.name, opened.subtask, opened.checkpoint_id, opened.parallelism, opened.workdir,
                         opened.pid)
            with self._lock:
                self._lent[req.token] = lent
            with contextlib.suppress(OSError):
                linked = frozenset(os.listdir(opened.snapshot))   # the live DB's files, as the sync phase took them
        else:
            shutil.rmtree(opened.workdir, ignore_errors=True)
        for d in (opened.replay, *opened.discard):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        if not opened.snapshot.is_dir():
            raise InvalidRequestError(f"{req.OP}: no snapshot in {opened.snapshot}: take it before the upload")
        snap = LocalSnapshot(opened.snapshot, opened.key_groups, sync_ms, flush_ms)
        local_bytes = _size_of(opened.snapshot)   # the DB's live files the sync phase linked
        started = time.monotonic()

        upload_id = id(opened)
        with self._lock:
            self._uploading[upload_id] = (opened.name, opened.checkpoint_id, opened.subtask)

        def finished() -> None:
            with self._lock:
                self._uploading.pop(upload_id, None)

        def done(cid: int, result: UploadResult) -> None:
            try:
                written = len(result.handle.files) - result.files_reused
                stats = SubtaskStats.of(   # the task's counters, and what this agent measured
                    req.counters, files_uploaded=written, bytes_uploaded=result.bytes_uploaded,
                    whole_files_uploaded=len(result.uploaded), segments_written=written - len(result.uploaded),
                    files_reused=result.files_reused, files=len(result.handle.files), bytes=result.handle.size,
                    sync_ms=sync_ms, flush_ms=flush_ms, restore=opened.restore, local_bytes=local_bytes,
                    async_ms=round((time.monotonic() - started) * 1000, 3))
                if lent is not None and {f.name for f in result.handle.files} <= linked:
                    # before the ack: once the checkpoint completes, the DB is known to be its state. A
                    # snapshot the agent folded or compacted is uploaded as other files: the next batch
                    # restores them instead, so the live DB does not keep the garbage it shed
                    lent.files = _fingerprint(result.handle.files)
                self._ask(AckRequest(opened.name, cid, result.handle, opened.attempt, list(result.uploaded),
                                     list(result.merged), self.agent_id, stats))
            except Exception as exc:  # noqa: BLE001 - the coordinator refused it (aborted) or is gone
                log.warning("ack of checkpoint %d subtask %d of %s failed: %s", cid, opened.subtask, opened.name, exc)
            finally:
                finished()

        def failed(cid: int, subtask: int, exc: BaseException) -> None:
            try:
                finished()   # not itself among the copies still at work
                with self._lock:
                    me = (opened.name, cid, subtask)
                    others = sum(1 for o in self._open.values() if (o.name, o.checkpoint_id, o.subtask) == me) + \
                        sum(1 for u in self._uploading.values() if u == me)
                self._ask(FailRequest(opened.name, cid, opened.attempt, f"{type(exc).__name__}: {exc}", subtask,
                                      self.agent_id, others))
            except Exception as exc2:  # noqa: BLE001 - best effort: unreported, the checkpoint aborts at its timeout
                log.warning("reporting the failed upload of %s failed: %s", opened.name, exc2)
            finally:
                finished()

        merge = None
        opts = opened.merging
        if opts.enabled:
            storage = opened.storage
            target = storage.local_target if opts.mode is MergingMode.ACROSS else None
            self.poller.track(storage.url, opened.name)

            def merge(name: str, local: Path, checksum: str) -> Any:
                seg = self.merger.append(storage.url, opened.checkpoint_id, opts, name, local, checksum,
                                         put=storage.put_file, target=target)
                self.poller.wake()
                return seg

        try:
            self.uploader.submit(opened.storage, opened.checkpoint_id, opened.subtask, snap, known=opened.known,
                                 on_done=done, on_error=failed, merge=merge,
                                 merge_below=opts.max_file_size if opts.enabled else 0, channel=channel,
                                 fold_wal_above=self.wal_flush_bytes,
                                 fold_wal_files=self.wal_flush_files, compaction=self.compaction)
        except BaseException:
            finished()
            raise
        return UploadReply()

    def working(self) -> tuple[list[WorkingSubtask], dict[str, tuple[str, int]]]:
        """The subtasks open here (their task runs) or uploading (their ack is still to come), and
        the opens among them (token -> state, checkpoint)."""
        with self._lock:
            opens = {t: (o.name, o.checkpoint_id) for t, o in self._open.items()}
            busy = {(o.name, o.checkpoint_id, o.subtask) for o in self._open.values()}
            busy.update(self._uploading.values())
        return [WorkingSubtask(n, c, s) for n, c, s in sorted(busy)], opens

    def _op_release(self, conn: Connection, req: ReleaseRequest) -> ReleaseReply:
        with self._lock:
            opened = self._open.pop(req.token, None)
        if opened is not None:
            opened.delete()
        return ReleaseReply(opened is not None)

    def open_subtasks(self) -> int:
        with self._lock:
            return len(self._open)

    def uploads_in_flight(self) -> int:
        """Uploads queued or running whose ack (or failure report) has not been sent yet."""
        with self._lock:
            return len(self._uploading)

    def close(self) -> None:
        """Finish the uploads in flight, then delete the root. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.uploader.close()
        self.poller.close()
        self._link.close()
        self.merger.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` (a Python worker on this host) still runs; None: not known, so not kept."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process took the pid: ours is gone
        return False
    return True


def _size_of(directory: Path) -> int:
    """The bytes of the regular files directly in ``directory`` (0 if it is missing)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0
