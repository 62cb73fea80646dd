"""Job cleanup: declarative steps, retried with backoff until they succeed, then the commit.

A :class:`CleanupStep` is ``{kind, target}`` and is stored in the dirty result, so a driver started
later can run it again. Step kinds map to functions in a :class:`StepRegistry`; every function must be
idempotent (deleting something already gone is success). Built-in kinds:

- ``delete_path``: any fsspec URL, file or directory (``job.cleanup_path``);
- ``spark_checkpoint_dir``: the application's ``sc.setCheckpointDir`` directory, which Spark never
  deletes;
- ``blob_job_dir``: the job's blob directory in local and HA storage. The driver agent registers its
  BlobServer's ``delete_job``; without one (CLI, recovery) the HA directory is deleted directly.

:class:`CleanupRunner` follows FLIP-194's order on a dirty result: run every pending step, retrying
failed ones with exponential backoff (``spark.steward.cleanup.*``), record each step's state in the
dirty result after every change, and commit (mark clean) once all steps are done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sparksteward.errors import InvalidIdError, StewardError
from sparksteward.ids import job_id_to_filename
from sparksteward.jobs.result import JobResult, StepState
from sparksteward.storage import open_location

__all__ = ["CleanupRunner", "CleanupStep", "RetryPolicy", "StepRegistry", "delete_path"]

log = logging.getLogger("sparksteward.jobs.cleanup")


@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One declarative cleanup step."""

    kind: str
    target: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind or not isinstance(self.target, str) or not self.target:
            raise InvalidIdError(f"cleanup step {{kind: {self.kind!r}, target: {self.target!r}}} needs a kind and a target")

    def state(self) -> StepState:
        return StepState(self.kind, self.target)


def delete_path(url: str) -> None:
    """Delete a file or directory at any fsspec URL; a missing path is success."""
    loc = open_location(url)
    loc.delete(loc.root, recursive=True)


class StepRegistry:
    """Maps step kinds to idempotent functions ``fn(target) -> None``. Thread-safe for reads."""

    def __init__(self, ha_root: str | None = None, cluster_id: str = "default") -> None:
        self._fns: dict[str, Callable[[str], None]] = {"delete_path": delete_path, "spark_checkpoint_dir": delete_path}
        self._ha_root, self._cluster_id = ha_root, cluster_id
        self._fns["blob_job_dir"] = self._delete_ha_blob_dir

    def _delete_ha_blob_dir(self, job_id: str) -> None:
        if self._ha_root:
            delete_path(f"{self._ha_root.rstrip('/')}/{self._cluster_id}/blob/{job_id_to_filename(job_id)}")

    def register(self, kind: str, fn: Callable[[str], None]) -> None:
        self._fns[kind] = fn

    def run(self, kind: str, target: str) -> None:
        fn = self._fns.get(kind)
        if fn is None:
            raise InvalidIdError(f"unknown cleanup step kind {kind!r}; known: {', '.join(sorted(self._fns))}")
        fn(target)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff: ``initial * 2**(attempt-1)``, capped at ``maximum``; ``attempts`` 0 = unlimited."""

    initial: float = 1.0
    maximum: float = 3600.0
    attempts: int = 0

    def delay(self, attempt: int) -> float:
        return min(self.initial * (2 ** max(0, attempt - 1)), self.maximum)

    def exhausted(self, attempt: int) -> bool:
        return self.attempts > 0 and attempt >= self.attempts


class CleanupRunner:
    """Runs the cleanup steps of dirty results and commits them. See the module docstring.

    ``store`` is a JobResultStore; ``clock`` has ``now()`` and ``sleep()``; ``stop`` is an Event that
    interrupts waiting (the result then stays dirty, for the next driver).
    """

    def __init__(self, store: Any, registry: StepRegistry, policy: RetryPolicy, clock: Any,
                 stop: threading.Event | None = None) -> None:
        self.store = store
        self.registry = registry
        self.policy = policy
        self.clock = clock
        self.stop = stop or threading.Event()

    def run(self, result: JobResult) -> bool:
        """Run ``result``'s pending steps until all are done (then commit, return True), the stop
        event is set, or a step exhausts its attempts (both leave the result dirty, return False)."""
        steps = list(result.cleanup)
        while True:
            now = self.clock.now()
            changed = False
            for i, s in enumerate(steps):
                if s.state == "done" or (s.next_attempt_at is not None and s.next_attempt_at > now):
                    continue
                attempt = s.attempts + 1
                try:
                    self.registry.run(s.kind, s.target)
                    steps[i] = replace(s, state="done", attempts=attempt, last_error=None, next_attempt_at=None)
                    log.info("job %s: cleanup %s %s done", result.job_id, s.kind, s.target)
                except (StewardError, OSError, ValueError) as exc:
                    delay = self.policy.delay(attempt)
                    steps[i] = replace(s, state="failed", attempts=attempt, last_error=f"{type(exc).__name__}: {exc}",
                                       next_attempt_at=now + delay)
                    log.warning("job %s: cleanup %s %s failed (attempt %d), retrying in %.0f s: %s",
                                result.job_id, s.kind, s.target, attempt, delay, exc)
                changed = True
            if changed:
                result = result.with_cleanup(tuple(steps))
                self.store.update_dirty(result)
            if all(s.state == "done" for s in steps):
                self.store.mark_clean(result.job_id)
                log.info("job %s: cleanup committed", result.job_id)
                return True
            if any(self.policy.exhausted(s.attempts) for s in steps if s.state != "done"):
                log.error("job %s: cleanup gave up after %d attempts; the result stays dirty. Fix the cause, then "
                          "run `steward jobs cleanup`", result.job_id, self.policy.attempts)
                return False
            due = min(s.next_attempt_at or now for s in steps if s.state != "done")
            if not self._wait(max(0.0, due - self.clock.now())):
                return False

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` in slices that notice ``stop``; False if stopped."""
        left = seconds
        while left > 0:
            if self.stop.is_set():
                return False
            step = min(left, 0.5)
            self.clock.sleep(step)
            left -= step
        return not self.stop.is_set()
