"""Job cleanup: the runner that retries a result's cleanup steps until they succeed, then commits.

The steps and their executors are in :mod:`sparksteward.jobs.steps`, the backoff in
:mod:`sparksteward.jobs.retry`.

:class:`CleanupRunner` follows FLIP-194's order on a result that is already stored dirty. It runs every
pending step and retries each failed one on its own schedule from a :class:`RetryPolicy`. After every
change it records the step's state in the dirty result (pending, done or failed, with the attempts,
the last error and the next attempt time). Once all steps are done it commits (marks the result
clean). Step failures never raise to the caller: they are logged and kept in the entry. A step that
cannot succeed in this process (an unknown kind, an invalid target) fails at once, without retries.
One that exhausts its attempts also stops being retried. Either way the result stays dirty, for
``steward jobs cleanup`` to finish after the cause is fixed.

Runs. Every save and the commit compare the result's ``run_id`` with the stored one (the store's
compare-and-swap). When a forced re-run of the job id has replaced the entry, the older run's late
write fails with :class:`~sparksteward.errors.RunConflictError`: the runner logs it and ends with
``SUPERSEDED`` (the newer run carried the unfinished steps over), never overwriting the newer result.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import replace
from typing import Any

from sparksteward.clock import SystemClock
from sparksteward.errors import (
    CorruptRecordError,
    InvalidIdError,
    InvalidRecordError,
    JobResultNotFoundError,
    RunConflictError,
    StewardError,
)
from sparksteward.jobs.result import JobResult, JobResultEntry, StepState
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.steps import CleanupStep, StepRegistry

__all__ = ["CleanupOutcome", "CleanupRunner", "CleanupTask"]

log = logging.getLogger("sparksteward.jobs.cleanup")


class CleanupOutcome(str, enum.Enum):
    """How a cleanup run ended."""

    COMMITTED = "committed"  # every step done and the result marked clean (here or by another process)
    GAVE_UP = "gave_up"  # some step failed for good or ran out of attempts; the result stays dirty
    STOPPED = "stopped"  # the runner was stopped (shutdown); the result stays dirty for the next driver
    GONE = "gone"  # the dirty result disappeared (deleted); nothing left to do
    SUPERSEDED = "superseded"  # a newer (forced) run of the job id replaced this run's entry; nothing written


class CleanupTask:
    """The progress of one result's cleanup within one runner. Not thread-safe: one pass at a time.

    ``entry`` is the latest view of the result (clean once committed); ``outcome`` is set, and
    ``finished`` is set, when the run ends.
    """

    def __init__(self, result: JobResult, source: str = "") -> None:
        self.result = result
        self.entry = JobResultEntry(result, False, source)
        self.run_attempts = [0] * len(result.cleanup)
        self.permanent: set[int] = set()
        self.unsaved = False
        self.commit_failures = 0
        self.outcome: CleanupOutcome | None = None
        self.finished = threading.Event()
        self.lease: Any = None  # the live run's store lease, released when the run ends
        self.deferred = False  # a recovery waiting for a live run's lease (JobService)

    def end(self, outcome: CleanupOutcome) -> None:
        """Record how the run ended, release its lease and wake waiters (idempotent on the lease)."""
        self.outcome = outcome
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                lease.release()
            except Exception:  # a lease file that cannot be removed is released by close anyway
                log.warning("job %s: could not release its lease", self.job_id, exc_info=True)
        self.finished.set()

    @property
    def job_id(self) -> str:
        return self.result.job_id

    def __repr__(self) -> str:
        return f"CleanupTask({self.job_id!r}, {self.result.steps_done}/{len(self.result.cleanup)} done, {self.outcome})"


class CleanupRunner:
    """Runs the cleanup steps of dirty results and commits them. See the module docstring.

    Parameters
    ----------
    store
        The JobResultStore (writer side) holding the dirty results.
    registry
        Step kinds and their executors.
    policy
        When to retry failed steps (default: exponential, 1 s to 1 h, unlimited).
    clock
        ``now()`` and ``sleep()``; a fake clock makes backoff instantaneous in tests.
    stop
        Set it to make runs end (STOPPED) at the next step boundary or wait.

    Thread-safety: a runner may serve several threads, each running its own task.
    """

    def __init__(self, store: Any, registry: StepRegistry | None = None, policy: RetryPolicy | None = None,
                 clock: Any = None, stop: threading.Event | None = None) -> None:
        self.store = store
        self.registry = registry or StepRegistry()
        self.policy = policy or RetryPolicy()
        self.clock = clock or SystemClock()
        self.stop = stop or threading.Event()

    def run(self, what: JobResult | JobResultEntry | CleanupTask) -> CleanupOutcome:
        """Run a dirty result's cleanup in this thread until it commits, gives up or is stopped."""
        task = self.task(what)
        while True:
            due = self.run_pass(task)
            if due is None:
                assert task.outcome is not None  # run_pass returns None once the task has ended
                return task.outcome
            if not self.wait(due - self.clock.now()):
                self._end(task, CleanupOutcome.STOPPED)
                return CleanupOutcome.STOPPED

    @staticmethod
    def task(what: JobResult | JobResultEntry | CleanupTask) -> CleanupTask:
        if isinstance(what, CleanupTask):
            return what
        if isinstance(what, JobResultEntry):
            return CleanupTask(what.result, what.source)
        return CleanupTask(what)

    def wait(self, seconds: float) -> bool:
        """Wait ``seconds`` (the system clock waits on ``stop``; other clocks ``sleep``); False if stopped."""
        if seconds > 0 and not self.stop.is_set():
            if isinstance(self.clock, SystemClock):
                self.stop.wait(seconds)
            else:
                self.clock.sleep(seconds)
        return not self.stop.is_set()

    def run_pass(self, task: CleanupTask) -> float | None:
        """Run every step that is due, record the states, and commit if all are done.

        Returns the clock time at which the next pass is due, or None when the run is over
        (``task.outcome`` says how).
        """
        if task.outcome is not None:
            return None
        steps = list(task.result.cleanup)
        for i, s in enumerate(steps):
            if self.stop.is_set():
                return self._end(task, CleanupOutcome.STOPPED)
            if not self._due(task, i, s):
                continue
            steps[i] = self._attempt(task, i, s)
            task.result = task.result.with_cleanup(steps)
            if self._save(task):
                return None
        if self.stop.is_set():  # a step that was running when the runner stopped: recorded, not committed
            return self._end(task, CleanupOutcome.STOPPED)
        if task.result.cleanup_done:
            return self._commit(task)
        live = [i for i, s in enumerate(steps)
                if not s.done and i not in task.permanent and not self._exhausted(task, i)]
        if not live:
            failed = [f"{s.kind} {s.target}: {s.last_error}" for s in steps if not s.done]
            log.error("job %s: cleanup gave up; the result stays dirty. Fix the cause, then run `steward jobs "
                      "cleanup` (failed steps: %s)", task.job_id, "; ".join(failed))
            if task.unsaved:
                self._save(task)
            return self._end(task, CleanupOutcome.GAVE_UP)
        if task.unsaved and self._save(task):
            return None
        return min(steps[i].next_attempt_at or self.clock.now() for i in live)

    # --- internals -----------------------------------------------------------------------------
    def _exhausted(self, task: CleanupTask, i: int) -> bool:
        return self.policy.exhausted(task.run_attempts[i])

    def _due(self, task: CleanupTask, i: int, s: StepState) -> bool:
        if s.done or i in task.permanent or self._exhausted(task, i):
            return False
        # a step this run has not tried yet is due now, whatever a previous driver planned
        return task.run_attempts[i] == 0 or s.next_attempt_at is None or s.next_attempt_at <= self.clock.now()

    def _attempt(self, task: CleanupTask, i: int, s: StepState) -> StepState:
        task.run_attempts[i] += 1
        attempts = s.attempts + 1
        try:
            self.registry.run(CleanupStep.of(s))
        except (InvalidRecordError, InvalidIdError) as exc:  # can never succeed in this process
            task.permanent.add(i)
            log.error("job %s: cleanup step %s %s cannot run: %s", task.job_id, s.kind, s.target, exc)
            return replace(s, state="failed", attempts=attempts, last_error=_describe(exc), next_attempt_at=None)
        except Exception as exc:  # noqa: BLE001 - executors are pluggable; any failure is retried
            if self._exhausted(task, i):
                log.error("job %s: cleanup step %s %s failed on attempt %d of %d, giving up: %s", task.job_id,
                          s.kind, s.target, task.run_attempts[i], self.policy.attempts, exc)
                return replace(s, state="failed", attempts=attempts, last_error=_describe(exc), next_attempt_at=None)
            delay = self.policy.delay(task.run_attempts[i])
            log.warning("job %s: cleanup step %s %s failed (attempt %d), retrying in %.3g s: %s", task.job_id,
                        s.kind, s.target, attempts, delay, exc)
            return replace(s, state="failed", attempts=attempts, last_error=_describe(exc),
                           next_attempt_at=self.clock.now() + delay)
        log.info("job %s: cleanup step %s %s done", task.job_id, s.kind, s.target)
        return replace(s, state="done", attempts=attempts, last_error=None, next_attempt_at=None)

    def _save(self, task: CleanupTask) -> bool:
        """Record the step states in the dirty result. True if the run is over (the entry is gone)."""
        try:
            task.entry = self.store.update_dirty(task.result)
            task.unsaved = False
        except JobResultNotFoundError:
            self._gone(task)
            return True
        except RunConflictError as exc:
            self._superseded(task, exc)
            return True
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop the cleanup itself
            task.unsaved = True
            task.entry = JobResultEntry(task.result, False, task.entry.source)
            log.warning("job %s: could not record cleanup progress (will retry): %s", task.job_id, exc)
        return False

    def _commit(self, task: CleanupTask) -> float | None:
        try:
            if task.unsaved:  # the committed file should show every step done
                self.store.update_dirty(task.result)
                task.unsaved = False
            entry = self.store.mark_clean(task.job_id, task.result.run_id)
        except JobResultNotFoundError:
            self._gone(task)
            return None
        except RunConflictError as exc:
            self._superseded(task, exc)
            return None
        except CorruptRecordError as exc:
            log.error("job %s: cannot commit, the stored result is unreadable: %s", task.job_id, exc)
            return self._end(task, CleanupOutcome.GAVE_UP)
        except Exception as exc:  # noqa: BLE001 - retried like a step
            task.commit_failures += 1
            if self.policy.exhausted(task.commit_failures):
                log.error("job %s: commit failed %d times, giving up; the result stays dirty: %s", task.job_id,
                          task.commit_failures, exc)
                return self._end(task, CleanupOutcome.GAVE_UP)
            delay = self.policy.delay(task.commit_failures)
            log.warning("job %s: commit failed, retrying in %.3g s: %s", task.job_id, delay, exc)
            return self.clock.now() + delay
        task.entry = entry if entry is not None else JobResultEntry(task.result, True, "(deleted on commit)")
        log.info("job %s: cleanup committed (%d steps)", task.job_id, len(task.result.cleanup))
        return self._end(task, CleanupOutcome.COMMITTED)

    def _gone(self, task: CleanupTask) -> None:
        """The dirty file vanished: another process committed it, or someone deleted it."""
        try:
            current = self.store.get(task.job_id)
        except StewardError:
            current = None
        run_id = task.result.run_id
        if current is not None and run_id is not None and current.result.run_id not in (None, run_id):
            return self._superseded(task, None, current)
        if current is not None and current.clean:
            task.entry = current
            log.info("job %s: already committed by another process", task.job_id)
            return self._end(task, CleanupOutcome.COMMITTED)
        log.warning("job %s: its dirty result was deleted during cleanup; stopping", task.job_id)
        return self._end(task, CleanupOutcome.GONE)

    def _superseded(self, task: CleanupTask, exc: Exception | None, current: JobResultEntry | None = None) -> None:
        """A newer run of the job id owns the stored entry: stop without writing anything."""
        if current is None:
            try:
                current = self.store.get(task.job_id)
            except StewardError:
                current = None
        if current is not None:
            task.entry = current
        log.warning("job %s: run %s was superseded by run %s (a forced re-run); stopping its cleanup without "
                    "writing. The newer run carries its unfinished steps%s", task.job_id, task.result.run_id,
                    current.result.run_id if current is not None else "?", f" ({exc})" if exc else "")
        return self._end(task, CleanupOutcome.SUPERSEDED)

    @staticmethod
    def _end(task: CleanupTask, outcome: CleanupOutcome) -> None:
        task.end(outcome)
        return


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]
