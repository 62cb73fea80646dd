"""The driver agent's side of keyed state: one :class:`CheckpointCoordinator` per state, behind the
``state.*`` socket ops (issue 8).

Ops (every request names its state with ``name``)::

    state.register  checkpoint_dir, parallelism, max_parallelism, key_type, num_retained
                    -> the coordinator (created once per name; a second register must agree, except
                    that another parallelism rescales from the next checkpoint on; another
                    max_parallelism is refused). rescaled_from: the latest checkpoint's parallelism
                    when the next checkpoint rescales from it
    state.begin     checkpoint_id (null: the next after the last completed one), parallelism (of the
                    caller's routing: refused when the state was rescaled since) -> id, rerun
    state.base      checkpoint_id -> the base every attempt restores (begins N if it is not pending:
                    a second action on a lazy output after commit re-runs N from the same base)
    state.ack       checkpoint_id, handle, uploaded, stats (from executor agents, after the async phase)
    state.fail      checkpoint_id, subtask, message   (an upload failed: commit aborts)
    state.commit    checkpoint_id, wait -> waits for every ack, completes (``_metadata``), subsumes,
                    returns the checkpoint's stats;
                    on a failure or when the wait runs out the checkpoint is aborted and an error raised
    state.abort     checkpoint_id -> files deleted
    state.info      -> last completed, retained, pending, the latest completed metadata, parallelism,
                    and per checkpoint (acked in this application) the files and bytes uploaded and
                    reused and each subtask's restore (old subtasks and files read, bytes downloaded)

Thread-safe: requests run on connection threads; one condition guards the acks and failures.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sparksteward.checkpoint.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.records import SubtaskHandle
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage, checkpoint_dir_name
from sparksteward.errors import CheckpointError, CheckpointOrderError, InvalidRequestError, ParallelismError
from sparksteward.ids import validate_id
from sparksteward.wire import AgentServer, Connection, Fields

__all__ = ["StateService"]

log = logging.getLogger("sparksteward.checkpoint.service")

_MAX_WAIT = 7 * 86400.0
_MAX_ID = (1 << 62)
_MAX_STATS = 1000  # checkpoints whose per-subtask ack stats state.info keeps


@dataclass
class _State:
    coordinator: CheckpointCoordinator
    checkpoint_dir: str
    failures: dict[int, list[str]] = field(default_factory=dict)
    stats: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # checkpoint -> subtask -> ack stats


class StateService:
    """The coordinators of an application's keyed states (hosted by the driver agent)."""

    def __init__(self, default_checkpoint_dir: str, cluster_id: str, *, commit_timeout: float = 600.0) -> None:
        self.default_checkpoint_dir = default_checkpoint_dir
        self.cluster_id = cluster_id
        self.commit_timeout = commit_timeout
        self._states: dict[str, _State] = {}
        self._cond = threading.Condition()

    def register_handlers(self, server: AgentServer) -> None:
        for op, fn in {"state.register": self._op_register, "state.begin": self._op_begin,
                       "state.base": self._op_base, "state.ack": self._op_ack, "state.fail": self._op_fail,
                       "state.commit": self._op_commit, "state.abort": self._op_abort,
                       "state.info": self._op_info}.items():
            server.add_handler(op, fn)

    # --- helpers -----------------------------------------------------------------------------
    def _state(self, f: Fields) -> tuple[str, _State]:
        name = f.text("name", max_len=200)
        with self._cond:
            st = self._states.get(name)
        if st is None:
            raise CheckpointError(f"keyed state {name!r} is not registered with the driver agent: create it "
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
        return {"checkpoint_id": cid, "rerun": begun.rerun, "checkpoint_dir": st.checkpoint_dir,
                "cluster_id": self.cluster_id, "parallelism": c.parallelism, "max_parallelism": c.max_parallelism,
                "key_type": c.key_type.value, "base": None if begun.base is None else begun.base.to_json(),
                "known": dict(begun.known)}

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
        with self._cond:
            st = self._states.get(name)
            if st is not None:
                c = st.coordinator
                if max_parallelism != c.max_parallelism:
                    raise ParallelismError(
                        f"keyed state {name!r} has max_parallelism={c.max_parallelism} and cannot be opened with "
                        f"max_parallelism={max_parallelism}: the max parallelism fixes the key groups and cannot "
                        f"change. Keep max_parallelism={c.max_parallelism} (any parallelism up to it works), or "
                        f"use another state name")
                if (checkpoint_dir, key_type) != (st.checkpoint_dir, c.key_type.value):
                    raise CheckpointError(
                        f"keyed state {name!r} is already open in this application with checkpoint_dir="
                        f"{st.checkpoint_dir!r}, parallelism={c.parallelism}, max_parallelism={c.max_parallelism}, "
                        f"key type {c.key_type.value}; open it with the same settings or use another name")
                if parallelism != c.parallelism:  # a rescale between batches: the next checkpoint rebuilds
                    c.rescale(parallelism)
            else:
                storage = CheckpointStorage.open(checkpoint_dir, name, self.cluster_id)
                coord = CheckpointCoordinator(storage, parallelism, max_parallelism, key_type=key_type,
                                              num_retained=num_retained)
                st = self._states[name] = _State(coord, checkpoint_dir)
                log.info("keyed state %s registered (P=%d, M=%d, %s keys, %s)", name, parallelism,
                         max_parallelism, key_type, storage.url)
            latest = max(st.coordinator.retained(), default=None)
            checkpointed = None if latest is None else st.coordinator.completed(latest).parallelism
        # rescaled_from: the parallelism of the latest checkpoint, when the next one rescales from it
        return {"last_completed": st.coordinator.last_completed, "url": st.coordinator.storage.url,
                "rescaled_from": checkpointed if checkpointed not in (None, parallelism) else None}

    def _op_begin(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        parallelism = f.integer("parallelism", default=None, lo=1, hi=32768)
        with self._cond:
            if parallelism is not None and parallelism != st.coordinator.parallelism:
                raise ParallelismError(
                    f"keyed state {st.coordinator.storage.state!r} now has parallelism "
                    f"{st.coordinator.parallelism} (it was opened again with that parallelism), but this "
                    f"KeyedState object routes rows to {parallelism} subtasks: use the object returned by the "
                    f"latest st.keyed_state(...) call")
            cid = self._checkpoint_id(f, st)
            begun = st.coordinator.begin(cid)
            st.failures.pop(cid, None)
            if not begun.rerun:
                st.stats.pop(cid, None)
        return {"checkpoint_id": cid, "rerun": begun.rerun}

    def _op_base(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        with self._cond:  # one begin per checkpoint, even when every task asks at once
            if cid in st.coordinator.pending():
                begun = st.coordinator.base(cid)
            else:
                begun = st.coordinator.begin(cid)
                st.failures.pop(cid, None)
                if not begun.rerun:
                    st.stats.pop(cid, None)
        return self._reply_base(st, cid, begun)

    def _op_ack(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        handle = SubtaskHandle.from_json(f.mapping("handle"))
        uploaded = req.get("uploaded") or []
        if not isinstance(uploaded, list) or not all(isinstance(p, str) for p in uploaded):
            raise InvalidRequestError(f"{f.op}: field 'uploaded' must be a list of paths")
        stats = f.mapping("stats", default=None)
        with self._cond:
            st.coordinator.ack(cid, handle, tuple(uploaded))
            if stats is not None and cid not in st.coordinator.retained():  # a re-run keeps the first stats
                per = st.stats.setdefault(cid, {})
                per[handle.subtask] = stats
                while len(st.stats) > _MAX_STATS:
                    del st.stats[min(st.stats)]
            self._cond.notify_all()
        return {}

    def _op_fail(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        subtask = f.integer("subtask", lo=0)
        message = f.text("message", default="")
        with self._cond:
            st.failures.setdefault(cid, []).append(f"subtask {subtask}: {message}")
            self._cond.notify_all()
        return {}

    def _op_commit(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        name, st = self._state(f)
        wait = f.number("wait", default=None, lo=0, hi=_MAX_WAIT)
        wait = self.commit_timeout if wait is None else wait
        deadline = time.monotonic() + wait
        with self._cond:
            cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID, default=None)
            if cid is None:
                pending = st.coordinator.pending()
                if not pending:
                    raise CheckpointOrderError(f"keyed state {name!r} has no pending checkpoint to commit")
                cid = pending[-1]
            while True:
                failures = st.failures.get(cid)
                if failures:
                    st.coordinator.abort(cid)
                    st.failures.pop(cid, None)
                    st.stats.pop(cid, None)
                    raise CheckpointError(f"checkpoint {cid} of keyed state {name!r} was aborted: uploads failed "
                                          f"({'; '.join(failures)})")
                try:
                    meta = st.coordinator.complete(cid)
                    break
                except CheckpointOrderError:
                    raise
                except CheckpointError as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        deleted = st.coordinator.abort(cid)
                        st.stats.pop(cid, None)
                        raise CheckpointError(f"{exc}; waited {wait:g} s, so checkpoint {cid} was aborted "
                                              f"({deleted} uploaded files deleted). Apply the batch again "
                                              f"with the same checkpoint_id") from None
                    self._cond.wait(min(left, 1.0))
            stats = _summary(cid, st.stats.get(cid, {}))
        return {"checkpoint_id": cid, "metadata": meta.to_json(), "retained": st.coordinator.retained(),
                "path": st.coordinator.storage.url_of(checkpoint_dir_name(cid)), "stats": stats}

    def _op_abort(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        cid = f.integer("checkpoint_id", lo=0, hi=_MAX_ID)
        with self._cond:
            deleted = st.coordinator.abort(cid)
            st.failures.pop(cid, None)
            st.stats.pop(cid, None)
        return {"deleted": deleted}

    def _op_info(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self._state(f)
        c = st.coordinator
        with self._cond:
            last = c.last_completed
            latest = max((i for i in c.retained()), default=None)
            meta = c.completed(latest).to_json() if latest is not None else None
            return {"last_completed": last, "retained": c.retained(), "pending": c.pending(),
                    "restored": RESTORED in c.retained(), "url": c.storage.url, "latest": meta,
                    "checkpoint_dir": st.checkpoint_dir, "cluster_id": self.cluster_id,
                    "parallelism": c.parallelism, "max_parallelism": c.max_parallelism,
                    "checkpoints": [_summary(cid, st.stats[cid]) for cid in sorted(st.stats)
                                    if cid not in c.pending()]}


def _summary(checkpoint_id: int, per_subtask: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint's stats, summed over the subtasks' acks, with each subtask's restore."""
    acks = [per_subtask[i] for i in sorted(per_subtask)]

    def total(key: str) -> int:
        return sum(int(a.get(key) or 0) for a in acks)

    return {"checkpoint_id": checkpoint_id, "subtasks": len(acks), "files_uploaded": total("files_uploaded"),
            "bytes_uploaded": total("bytes_uploaded"), "files_reused": total("files_reused"),
            "files": total("files"), "bytes": total("bytes"),
            "sync_ms_max": max((float(a.get("sync_ms") or 0) for a in acks), default=0.0),
            "sync_ms": [float(a.get("sync_ms") or 0) for a in acks],  # per subtask, in subtask order
            "restores": [a["restore"] for a in acks if a.get("restore")]}


def default_checkpoint_dir(cfg: Any) -> str:
    """``spark.steward.checkpoint.dir``, else ``<state-dir>/checkpoints``."""
    return cfg.checkpoint_dir or os.path.join(os.path.expanduser(cfg.effective_state_dir), "checkpoints")
