"""The executor agent's side of keyed state: working dirs, the local file cache, the uploader, and the
``state.*`` ops the Python workers call (issue 8).

A task (a ``mapInArrow`` partition, see :mod:`sparksteward.keyed_tasks`) does::

    state.open      name, checkpoint_id, subtask, parallelism (the task's routing: refused when the state
                    was rescaled since) -> token, workdir, snapshot dir, restore
                    (the agent asks the driver agent for the base of checkpoint N, restores the
                    subtask into a fresh working dir from its LocalFileCache, rescaling it when the
                    base has another parallelism, and closes the DB; ``restore`` says which old
                    subtasks and files it read, and how many bytes it downloaded)
    ... opens the DB in workdir, runs the user function, takes the sync-phase snapshot ...
    state.upload    token, sync_ms, flush_ms, counters -> the snapshot is queued on the
                    SnapshotUploader; when it is uploaded the agent acks the driver agent's
                    coordinator with the handle and its stats (files and bytes uploaded and reused,
                    the restore, the WAL the open replayed, the task's counters, the local snapshot's
                    bytes and the async phase's time) or reports the failure; the working dir
                    is deleted at once
    state.release   token -> the working dir (and an unused snapshot) are deleted (a failed task)

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
checkpoint instead of uploading it, and acks the segments with the physical files they went to. A
poller thread long-polls the driver agent (``state.merge_poll``) while any pool holds unsealed files:
once every subtask of the checkpoint has acked it seals them (``state.sealed``), and it discards a
pool whose checkpoint was aborted. The polls are the agent's heartbeat for the driver: while it has
subtasks open or uploading it polls every second too (``working``), so that commit aborts promptly
when this agent dies before its acks (SIGKILL mid-upload) instead of waiting for the commit timeout.

The agent owns everything under its ``state-<pid>-*`` root (an owner file marks it): it deletes the
root on exit, and at start it sweeps the roots of agents proven dead on this host (SIGKILL included).
"""

from __future__ import annotations

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


from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.filemerging.file_merger import FileMerger, MergingMode, MergingOptions
from sparksteward.checkpoint.messages import BaseReply
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.task.subtask_restore import prepare_subtask
from sparksteward.checkpoint.storage import CheckpointStorage, UploadResult
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
from sparksteward.state.snapshot import (
    TASK_FLUSH_BYTES,
    WAL_FLUSH_BYTES,
    WAL_FLUSH_FILES,
    CompactionPolicy,
    LocalSnapshot,
)
from sparksteward.state.keygroups import key_group_range
from sparksteward.wire import AgentServer, Connection, Fields
from sparksteward.wire.link import AgentLink

__all__ = ["STATE_DIR_PREFIX", "SubtaskService"]

log = logging.getLogger("sparksteward.checkpoint.task.task_state")

STATE_DIR_PREFIX = "state-"
OPEN_TIMEOUT = 6 * 3600.0   # spark.steward.state.open-timeout
_RELEASED_KEPT = 10_000     # released tokens remembered, so a late upload learns why
#: ops to the driver agent that may arrive twice (sent again when a reused connection broke)
_MAX_BASES = 64   # bases of recent attempts kept (one per state and checkpoint)
_REPEATABLE = frozenset({"state.base", "state.cut", "state.merge_poll", "state.sealed", "state.fail"})


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

    def delete(self) -> None:
        """Delete everything of this open on the executor's disk."""
        for d in (self.workdir, self.snapshot, self.replay):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        if self.channel is not None:
            self.channel.unlink(missing_ok=True)


