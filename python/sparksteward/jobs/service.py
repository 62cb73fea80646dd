"""JobService: the driver agent's jobs, from begin to a committed result.

``begin`` refuses a job id that already has a stored result (dirty or clean) unless forced, so a
completed job is never re-run silently. ``finish`` writes the result dirty (synchronously), then runs
the job's cleanup on a background thread, retried with backoff, and commits it. ``recover`` finishes
the dirty results a previous driver left behind. Store I/O and cleanup run on the service's threads,
never blocking the agent's event loop (FLINK-27204).

Thread-safe: one lock guards the running jobs; the store serializes its own I/O.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from sparksteward.errors import JobAlreadyCompleted, JobStoreError
from sparksteward.ids import validate_job_id
from sparksteward.jobs.cleanup import CleanupRunner, CleanupStep, RetryPolicy, StepRegistry
from sparksteward.jobs.result import Failure, JobResult, JobResultEntry, JobStatus, MAX_SPARK_JOBS, SparkJobOutcome
from sparksteward.jobs.store import open_store
from sparksteward.testing.clock import SystemClock

__all__ = ["JobService"]

log = logging.getLogger("sparksteward.jobs.service")


@dataclass
class _Running:
    job_id: str
    kind: str
    application_id: str | None
    start_time: float
    steps: list[CleanupStep] = field(default_factory=list)
    spark_jobs: dict[int, SparkJobOutcome] = field(default_factory=dict)


class JobService:
    """See the module docstring. A context manager; ``close`` is idempotent."""

    def __init__(self, store: Any, *, cluster_id: str, registry: StepRegistry | None = None,
                 policy: RetryPolicy | None = None, retention: float = 0.0, clock: Any = None) -> None:
        self.store = store
        self.cluster_id = cluster_id
        self.registry = registry or StepRegistry(cluster_id=cluster_id)
        self.clock = clock or SystemClock()
        self.retention = retention
        self._stop = threading.Event()
        self.runner = CleanupRunner(store, self.registry, policy or RetryPolicy(), self.clock, self._stop)
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Any, clock: Any = None) -> JobService:
        store = open_store(cfg.effective_jrs_path, cfg.cluster_id, cfg.jrs_delete_on_commit)
        registry = StepRegistry(ha_root=cfg.effective_ha_path, cluster_id=cfg.cluster_id)
        policy = RetryPolicy(cfg.cleanup_initial_backoff, cfg.cleanup_max_backoff, cfg.cleanup_max_attempts)
        return cls(store, cluster_id=cfg.cluster_id, registry=registry, policy=policy,
                   retention=cfg.jrs_retention, clock=clock)

    # --- a job's life ------------------------------------------------------------------------
    def begin(self, job_id: str, *, application_id: str | None = None, kind: str = "scoped",
              force: bool = False) -> None:
        """Start tracking ``job_id``; raise JobAlreadyCompleted if the store has a result for it."""
        validate_job_id(job_id)
        with self._lock:
            if job_id in self._running:
                raise JobStoreError(f"job {job_id!r} is already running in this application")
            existing = self.store.get(job_id)
            if existing is not None:
                how = ("set spark.steward.job.force-rerun=true" if kind == "application"
                       else f"use st.job({job_id!r}, force=True)")
                if not force:
                    raise JobAlreadyCompleted(
                        f"job {job_id!r} (cluster {self.cluster_id!r}) already ran: its stored result is "
                        f"{existing.status.value} ({existing.state}, {existing.source}). It is not run again; to "
                        f"re-run it deliberately, {how}.", existing)
                log.warning("job %s: forced re-run; replacing its stored %s result", job_id, existing.status.value)
                self.store.delete(job_id)
            self._running[job_id] = _Running(job_id, kind, application_id, self.clock.now())

    def set_application_id(self, job_id: str, application_id: str) -> None:
        with self._lock:
            if job_id in self._running:
                self._running[job_id].application_id = application_id

    def is_running(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._running

    def add_cleanup_step(self, job_id: str, step: CleanupStep) -> None:
        with self._lock:
            job = self._job(job_id)
            if step not in job.steps:
                job.steps.append(step)

    def record_spark_job(self, job_id: str, spark_job_id: int, outcome: str = "running",
                         reason: str | None = None) -> None:
        with self._lock:
            job = self._running.get(job_id)
            if job is not None and (spark_job_id in job.spark_jobs or len(job.spark_jobs) < MAX_SPARK_JOBS):
                job.spark_jobs[spark_job_id] = SparkJobOutcome(spark_job_id, outcome, reason)

    def _job(self, job_id: str) -> _Running:
        job = self._running.get(job_id)
        if job is None:
            raise JobStoreError(f"job {job_id!r} is not running in this application; start it with st.job()")
        return job

    def finish(self, job_id: str, status: JobStatus | str, *, failure: dict[str, str] | None = None,
               payload: Any = None, wait: float | None = None) -> JobResultEntry:
        """Write the result dirty, start its cleanup, and wait up to ``wait`` seconds for the commit."""
        with self._lock:
            job = self._job(job_id)
            del self._running[job_id]
        result = JobResult(
            job_id=job_id, cluster_id=self.cluster_id, application_id=job.application_id,
            status=JobStatus(status), start_time=job.start_time, end_time=self.clock.now(),
            spark_jobs=tuple(sorted(job.spark_jobs.values(), key=lambda j: j.spark_job_id)),
            failure=None if failure is None else Failure(failure.get("type", ""), failure.get("message", ""),
                                                         failure.get("where", "")),
            payload=payload, cleanup=tuple(s.state() for s in job.steps))
        entry = self.store.create_dirty(result)
        log.info("job %s: %s, result written dirty", job_id, result.status.value)
        thread = self._start_cleanup(result)
        if wait is None or wait > 0:
            thread.join(wait)
        return self.store.get(job_id) or entry

    def _start_cleanup(self, result: JobResult) -> threading.Thread:
        def run() -> None:
            try:
                self.runner.run(result)
            except Exception:  # the result stays dirty; the next driver or `steward jobs cleanup` retries
                log.exception("job %s: cleanup failed", result.job_id)

        with self._lock:
            previous = self._threads.get(result.job_id)
            if previous is not None and previous.is_alive():
                return previous
            thread = threading.Thread(target=run, name=f"steward-cleanup-{result.job_id}", daemon=True)
            self._threads[result.job_id] = thread
        thread.start()
        return thread

    # --- recovery, reads, retention ------------------------------------------------------------
    def recover(self) -> list[str]:
        """Start cleanup for every dirty result in the store; return their job ids."""
        listing = self.store.list()
        for path, why in listing.corrupt:
            log.error("unreadable job result %s: %s (quarantine it with `steward jobs quarantine`)", path, why)
        dirty = [e for e in listing.entries if not e.clean and not self.is_running(e.job_id)]
        for entry in dirty:
            log.info("job %s: finishing cleanup left by a previous driver", entry.job_id)
            self._start_cleanup(entry.result)
        return [e.job_id for e in dirty]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for every running cleanup; True if none is left."""
        with self._lock:
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout)
        return not any(t.is_alive() for t in threads)

    def get(self, job_id: str) -> JobResultEntry | None:
        return self.store.get(validate_job_id(job_id))

    def prune(self, older_than: float | None = None) -> list[str]:
        """Delete clean results whose end time is older than ``older_than`` seconds (default: retention)."""
        age = self.retention if older_than is None else older_than
        if age <= 0:
            return []
        cutoff = self.clock.now() - age
        pruned = [e.job_id for e in self.store.list().entries if e.clean and e.result.end_time < cutoff]
        for job_id in pruned:
            self.store.delete(job_id)
        if pruned:
            log.info("pruned %d job results older than %.0f s", len(pruned), age)
        return pruned

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` for running cleanups, then stop them (results stay dirty)."""
        if self._closed:
            return
        self._closed = True
        if not self.wait_idle(timeout):
            log.warning("cleanup did not finish within %.0f s; leaving results dirty for the next driver", timeout)
        self._stop.set()
        self.wait_idle(5)

    def __enter__(self) -> JobService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
