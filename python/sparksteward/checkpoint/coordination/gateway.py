"""The ops executor agents call on the driver agent for keyed state: the gateway between the
subtasks and each state's :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`
(Flink's ``CheckpointCoordinatorGateway``). The driver's own ops (register, begin, commit, ...) are
:class:`~sparksteward.checkpoint.coordination.driver_service.StateService`'s; both share one
:class:`~sparksteward.checkpoint.coordination.registration.StateTable`.

Ops (every request names its state with ``name``)::

    state.base      checkpoint_id, subtask, agent, parallelism -> the base every attempt restores
                    (begins N if it is not pending: a second action on a lazy output after commit
                    re-runs N from the same base; an aborted N is refused, only state.begin restarts
                    it). ``agent`` (the executor agent opening ``subtask``) is then expected to ack it
    state.cut       checkpoint_id, subtask, cut, overflow -> the cut that stands (FLIP-76)
    state.ack       checkpoint_id, attempt, handle, uploaded, merged, stats (after the async phase)
                    -> result (acked, or replaced: another copy of the subtask acked before); an ack
                    of another attempt than the current one is refused
    state.fail      checkpoint_id, attempt, subtask, message (an upload or a seal failed: commit aborts),
                    ignored when its attempt is over or another copy of the subtask acked
    state.merge_poll agent, pools [{name, checkpoint_id}], closed [{name, path}], working [{name,
                    checkpoint_id, subtask}], wait
                    -> actions [{name, checkpoint_id, action: seal|wait|discard, attempt (seal)}] (FLIP-306:
                    an executor agent holding unsealed merged files long-polls; once every subtask
                    acked, it seals them. The polls are its heartbeat, sent too while it has subtasks
                    open or uploading (``working``): when an agent holding merged files a pending
                    checkpoint needs, or the agent that opened a subtask not acked yet, goes silent
                    for agent_timeout, commit aborts the checkpoint, since that upload will never come)
    state.sealed    name, checkpoint_id, agent, attempt, files [{path, size}] (merged files now durable;
                    a seal of a replaced attempt records nothing)

Thread-safe: requests run on connection threads; each state's lock guards its coordinator, and an
agent's heartbeat is recorded when its request arrives, so no state's I/O can make it look silent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from sparksteward.checkpoint.coordination.coordinator import BeginResult
from sparksteward.checkpoint.messages import BaseReply
from sparksteward.checkpoint.records import SubtaskHandle
from sparksteward.checkpoint.coordination.registration import RegisteredState, StateTable
from sparksteward.checkpoint.coordination.stats import SubtaskStats
from sparksteward.errors import InvalidRequestError, ParallelismError
from sparksteward.wire import AgentServer, Connection, Fields

__all__ = ["MAX_ID", "CheckpointGateway"]

log = logging.getLogger("sparksteward.checkpoint.coordination.gateway")

MAX_ID = (1 << 62)   # the largest checkpoint id a request may name


class CheckpointGateway:
    """The ``state.*`` ops of executor agents (see the module docstring)."""

    def __init__(self, table: StateTable, cluster_id: str) -> None:
        self.table = table
        self.cluster_id = cluster_id
        self.bases_sent: Counter[str] = Counter()   # state.base replies: "full", or "same" (base left out)

    def register_handlers(self, server: AgentServer) -> None:
        for op, fn in {"state.base": self._op_base, "state.ack": self._op_ack, "state.fail": self._op_fail,
                       "state.merge_poll": self._op_merge_poll, "state.sealed": self._op_sealed,
                       "state.cut": self._op_cut}.items():
            server.add_handler(op, fn)

    def _reply_base(self, st: RegisteredState, cid: int, begun: BeginResult, cut: int | None) -> BaseReply:
        c = st.coordinator
        alignment = st.overrides.get(cid, st.alignment)   # a drain: aligned, whatever the state's alignment
        return BaseReply(
            checkpoint_id=cid, attempt=begun.attempt, rerun=begun.rerun, checkpoint_dir=st.checkpoint_dir,
            cluster_id=self.cluster_id, parallelism=c.parallelism, max_parallelism=c.max_parallelism,
            key_type=c.key_type.value, base=begun.base, known=dict(begun.known), merging=c.merging.to_json(),
            alignment=alignment.to_json(), deadline_in=self._deadline_in(st, cid) if alignment.unaligned else None,
            cut=cut)

    @staticmethod
    def _deadline_in(st: RegisteredState, cid: int) -> float | None:
        """Seconds until checkpoint ``cid``'s subtasks defer their input (unaligned), counted from the
        start of its state stage: the first task's open of the attempt. Late waves get less; the
        caller turns it into a deadline on its own clock (no cross-host clock comparison)."""
        alignment = st.overrides.get(cid, st.alignment)
        if not alignment.unaligned:
            return None
        started = st.coordinator.stage_started(cid)
        return max(0.0, alignment.aligned_checkpoint_timeout - (time.monotonic() - started))

    def _op_cut(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        """FLIP-76: a subtask proposes where its attempt stops processing new input (``cut``, a key
        group) and gets the cut that stands; ``overflow``: its channel state at that cut passes the byte
        cap, so it processes everything."""
        f = Fields(req)
        _, st = self.table.lookup(f)
        cid = f.integer("checkpoint_id", lo=0, hi=MAX_ID)
        subtask = f.integer("subtask", lo=0, hi=32768)
        proposed = f.integer("cut", lo=0, hi=32768)
        if f.integer("overflow", default=0, lo=0, hi=1):
            return {"cut": st.coordinator.amend_cut(cid, subtask, proposed)}
        return {"cut": st.coordinator.cut(cid, subtask, proposed)}

    def _op_base(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self.table.lookup(f)
        cid = f.integer("checkpoint_id", lo=0, hi=MAX_ID)
        subtask = f.integer("subtask", default=None, lo=0, hi=32768)
        agent = f.text("agent", default="", max_len=200)
        routed = f.integer("parallelism", default=None, lo=1, hi=32768)
        have = f.text("have", default="", max_len=64)   # the attempt whose base the agent holds
        if routed is not None and routed != st.coordinator.parallelism:
            raise ParallelismError(
                f"the rows of checkpoint {cid} of keyed state {st.coordinator.storage.state!r} were routed to {routed} "
                f"subtasks, but the state now has parallelism {st.coordinator.parallelism} (it was opened again with "
                f"another parallelism): apply the batch again with the KeyedState of the latest st.keyed_state(...) call")
        self.table.heard(agent)
        with st.lock:  # one begin per checkpoint, even when every task asks at once
            if cid in st.coordinator.pending():
                begun = st.coordinator.base(cid)
            else:  # a second action after commit re-runs N; an aborted N is refused (see begin)
                begun = st.coordinator.begin(cid, by_task=True)
            if agent and subtask is not None:
                st.coordinator.working_on(cid, subtask, agent)
        cut = None if subtask is None else st.coordinator.cut(cid, subtask)   # FLIP-76: recorded by an earlier attempt
        reply = self._reply_base(st, cid, begun, cut)
        full = not have or have != begun.attempt
        self.bases_sent["full" if full else "same"] += 1
        return reply.to_json(with_base=full)

    def _op_ack(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self.table.lookup(f)
        cid = f.integer("checkpoint_id", lo=0, hi=MAX_ID)
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
        self.table.heard(agent)
        with st.lock:
            result = st.coordinator.ack(cid, handle, tuple(uploaded), tuple(merged), agent, attempt=attempt,
                                        stats=stats)
        self.table.notify()
        return {"result": result.value}

    def _op_fail(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self.table.lookup(f)
        cid = f.integer("checkpoint_id", lo=0, hi=MAX_ID)
        subtask = f.integer("subtask", lo=0, default=None)
        message = f.text("message", default="")
        attempt = f.text("attempt", max_len=64)
        agent = f.text("agent", default="", max_len=200)
        others = f.integer("others", default=0, lo=0, hi=1 << 20)   # copies of the subtask still at work there
        who = f"subtask {subtask}" if subtask is not None else f"executor agent {agent or '?'}"
        with st.lock:
            ignored = st.coordinator.fail(cid, attempt, who, message, subtask, agent=agent, others=others)
        if ignored is not None:
            log.info("ignoring a failure report of %s for checkpoint %d of %s: %s (%s)",
                     who, cid, st.coordinator.storage.state, ignored, message)
            return {"ignored": True}
        self.table.notify()
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
            asked.append((pf.text("name", max_len=200), pf.integer("checkpoint_id", lo=0, hi=MAX_ID)))
        busy = []
        for w in working:
            wf = _sub(f, w)
            busy.append((wf.text("name", max_len=200), wf.integer("checkpoint_id", lo=0, hi=MAX_ID),
                         wf.integer("subtask", lo=0, hi=32768)))
        self.table.heard(agent)   # on arrival: a state busy with storage I/O never makes an agent look silent
        by_name: dict[str, set[str]] = {}
        for c in closed:
            cf = _sub(f, c)
            by_name.setdefault(cf.text("name", max_len=200), set()).add(cf.text("path", max_len=300))
        states = self.table.all()
        for name, cid, subtask in busy:
            if name in states:
                with states[name].lock:
                    states[name].coordinator.working_on(cid, subtask, agent)
        for name, paths in by_name.items():
            if name in states:
                with states[name].lock:
                    states[name].coordinator.files_closed(agent, paths)
        deadline = time.monotonic() + wait
        generation = self.table.generation()
        while True:
            actions = [self._seal_action(states, n, c) for n, c in asked]
            left = deadline - time.monotonic()
            if left <= 0 or any(a["action"] != "wait" for a in actions):
                break
            generation = self.table.wait(generation, left)
        self.table.heard(agent)
        pending = {n: set(states[n].coordinator.pending()) for n, _, _ in busy if n in states}
        stale = sorted({(n, c) for n, c, _ in busy if n in pending and c not in pending[n]})
        # the agent releases what it still holds open of those (a task killed before its upload)
        return {"actions": actions, "stale": [{"name": n, "checkpoint_id": c} for n, c in stale]}

    @staticmethod
    def _seal_action(states: dict[str, RegisteredState], name: str, cid: int) -> dict[str, Any]:
        """What the agent does with its pool of ``cid``; a seal carries the attempt it is for."""
        st = states.get(name)
        action = "discard" if st is None else st.coordinator.seal_wanted(cid)
        out: dict[str, Any] = {"name": name, "checkpoint_id": cid, "action": action}
        if st is not None and action == "seal":
            out["attempt"] = st.coordinator.attempt(cid)
        return out

    def _op_sealed(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        _, st = self.table.lookup(f)
        cid = f.integer("checkpoint_id", lo=0, hi=MAX_ID)
        agent = f.text("agent", max_len=200)
        attempt = f.text("attempt", max_len=64)
        files = req.get("files")
        if not isinstance(files, list) or len(files) > 100_000:
            raise InvalidRequestError(f"{f.op}: field 'files' must be a list of {{path, size}}")
        sealed = {}
        for x in files:
            xf = _sub(f, x)
            sealed[xf.text("path", max_len=300)] = xf.integer("size", lo=0)
        self.table.heard(agent)
        with st.lock:
            st.coordinator.sealed(cid, sealed, agent, attempt)
        self.table.notify()
        return {}


def _sub(f: Fields, item: Any) -> Fields:
    """Typed access to one element of a list field, named after the request's op."""
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{f.op}: list element {str(item)[:80]!r} is not an object")
    return Fields({**item, "op": f.op})