class SubtaskService:
    """Working dirs, cache and uploads of one executor's keyed-state subtasks.

    ``open_timeout``: seconds after which an open subtask that was neither uploaded nor released is
    released (measured on ``clock``).
    """

    def __init__(self, parent: str | Path, driver_endpoint: str | None, secret: str, *, upload_threads: int = 4,
                 cache_max_bytes: int | None = None, wal_flush_bytes: int = WAL_FLUSH_BYTES,
                 wal_flush_files: int = WAL_FLUSH_FILES, task_flush_bytes: int = TASK_FLUSH_BYTES,
                 open_timeout: float = OPEN_TIMEOUT, clock: Clock | None = None,
                 compaction: CompactionPolicy | None = None) -> None:
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
        self.open_timeout = open_timeout
        self.clock = clock or SystemClock()
        self._closed = False
        self.agent_id = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"
        self.merger = FileMerger(self.root / "merging")
        self._names: dict[str, str] = {}            # checkpoint root URL -> state name (for the poller)
        self._sealing: set[tuple[str, int]] = set()
        self._uploading: dict[int, tuple[str, int, int]] = {}   # upload id -> (state, checkpoint, subtask)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="steward-merge-poll", daemon=True)
        self._poller.start()

    def register_handlers(self, server: AgentServer) -> None:
        for op, fn in {"state.open": self._op_open, "state.upload": self._op_upload,
                       "state.release": self._op_release, "state.cut": self._op_cut}.items():
            server.add_handler(op, fn)

    def _driver(self, op: str, **fields: Any) -> dict[str, Any]:
        if not self._driver_endpoint:
            raise AgentUnavailableError("this executor agent has no driver endpoint: keyed state needs the "
                                        "driver agent (is the plugin enabled on the driver?)")
        return self._link.request(op, retry=op in _REPEATABLE, **fields)

    # --- ops ---------------------------------------------------------------------------------
    def _op_open(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name = f.text("name", max_len=200)
        cid = f.integer("checkpoint_id", lo=0)
        subtask = f.integer("subtask", lo=0)
        routed = f.integer("parallelism", default=None, lo=1)
        now_ms = f.integer("now_ms", default=None, lo=0, hi=1 << 62)   # the batch's processing time: a rescale drops what expired
        base = self._base(name, cid, subtask, routed)
        p, m = base.parallelism, base.max_parallelism
        if routed is not None and routed != p:
            raise ParallelismError(
                f"the rows of checkpoint {cid} of keyed state {name!r} were routed to {routed} subtasks, but the "
                f"state now has parallelism {p} (it was opened again with another parallelism): apply the batch "
                f"again with the KeyedState of the latest st.keyed_state(...) call")
        if subtask >= p:
            raise InvalidRequestError(f"{f.op}: subtask {subtask} is out of range for parallelism {p}")
        storage = CheckpointStorage.open(base.checkpoint_dir, name, base.cluster_id)
        meta = base.base
        token = uuid.uuid4().hex
        workdir = self.root / "work" / token
        replay_dir = self.root / "replay" / token
        try:
            stats = prepare_subtask(storage, meta, p, subtask, workdir, self.cache, max_parallelism=m,
                                    key_type=base.key_type, now_ms=now_ms)
            replay = self._replay(storage, meta, p, subtask, m, replay_dir) if meta is not None else []
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(replay_dir, ignore_errors=True)
            raise
        restore = None
        if stats is not None and meta is not None:
            restore = {**stats.to_json(), "base_checkpoint": meta.checkpoint_id}
        opened = _Open(name, cid, subtask, workdir, self.root / "snapshots" / token, storage,
                       base.known, key_group_range(m, p, subtask), restore,
                       MergingOptions.from_json(base.merging),
                       self.root / "snapshots" / f"channel-{subtask}-{token}", replay_dir, self.clock.now(),
                       base.attempt)
        with self._lock:
            if self._closed:
                opened.delete()
                raise CheckpointError("the executor agent is shutting down")
            self._open[token] = opened
            older = [t for t, o in self._open.items() if o.name == name and o.subtask == subtask
                     and o.checkpoint_id < cid]
        self._release(older, f"subtask {subtask} of checkpoint {cid} opened on this executor agent, so no task "
                             f"uploads an older checkpoint's subtask any more")
        return {"token": token, "workdir": str(workdir), "snapshot": str(opened.snapshot), "parallelism": p,
                "max_parallelism": m, "key_type": base.key_type, "rerun": base.rerun, "restore": restore,
                "alignment": base.alignment, "deadline_in": base.deadline_in,
                "channel": str(opened.channel), "replay": replay, "cut": base.cut, "attempt": opened.attempt,
                "replay_filter": meta is not None and meta.parallelism != p,
                "flush_wal_above": self.task_flush_bytes or None}

    def _base(self, name: str, cid: int, subtask: int, routed: int | None) -> BaseReply:
        """``state.base`` for one subtask; the base record of an attempt crosses the wire once per agent
        (see :mod:`~sparksteward.checkpoint.messages`)."""
        with self._lock:
            held = self._bases.get((name, cid))
        reply = self._driver("state.base", name=name, checkpoint_id=cid, subtask=subtask, agent=self.agent_id,
                             parallelism=routed, have=held.attempt if held is not None else "")
        base = BaseReply.from_reply(reply, held)
        with self._lock:
            self._bases[(name, cid)] = base
            self._bases.move_to_end((name, cid))
            while len(self._bases) > _MAX_BASES:
                self._bases.popitem(last=False)
        return base

    def _replay(self, storage: CheckpointStorage, meta: CheckpointMetadata, parallelism: int, subtask: int,
                max_parallelism: int, dest: Path) -> list[dict[str, str]]:
        """The base's channel state this subtask replays first (FLIP-76): its own, or after a rescale
        that of every old subtask overlapping its key groups; fetched into the cache, verified, and
        hard-linked into ``dest``, which the task reads (the cache may evict its entries any time)."""
        kg = key_group_range(max_parallelism, parallelism, subtask)
        out: list[dict[str, str]] = []
        for old in meta.subtasks:
            if old.key_groups.stop <= kg.start or old.key_groups.start >= kg.stop:
                continue
            for f in old.channel_state:
                dest.mkdir(parents=True, exist_ok=True)
                link = dest / str(len(out))
                with self.cache.pinned(f.checksum):
                    path, _, _ = storage._fetch(meta, old, f, self.cache)
                    try:
                        os.link(path, link)
                    except OSError:   # a file system without hard links
                        shutil.copyfile(path, link)
                out.append({"name": f"channel state {f.name} of checkpoint {meta.checkpoint_id}, subtask {old.subtask} "
                                    f"({storage.url_of(f.path)})", "path": str(link)})
        return out

    def _op_cut(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        """FLIP-76: the task of an open subtask proposes its cut; the driver agent answers the cut
        that stands for every attempt of the checkpoint."""
        f = Fields(req)
        token = f.text("token", max_len=64)
        cut = f.integer("cut", lo=0, hi=32768)
        overflow = f.integer("overflow", default=0, lo=0, hi=1)
        with self._lock:
            opened = self._open.get(token)
        if opened is None:
            raise InvalidRequestError(f"{f.op}: no open subtask with token {token!r} (released already?)")
        return self._driver("state.cut", name=opened.name, checkpoint_id=opened.checkpoint_id,
                            subtask=opened.subtask, cut=cut, overflow=overflow)

    def _take(self, f: Fields) -> _Open:
        token = f.text("token", max_len=64)
        with self._lock:
            opened = self._open.pop(token, None)
            why = self._released.get(token)
        if opened is None and why is not None:
            raise CheckpointOrderError(f"{f.op}: {why}; its snapshot is not uploaded (the task's attempt was "
                                       f"abandoned; Spark runs the subtask again if its batch still needs it)")
        if opened is None:
            raise InvalidRequestError(f"{f.op}: no open subtask with token {token!r} (released already?)")
        return opened

    def _release(self, tokens: list[str], why: str) -> None:
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

    def _expire(self) -> None:
        """Release the opens older than ``open_timeout``."""
        now = self.clock.now()
        with self._lock:
            expired = [t for t, o in self._open.items() if now - o.opened_at >= self.open_timeout]
        if expired:
            self._release(expired, f"it was open for more than {self.open_timeout:g} s without an upload "
                                   f"(spark.steward.state.open-timeout)")

    def _release_stale(self, reply: dict[str, Any], opens: dict[str, tuple[str, int]]) -> None:
        """Release the opens (of those a heartbeat reported) whose checkpoint the driver agent says is
        no longer pending. Opens made after the heartbeat was sent are not among ``opens``."""
        stale = {(s.get("name"), s.get("checkpoint_id")) for s in reply.get("stale") or [] if isinstance(s, dict)}
        if stale:
            self._release([t for t, key in opens.items() if key in stale],
                          "its checkpoint is no longer pending at the driver agent (it completed or was aborted)")

    def _op_upload(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        # every field is checked before the subtask is taken, so a bad one leaves it open (releasable)
        sync_ms = f.number("sync_ms", default=0.0, lo=0)
        flush_ms = f.number("flush_ms", default=0.0, lo=0)
        c = Fields({**(f.mapping("counters", default=None) or {}), "op": f"{f.op} counters"})
        counters = {"rows_processed": c.integer("rows_processed", default=0, lo=0),
                    "rows_deferred": c.integer("rows_deferred", default=0, lo=0),
                    "wal_bytes": c.integer("wal_bytes", default=0, lo=0),
                    "ttl_expired_removed": c.integer("ttl_expired_removed", default=0, lo=0),
                    "rows_out": c.integer("rows_out", default=0, lo=0),
                    "keys_touched": c.integer("keys_touched", default=0, lo=0),
                    "entries_estimate": c.integer("entries_estimate", default=0, lo=0),
                    "entries_ingested": c.integer("entries_ingested", default=0, lo=0),
                    "unaligned": bool(c.integer("unaligned", default=0, lo=0, hi=1))}  # 0/1 from the task
        opened = self._take(f)
        channel = (opened.channel,) if opened.channel is not None and opened.channel.is_file() else ()
        shutil.rmtree(opened.workdir, ignore_errors=True)
        if opened.replay is not None:
            shutil.rmtree(opened.replay, ignore_errors=True)
        if not opened.snapshot.is_dir():
            raise InvalidRequestError(f"{f.op}: no snapshot in {opened.snapshot}: take it before the upload")
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
                stats = {"files_uploaded": written, "bytes_uploaded": result.bytes_uploaded,
                         "whole_files_uploaded": len(result.uploaded), "segments_written": written - len(result.uploaded),
                         "files_reused": result.files_reused, "files": len(result.handle.files),
                         "bytes": result.handle.size, "sync_ms": sync_ms, "flush_ms": flush_ms,
                         "restore": opened.restore,
                         "rows_processed": counters["rows_processed"], "rows_deferred": counters["rows_deferred"],
                         "channel_bytes": sum(h.length for h in result.handle.channel_state),
                         "unaligned": counters["unaligned"], "wal_bytes": counters["wal_bytes"],
                         "ttl_expired_removed": counters["ttl_expired_removed"],
                         "rows_out": counters["rows_out"], "keys_touched": counters["keys_touched"],
                         "entries_estimate": counters["entries_estimate"], "local_bytes": local_bytes,
                         "entries_ingested": counters["entries_ingested"],
                         "async_ms": round((time.monotonic() - started) * 1000, 3)}
                self._driver("state.ack", name=opened.name, checkpoint_id=cid, handle=result.handle.to_json(),
                             uploaded=list(result.uploaded), merged=list(result.merged), agent=self.agent_id,
                             stats=stats, attempt=opened.attempt)
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
                self._driver("state.fail", name=opened.name, checkpoint_id=cid, subtask=subtask,
                             message=f"{type(exc).__name__}: {exc}", attempt=opened.attempt, agent=self.agent_id,
                             others=others)
            except Exception as exc2:  # noqa: BLE001 - best effort: unreported, the checkpoint aborts at its timeout
                log.warning("reporting the failed upload of %s failed: %s", opened.name, exc2)
            finally:
                finished()

        merge = None
        opts = opened.merging
        if opts.enabled:
            storage = opened.storage
            target = storage.local_target if opts.mode is MergingMode.ACROSS else None
            with self._lock:
                self._names[storage.url] = opened.name

            def merge(name: str, local: Path, checksum: str) -> Any:
                seg = self.merger.append(storage.url, opened.checkpoint_id, opts, name, local, checksum,
                                         put=storage.put_file, target=target)
                self._wake.set()
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
        return {}

    def _working(self) -> tuple[list[dict[str, Any]], dict[str, tuple[str, int]]]:
        """The subtasks open here (their task runs) or uploading (their ack is still to come), and
        the opens among them (token -> state, checkpoint)."""
        with self._lock:
            opens = {t: (o.name, o.checkpoint_id) for t, o in self._open.items()}
            busy = {(o.name, o.checkpoint_id, o.subtask) for o in self._open.values()}
            busy.update(self._uploading.values())
        return [{"name": n, "checkpoint_id": c, "subtask": s} for n, c, s in sorted(busy)], opens

    # --- file merging: seal or discard the pools the driver agent decides on -------------------
    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._expire()
            pools = [(url, cid) for url, cid in self.merger.pending() if (url, cid) not in self._sealing]
            closed = self.merger.drain_closed()
            working, opens = self._working()
            if not pools and not closed:
                if working:   # a heartbeat: the driver agent learns this agent still works on them
                    try:
                        beat = self._driver("state.merge_poll", agent=self.agent_id, wait=0, working=working)
                    except Exception as exc:  # noqa: BLE001 - the driver agent is busy or gone
                        log.debug("heartbeat to the driver agent failed: %s", exc)
                    else:
                        self._release_stale(beat, opens)
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            with self._lock:
                names = dict(self._names)
            try:
                reply = self._driver("state.merge_poll", agent=self.agent_id, wait=1.0, working=working,
                                     pools=[{"name": names[u], "checkpoint_id": c} for u, c in pools if u in names],
                                     closed=[{"name": names[u], "path": p} for u, p in closed if u in names])
            except Exception as exc:  # noqa: BLE001 - the driver agent is busy or gone; try again
                log.warning("file-merging poll of the driver agent failed: %s", exc)
                self._stop.wait(1.0)
                continue
            self._release_stale(reply, opens)
            urls = {n: u for u, n in names.items()}
            for a in reply.get("actions", []):
                url = urls.get(a.get("name"))
                cid = a.get("checkpoint_id")
                if url is None or not isinstance(cid, int):
                    continue
                if a.get("action") == "discard":
                    self.merger.discard(url, cid)
                elif a.get("action") == "seal":
                    with self._lock:
                        self._sealing.add((url, cid))
                    threading.Thread(target=self._seal, args=(a["name"], url, cid, a.get("attempt")), daemon=True,
                                     name=f"steward-seal-{cid}").start()

    def _seal(self, name: str, url: str, cid: int, attempt: str) -> None:
        try:
            files = self.merger.seal(url, cid)
            self._driver("state.sealed", name=name, checkpoint_id=cid, agent=self.agent_id, attempt=attempt,
                         files=[{"path": f.path, "size": f.size} for f in files])
        except Exception as exc:  # noqa: BLE001 - the coordinator aborts the checkpoint
            log.warning("sealing checkpoint %d of %s failed: %s", cid, name, exc)
            self.merger.discard(url, cid)
            try:
                self._driver("state.fail", name=name, checkpoint_id=cid, agent=self.agent_id, attempt=attempt,
                             message=f"sealing merged files failed: {type(exc).__name__}: {exc}")
            except Exception as exc2:  # noqa: BLE001 - best effort: unreported, the checkpoint aborts at its timeout
                log.warning("reporting the failed seal of %s failed: %s", name, exc2)
        finally:
            with self._lock:
                self._sealing.discard((url, cid))
            self._wake.set()

    def _op_release(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        token = f.text("token", max_len=64)
        with self._lock:
            opened = self._open.pop(token, None)
        if opened is not None:
            opened.delete()
        return {"released": opened is not None}

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
        self._stop.set()
        self._wake.set()
        self._poller.join(timeout=5)
        self._link.close()
        self.merger.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _size_of(directory: Path) -> int:
    """The bytes of the regular files directly in ``directory`` (0 if it is missing)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0
