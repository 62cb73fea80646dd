"""The executor agent's merge-seal poller (FLIP-306, issue 9): one thread that seals or discards the
agent's pools of merged files as the driver agent decides, and is the agent's heartbeat.

While any :class:`~sparksteward.checkpoint.filemerging.file_merger.FileMerger` pool holds unsealed files,
the thread long-polls the driver agent (``state.merge_poll``): once every subtask of the checkpoint has
acked, it seals the pool (``state.sealed``, on a thread of its own), and it discards a pool whose
checkpoint was aborted. While the agent has subtasks open or uploading (``working``) it polls every
second too, so that commit aborts promptly when this agent dies before its acks (SIGKILL mid-upload)
instead of waiting for the commit timeout; the reply names the checkpoints no longer pending, whose
opens the agent releases (a task killed between open and upload). Each round also releases the opens
past the open timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from sparksteward.checkpoint.filemerging.file_merger import FileMerger
from sparksteward.checkpoint.messages import (
    CheckpointRef,
    ClosedFile,
    FailRequest,
    MergePollReply,
    MergePollRequest,
    SealedFile,
    SealedRequest,
    WorkingSubtask,
)
from sparksteward.wire.messages import Message

__all__ = ["SealPoller", "Subtasks"]

log = logging.getLogger("sparksteward.checkpoint.task.seal_poller")


class Subtasks(Protocol):
    """What the poller needs of the agent's subtasks
    (:class:`~sparksteward.checkpoint.task.task_state.SubtaskService`)."""

    def expire(self) -> None:
        """Release the opens older than the open timeout."""

    def working(self) -> tuple[list[WorkingSubtask], dict[str, tuple[str, int]]]:
        """The subtasks open or uploading here, and the opens among them (token -> state, checkpoint)."""

    def release(self, tokens: list[str], why: str) -> None:
        """Release the opens ``tokens`` that are still open."""


class SealPoller:
    """The poll thread of one executor agent (see the module docstring); ``ask`` sends a typed request
    to the driver agent and returns its typed reply.

    Thread-safe: :meth:`track` and :meth:`wake` are called from upload threads. :meth:`close` stops the
    thread (seals already started finish on their own threads).
    """

    def __init__(self, merger: FileMerger, subtasks: Subtasks, ask: Callable[[Message], Any], agent_id: str,
                 interval: float = 1.0) -> None:
        self.merger = merger
        self.interval = interval   # seconds between heartbeats (and a poll's longest wait at the driver)
        self.subtasks = subtasks
        self.agent_id = agent_id
        self._ask = ask
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}              # checkpoint root URL -> state name
        self._sealing: set[tuple[str, int]] = set()   # (root URL, checkpoint) being sealed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="steward-merge-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def track(self, url: str, name: str) -> None:
        """The pools of checkpoint root ``url`` are those of state ``name``."""
        with self._lock:
            self._names[url] = name

    def wake(self) -> None:
        """Poll now: a pool got a file."""
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait up to ``timeout`` for it. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.subtasks.expire()
            with self._lock:
                pools = [(url, cid) for url, cid in self.merger.pending() if (url, cid) not in self._sealing]
            closed = self.merger.drain_closed()
            working, opens = self.subtasks.working()
            if not pools and not closed:
                if working:   # a heartbeat: the driver agent learns this agent still works on them
                    try:
                        beat = self._ask(MergePollRequest(self.agent_id, wait=0, working=working))
                    except Exception as exc:  # noqa: BLE001 - the driver agent is busy or gone
                        log.debug("heartbeat to the driver agent failed: %s", exc)
                    else:
                        self._release_stale(beat, opens)
                self._wake.wait(self.interval)
                self._wake.clear()
                continue
            with self._lock:
                names = dict(self._names)
            try:
                reply: MergePollReply = self._ask(MergePollRequest(
                    self.agent_id, wait=self.interval, working=working,
                    pools=[CheckpointRef(names[u], c) for u, c in pools if u in names],
                    closed=[ClosedFile(names[u], p) for u, p in closed if u in names]))
            except Exception as exc:  # noqa: BLE001 - the driver agent is busy or gone; try again
                log.warning("file-merging poll of the driver agent failed: %s", exc)
                self._stop.wait(self.interval)
                continue
            self._release_stale(reply, opens)
            urls = {n: u for u, n in names.items()}
            for a in reply.actions:
                url = urls.get(a.name)
                if url is None:
                    continue
                if a.action == "discard":
                    self.merger.discard(url, a.checkpoint_id)
                elif a.action == "seal":
                    with self._lock:
                        self._sealing.add((url, a.checkpoint_id))
                    threading.Thread(target=self._seal, args=(a.name, url, a.checkpoint_id, a.attempt), daemon=True,
                                     name=f"steward-seal-{a.checkpoint_id}").start()

    def _release_stale(self, reply: MergePollReply, opens: dict[str, tuple[str, int]]) -> None:
        """Release the opens (of those a heartbeat reported) whose checkpoint the driver agent says is
        no longer pending. Opens made after the heartbeat was sent are not among ``opens``."""
        stale = {(s.name, s.checkpoint_id) for s in reply.stale}
        if stale:
            self.subtasks.release([t for t, key in opens.items() if key in stale],
                                  "its checkpoint is no longer pending at the driver agent (it completed or was "
                                  "aborted)")

    def _seal(self, name: str, url: str, cid: int, attempt: Any) -> None:
        try:
            files = self.merger.seal(url, cid)
            self._ask(SealedRequest(name, cid, self.agent_id, attempt, [SealedFile(f.path, f.size) for f in files]))
        except Exception as exc:  # noqa: BLE001 - the coordinator aborts the checkpoint
            log.warning("sealing checkpoint %d of %s failed: %s", cid, name, exc)
            self.merger.discard(url, cid)
            try:
                self._ask(FailRequest(name, cid, attempt, f"sealing merged files failed: {type(exc).__name__}: {exc}",
                                      agent=self.agent_id))
            except Exception as exc2:  # noqa: BLE001 - best effort: unreported, the checkpoint aborts at its timeout
                log.warning("reporting the failed seal of %s failed: %s", name, exc2)
        finally:
            with self._lock:
                self._sealing.discard((url, cid))
            self._wake.set()
