"""CleanupScheduler: runs the cleanup passes of the results a :class:`~sparksteward.jobs.service.JobService`
hands it, with retries, on its own threads.

One scheduler thread keeps the due time of every result being cleaned up; a few worker threads run
one pass at a time, so a result waiting an hour for its next retry holds no thread. A task deferred
because a live run holds its job's lease polls the lease until it is free, then takes the job's
current entry. With a fake clock, the scheduler advances the clock through backoff delays when no
pass is running, which makes retries instantaneous in tests.

Thread-safety: every method may be called from any thread; one condition variable guards the tasks,
and no store I/O runs while it is held.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Any

from sparksteward.clock import SystemClock
from sparksteward.errors import StewardError
from sparksteward.jobs.cleanup import CleanupOutcome, CleanupRunner, CleanupTask

__all__ = ["CleanupScheduler"]

log = logging.getLogger("sparksteward.jobs.scheduler")

JOIN_GRACE = 2.0


class CleanupScheduler:
    """Due times, worker threads and retries of the cleanups of one job service.

    ``stop`` is the service's stop event, shared with ``runner`` so that a pass ends at its next step
    boundary when the service closes.
    """

    def __init__(self, store: Any, runner: CleanupRunner, clock: Any, stop: threading.Event, *,
                 workers: int = 4) -> None:
        self.store = store
        self.runner = runner
        self.clock = clock
        self._stop = stop
        self._cond = threading.Condition(threading.RLock())
        self._tasks: dict[str, CleanupTask] = {}
        self._heap: list[tuple[float, int, CleanupTask]] = []
        self._seq = itertools.count()
        self._queue: queue.SimpleQueue[CleanupTask | None] = queue.SimpleQueue()
        self._inflight = 0
        self._workers = max(1, workers)
        self._threads: list[threading.Thread] = []
        self._closed = False

    def schedule(self, task: CleanupTask) -> CleanupTask | None:
        """Start ``task`` now, unless its job already has a task here: then that task is returned (a
        deferred recovery gives way to a live run's task). None once closed."""
        with self._cond:
            if self._closed:
                log.warning("job %s: the job service is closed; its cleanup is left for the next driver", task.job_id)
                return None
            current = self._tasks.get(task.job_id)
            if current is not None and current.deferred and not task.deferred:
                current.end(CleanupOutcome.STOPPED)  # a recovery waiting for this run's lease: this run takes over
            elif current is not None:
                return current
            self._tasks[task.job_id] = task
            heapq.heappush(self._heap, (self.clock.now(), next(self._seq), task))
            if not self._threads:
                self._start_threads()
            self._cond.notify_all()
            return task

    def task(self, job_id: str) -> CleanupTask | None:
        """The task of ``job_id`` scheduled or running here, if any."""
        with self._cond:
            return self._tasks.get(job_id)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for every cleanup to end; True if none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._tasks, timeout)

    def cleaning(self) -> list[str]:
        """Ids of the results whose cleanup is scheduled or running here."""
        with self._cond:
            return sorted(self._tasks)

    def _start_threads(self) -> None:
        self._threads.append(threading.Thread(target=self._schedule_loop, name="steward-cleanup-scheduler",
                                              daemon=True))
        self._threads.extend(threading.Thread(target=self._work, name=f"steward-cleanup-{i}", daemon=True)
                             for i in range(self._workers))
        for t in self._threads:
            t.start()

    def _schedule_loop(self) -> None:
        real = isinstance(self.clock, SystemClock)
        while True:
            with self._cond:
                if self._stop.is_set():
                    return
                if not self._heap:
                    self._cond.wait()
                    continue
                delta = self._heap[0][0] - self.clock.now()
                if delta <= 0:
                    _, _, task = heapq.heappop(self._heap)
                    self._inflight += 1
                    self._queue.put(task)
                    continue
                if real or self._inflight:
                    self._cond.wait(min(delta, 60.0) if real else None)
                    continue
            self.clock.sleep(delta)  # a fake clock with nothing running: move time to the next retry

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            job_id = task.job_id
            with self._cond:
                if self._tasks.get(job_id) is not task:  # dropped by close(), or replaced by a live run's task
                    self._inflight -= 1
                    self._cond.notify_all()
                    continue
            try:
                due = self._resume(task) if task.deferred else self.runner.run_pass(task)
            except Exception:  # a bug must not kill the worker; retry the pass later
                task.commit_failures += 1
                log.exception("job %s: cleanup pass failed unexpectedly; retrying", job_id)
                due = self.clock.now() + self.runner.policy.delay(task.commit_failures)
            with self._cond:
                self._inflight -= 1
                current = self._tasks.get(job_id) is task
                if due is None or task.outcome is not None or self._stop.is_set():
                    if task.outcome is None:
                        task.end(CleanupOutcome.STOPPED)
                    if current:
                        self._tasks.pop(job_id, None)
                elif current:
                    heapq.heappush(self._heap, (due, next(self._seq), task))
                self._cond.notify_all()

    def _resume(self, task: CleanupTask) -> float | None:
        """A recovery deferred because a live run held the job's lease: poll the lease; once free, take
        the job's current entry (a newer run's, if one was stored) and clean it up from now on."""
        poll = max(0.05, min(self.runner.policy.initial, 1.0))
        try:
            if self.store.is_leased(task.job_id):
                return self.clock.now() + poll
            current = self.store.get(task.job_id)
        except (StewardError, OSError) as exc:
            log.warning("job %s: cannot check its lease or entry, retrying: %s", task.job_id, exc)
            return self.clock.now() + poll
        task.deferred = False
        if current is None or current.clean:
            task.entry = current or task.entry
            log.info("job %s: the live run that held it has %s", task.job_id,
                     "committed it" if current else "removed its result")
            task.end(CleanupOutcome.COMMITTED if current else CleanupOutcome.GONE)
            return None
        if current.result != task.result:
            task.result, task.entry = current.result, current
            task.run_attempts = [0] * len(current.result.cleanup)
        log.info("job %s: no live run holds it any more; finishing its cleanup (%d/%d steps done)", task.job_id,
                 current.result.steps_done, len(current.result.cleanup))
        return self.clock.now()

    def close(self, timeout: float) -> None:
        """Refuse new tasks, wait up to ``timeout`` seconds for running cleanups (not for recoveries
        waiting on another process's live run), then stop the rest: their results stay dirty for the
        next driver. Joins the threads (a pass ends at its next step boundary). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = self._cond.wait_for(lambda: all(t.deferred for t in self._tasks.values()), timeout)
        if not idle:
            log.warning("cleanup of %s did not finish within %.3g s; leaving the results dirty for the next driver "
                        "(or `steward jobs cleanup`)", ", ".join(self.cleaning()), timeout)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            threads = list(self._threads)
        for _ in range(self._workers):
            self._queue.put(None)
        deadline = time.monotonic() + JOIN_GRACE
        for t in threads:  # a step's own I/O cannot be interrupted
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("%s is still inside a cleanup step; not waiting for it (its result stays dirty)", t.name)
        with self._cond:
            for task in self._tasks.values():
                if task.outcome is None:
                    task.end(CleanupOutcome.STOPPED)
            self._tasks.clear()
            self._heap.clear()
            self._cond.notify_all()
