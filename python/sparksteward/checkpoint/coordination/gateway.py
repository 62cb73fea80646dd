"""The ops executor agents call on the driver agent for keyed state: the gateway between the
subtasks and each state's :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`
(Flink's ``CheckpointCoordinatorGateway``). The driver's own ops (register, begin, commit, ...) are
:class:`~sparksteward.checkpoint.coordination.driver_service.StateService`'s; both share one
:class:`~sparksteward.checkpoint.coordination.registration.StateTable`.

Ops (their typed requests and replies, each described, are in :mod:`sparksteward.checkpoint.messages`)::

    state.base       BaseRequest -> BaseReply            the base every attempt of a checkpoint restores
    state.cut        CutRequest -> CutReply              FLIP-76: the cut that stands
    state.ack        AckRequest -> AckReply              a subtask's upload, with its stats
    state.fail       FailRequest -> FailReply            an upload or a seal failed: commit aborts
    state.merge_poll MergePollRequest -> MergePollReply  FLIP-306: seal, wait or discard; the heartbeat
    state.sealed     SealedRequest -> SealedReply        merged files now durable

Thread-safe: requests run on connection threads; each state's coordinator takes its own lock (the only
lock of its checkpoint protocol: no op here takes the service's per-state lock), and an
agent's heartbeat is recorded when its request arrives, so no state's I/O can make it look silent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

from sparksteward.checkpoint.begun import Cut
from sparksteward.checkpoint.coordination.coordinator import BeginResult
from sparksteward.checkpoint.coordination.registration import RegisteredState, StateTable
from sparksteward.checkpoint.messages import (
    AckReply,
    AckRequest,
    BaseReply,
    BaseRequest,
    CheckpointRef,
    CutReply,
    CutRequest,
    FailReply,
    FailRequest,
    MergePollReply,
    MergePollRequest,
    SealAction,
    SealedReply,
    SealedRequest,
)
from sparksteward.errors import ParallelismError
from sparksteward.wire import MAX_CHECKPOINT_ID, AgentServer, Connection

__all__ = ["MAX_ID", "CheckpointGateway"]

log = logging.getLogger("sparksteward.checkpoint.coordination.gateway")

MAX_ID = MAX_CHECKPOINT_ID   # the largest checkpoint id a request may name


class CheckpointGateway:
    """The ``state.*`` ops of executor agents (see the module docstring)."""

    def __init__(self, table: StateTable, cluster_id: str) -> None:
        self.table = table
        self.cluster_id = cluster_id
        self.bases_sent: Counter[str] = Counter()   # state.base replies: "full", or "same" (base left out)

    def register_handlers(self, server: AgentServer) -> None:
        server.serve(BaseRequest, self._op_base)
        server.serve(AckRequest, self._op_ack)
        server.serve(FailRequest, self._op_fail)
        server.serve(MergePollRequest, self._op_merge_poll)
        server.serve(SealedRequest, self._op_sealed)
        server.serve(CutRequest, self._op_cut)

    def _reply_base(self, st: RegisteredState, cid: int, begun: BeginResult, cut: Cut | None) -> BaseReply:
        c = st.coordinator
        alignment = st.overrides.get(cid, st.alignment)   # a drain: aligned, whatever the state's alignment
        return BaseReply(
            checkpoint_id=cid, attempt=begun.attempt, rerun=begun.rerun, checkpoint_dir=st.checkpoint_dir,
            cluster_id=self.cluster_id, parallelism=c.parallelism, max_parallelism=c.max_parallelism,
            key_type=c.key_type.value, base=begun.base, known=dict(begun.known), merging=c.merging.to_json(),
            alignment=alignment.to_json(), deadline_in=self._deadline_in(st, cid) if alignment.unaligned else None,
            cut=None if cut is None else cut.group, cut_rows=0 if cut is None else cut.rows)

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

    def _op_cut(self, conn: Connection, req: CutRequest) -> CutReply:
        """FLIP-76: a subtask proposes where its attempt stops processing new input (``cut``, a key
        group, after ``rows`` of its rows) and gets the cut that stands; ``overflow``: its channel state at
        that cut passes the byte cap, so it processes everything."""
        _, st = self.table.lookup(req.name)
        cid, subtask, proposed = req.checkpoint_id, req.subtask, Cut(req.cut, req.rows)
        stands = st.coordinator.amend_cut(cid, subtask, proposed) if req.overflow else \
            st.coordinator.cut(cid, subtask, proposed)
        assert stands is not None   # the proposal stands unless another attempt's cut does
        return CutReply(stands.group, stands.rows)

    def _op_base(self, conn: Connection, req: BaseRequest) -> BaseReply:
        _, st = self.table.lookup(req.name)
        cid, subtask, agent, routed = req.checkpoint_id, req.subtask, req.agent, req.parallelism
        have = req.have   # the attempt whose base the agent holds
        if routed is not None and routed != st.coordinator.parallelism:
            raise ParallelismError(
                f"the rows of checkpoint {cid} of keyed state {st.coordinator.storage.state!r} were routed to {routed} "
                f"subtasks, but the state now has parallelism {st.coordinator.parallelism} (it was opened again with "
                f"another parallelism): apply the batch again with the KeyedState of the latest st.keyed_state(...) call")
        self.table.heard(agent)
        # base, or begin (once, even when every task asks at once: a second action after commit re-runs N;
        # an aborted N is refused), and note the agent at work, in one step of the coordinator
        begun = st.coordinator.open_subtask(cid, subtask, agent)
        cut = None if subtask is None else st.coordinator.cut(cid, subtask)   # FLIP-76: recorded by an earlier attempt
        reply = self._reply_base(st, cid, begun, cut)
        full = not have or have != begun.attempt
        self.bases_sent["full" if full else "same"] += 1
        return reply if full else replace(reply, same_base=True)

    def _op_ack(self, conn: Connection, req: AckRequest) -> AckReply:
        _, st = self.table.lookup(req.name)
        cid, agent = req.checkpoint_id, req.agent
        self.table.heard(agent)
        result = st.coordinator.ack(cid, req.handle, tuple(req.uploaded), tuple(req.merged), agent,
                                    attempt=req.attempt, stats=req.stats)
        self.table.notify()
        return AckReply(result.value)

    def _op_fail(self, conn: Connection, req: FailRequest) -> FailReply:
        _, st = self.table.lookup(req.name)
        cid, subtask, message, attempt, agent = req.checkpoint_id, req.subtask, req.message, req.attempt, req.agent
        others = req.others   # copies of the subtask still at work there
        who = f"subtask {subtask}" if subtask is not None else f"executor agent {agent or '?'}"
        ignored = st.coordinator.fail(cid, attempt, who, message, subtask, agent=agent, others=others)
        if ignored is not None:
            log.info("ignoring a failure report of %s for checkpoint %d of %s: %s (%s)",
                     who, cid, st.coordinator.storage.state, ignored, message)
            return FailReply(ignored=True)
        self.table.notify()
        return FailReply(ignored=False)

    def _op_merge_poll(self, conn: Connection, req: MergePollRequest) -> MergePollReply:
        agent, wait = req.agent, req.wait
        asked = [(p.name, p.checkpoint_id) for p in req.pools]
        busy = [(w.name, w.checkpoint_id, w.subtask) for w in req.working]
        self.table.heard(agent)   # on arrival: a state busy with storage I/O never makes an agent look silent
        by_name: dict[str, set[str]] = {}
        for c in req.closed:
            by_name.setdefault(c.name, set()).add(c.path)
        states = self.table.all()
        for name, cid, subtask in busy:
            if name in states:
                states[name].coordinator.working_on(cid, subtask, agent)
        for name, paths in by_name.items():
            if name in states:
                states[name].coordinator.files_closed(agent, paths)
        deadline = time.monotonic() + wait
        generation = self.table.generation()
        while True:
            actions = [self._seal_action(states, n, c) for n, c in asked]
            left = deadline - time.monotonic()
            if left <= 0 or any(a.action != "wait" for a in actions):
                break
            generation = self.table.wait(generation, left)
        self.table.heard(agent)
        pending = {n: set(states[n].coordinator.pending()) for n, _, _ in busy if n in states}
        stale = sorted({(n, c) for n, c, _ in busy if n in pending and c not in pending[n]})
        # the agent releases what it still holds open of those (a task killed before its upload)
        return MergePollReply(actions, [CheckpointRef(n, c) for n, c in stale])

    @staticmethod
    def _seal_action(states: dict[str, RegisteredState], name: str, cid: int) -> SealAction:
        """What the agent does with its pool of ``cid``; a seal carries the attempt it is for."""
        st = states.get(name)
        action = "discard" if st is None else st.coordinator.seal_wanted(cid)
        attempt = st.coordinator.attempt(cid) if st is not None and action == "seal" else None
        return SealAction(name, cid, action, attempt)

    def _op_sealed(self, conn: Connection, req: SealedRequest) -> SealedReply:
        _, st = self.table.lookup(req.name)
        cid, agent, attempt = req.checkpoint_id, req.agent, req.attempt
        sealed = {x.path: x.size for x in req.files}
        self.table.heard(agent)
        st.coordinator.sealed(cid, sealed, agent, attempt)
        self.table.notify()
        return SealedReply()
