"""JobService: the driver agent's jobs, from ``begin`` to a committed result.

``begin`` refuses a job id that already has a stored result, dirty or clean, unless forced. A
completed job is never re-run silently (FLINK-26583). ``finish`` follows FLIP-194's order: it writes
the result dirty (synchronously, so it is durable and readable when ``finish`` returns), runs the
job's cleanup steps in the background with retries, then commits. ``recover`` finishes the dirty
results that a previous driver for the same cluster id left behind.

Runs. ``begin`` draws a random run id and takes the job's lease in the store (a job id runs once at a
time, across processes on a local store); the lease is held until the run's cleanup ends. The run id
goes into the result, and every update and commit of it is compare-and-swap on that id, so a forced
re-run (a new run id) can never be overwritten or committed over by an older run's late writes, from
this process, a ``steward jobs cleanup`` or another driver's recovery. ``recover`` skips jobs whose
lease is held: a live run is finishing them.

Storing the result. ``finish`` retries a failing store under the cleanup retry policy, for at most
the shutdown timeout. If the store is still failing, the result is spooled locally (versioned JSON,
see :mod:`sparksteward.jobs.spool`) and ``finish`` returns it dirty; the next JobService on this host
writes spooled results to the store in :meth:`recover`, before anything else, and ``begin`` refuses a
job id whose result is spooled. The service's :class:`~sparksteward.jobs.delivery.ResultDelivery` does
the storing, the spooling and the writing of spooled results.

Cleanup runs on the threads of a :class:`~sparksteward.jobs.scheduler.CleanupScheduler`, so nothing
blocks the caller's thread on cleanup I/O (FLINK-27204).

Requests. :meth:`JobService.register_handlers` serves the ``jobs.*`` ops of
:mod:`sparksteward.jobs.messages` on the driver agent's socket.

Thread-safety: every public method may be called from any thread. One condition variable guards the
running jobs, and no store I/O runs while it is held; the scheduler's own lock is only ever taken
inside it, never the other way round.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from sparksteward.clock import SystemClock
from sparksteward.errors import JobAlreadyCompleted, JobStoreError, StewardError
from sparksteward.ids import validate_job_id
from sparksteward.jobs.cleanup import CleanupRunner, CleanupTask
from sparksteward.jobs.delivery import ResultDelivery
from sparksteward.jobs.fs_store import open_store
from sparksteward.jobs.messages import (
    JobAddCleanupRequest,
    JobBeginReply,
    JobBeginRequest,
    JobDone,
    JobEntryReply,
    JobFinishReply,
    JobFinishRequest,
    JobGetRequest,
    JobListReply,
    JobListRequest,
)
from sparksteward.jobs.pathguard import protect_path
from sparksteward.jobs.result import (
    MAX_SPARK_JOBS,
    Failure,
    FinalCheckpoint,
    JobResult,
    JobResultEntry,
    JobStatus,
    SparkJobOutcome,
)
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.scheduler import CleanupScheduler
from sparksteward.jobs.spool import SPOOL_DIR, ResultSpool
from sparksteward.jobs.steps import CleanupStep, StepRegistry
from sparksteward.jobs.store import Listing, job_file_stem

__all__ = ["JobService"]

log = logging.getLogger("sparksteward.jobs.service")

KINDS = ("scoped", "application")
MAX_REASON = 4000
"""Characters of a Spark job's failure reason kept in the result."""


def new_run_id() -> str:
    """A fresh, random run id (32 hex digits)."""
    return uuid.uuid4().hex


@dataclass
class _Running:
    job_id: str
    kind: str
    application_id: str | None
    start_time: float
    steps: list[CleanupStep] = field(default_factory=list)
    spark_jobs: dict[int, SparkJobOutcome] = field(default_factory=dict)
    dropped_spark_jobs: int = 0
    finishing: bool = False
    run_id: str = ""
    lease: Any = None
    replaced: set[str | None] = field(default_factory=set)  # run ids this (forced) run superseded


def _completed(job_id: str, cluster_id: str, kind: str, existing: JobResultEntry) -> JobAlreadyCompleted:
    pending = "" if existing.clean else " Its cleanup has not finished yet; the driver finishes it."
    return JobAlreadyCompleted(
        f"job {job_id!r} (cluster {cluster_id!r}) already has a stored result: {existing.status.value}, "
        f"{existing.state}, in {existing.source}.{pending} It is not run again. To re-run it deliberately, "
        f"{_rerun_hint(job_id, kind)}.", existing)


def _rerun_hint(job_id: str, kind: str) -> str:
    if kind == "application":
        return "set spark.steward.job.force-rerun=true (or choose another spark.steward.job.id)"
    return f"use st.job({job_id!r}, force=True)"


class JobService:
    """Jobs of one driver, their results and their cleanup. See the module docstring.

    Parameters
    ----------
    store
        The JobResultStore.
    cluster_id
        The cluster id of the results (default: the store's).
    registry
        Cleanup step kinds and their executors.
    policy
        Retry policy for failed cleanup steps.
    retention
        Seconds to keep clean results; :meth:`prune` deletes older ones. 0 keeps them forever.
    clock
        ``now()``/``sleep()``; defaults to the system clock.
    shutdown_timeout
        How long :meth:`close` waits for running cleanups by default.
    workers
        Threads that run cleanup passes.
    spool_dir
        A local directory where ``finish`` spools results the store would not take (None: no spool;
        ``finish`` then raises after its retries).

    A context manager; :meth:`close` is idempotent.
    """

    def __init__(self, store: Any, *, cluster_id: str | None = None, registry: StepRegistry | None = None,
                 policy: RetryPolicy | None = None, retention: float = 0.0, clock: Any = None,
                 shutdown_timeout: float = 30.0, workers: int = 4, spool_dir: str | None = None) -> None:
        self.store = store
        self.cluster_id = cluster_id or store.cluster_id
        if self.cluster_id != store.cluster_id:
            raise JobStoreError(f"JobService for cluster {self.cluster_id!r} was given a store for cluster "
                                f"{store.cluster_id!r}")
        self.registry = registry or StepRegistry(cluster_id=self.cluster_id)
        self.clock = clock or SystemClock()
        self.retention = retention
        self.shutdown_timeout = shutdown_timeout
        self._stop = threading.Event()
        self.runner = CleanupRunner(store, self.registry, policy or RetryPolicy(), self.clock, self._stop)
        self.scheduler = CleanupScheduler(store, self.runner, self.clock, self._stop, workers=workers)
        self._cond = threading.Condition(threading.RLock())
        self._running: dict[str, _Running] = {}
        self._closed = False
        self.spool = (None if spool_dir is None
                      else ResultSpool(spool_dir, self.cluster_id, str(getattr(store, "url", repr(store)))))
        self.delivery = ResultDelivery(store, self.runner, self.spool, self.cluster_id)
        self._application: Callable[[], str | None] = lambda: None   # see register_handlers
        self._max_page = 8 << 20

    @classmethod
    def from_config(cls, cfg: Any, clock: Any = None, blob_job_dir: Any = None) -> JobService:
        """Build store, registry and policy from a :class:`~sparksteward.config.StewardConfig`.

        ``blob_job_dir`` is the executor ``(job_id) -> None`` for ``blob_job_dir`` steps (the
        BlobServer's ``delete_job``); without it the HA blob directory is deleted directly.
        """
        protect_path(cfg.effective_state_dir)
        store = open_store(cfg.effective_jrs_path, cfg.cluster_id, cfg.jrs_delete_on_commit)
        registry = StepRegistry(cfg.effective_ha_path, cfg.cluster_id, blob_job_dir=blob_job_dir)
        return cls(store, cluster_id=cfg.cluster_id, registry=registry, policy=RetryPolicy.from_config(cfg),
                   retention=cfg.jrs_retention, clock=clock, shutdown_timeout=cfg.cleanup_shutdown_timeout,
                   spool_dir=os.path.join(cfg.effective_state_dir, SPOOL_DIR))

    def __repr__(self) -> str:
        return f"JobService({self.store!r})"

    # --- a job's life ------------------------------------------------------------------------
    def begin(self, job_id: str, *, application_id: str | None = None, kind: str = "scoped",
              force: bool = False) -> None:
        """Start tracking ``job_id``.

        Raises
        ------
        JobAlreadyCompleted
            If the store holds a result for the id (dirty or clean) and ``force`` is false. With
            ``force`` the old result is deleted (with a warning) and the cleanup steps it had not
            finished are carried over to this run.
        JobStoreError
            If the job is already running in this service or in another process (its lease is held),
            or its previous run is still being cleaned up here.
        """
        validate_job_id(job_id)
        job_file_stem(job_id)
        if kind not in KINDS:
            raise JobStoreError(f"job kind {kind!r} is not one of {', '.join(KINDS)}")
        with self._cond:
            if self._closed:
                raise JobStoreError(f"cannot begin job {job_id!r}: the job service is closed")
            if job_id in self._running:
                raise JobStoreError(f"job {job_id!r} is already running in this application; a job id runs once "
                                    f"at a time")
            job = self._running[job_id] = _Running(job_id, kind, application_id, self.clock.now(),
                                                   run_id=new_run_id())
            cleaning = self.scheduler.task(job_id)
            if cleaning is not None and cleaning.deferred:  # only waiting for another run's lease
                cleaning = None
        try:
            if not force and cleaning is None:
                # a completed job is refused before its lease is taken, so that recovery (which skips
                # leased jobs) never mistakes this refused begin for a live run
                existing = self.store.get(job_id)
                if existing is not None:
                    raise _completed(job_id, self.cluster_id, kind, existing)
            if cleaning is None:
                job.lease = self.store.lease(job_id, job.run_id)
            existing = self.store.get(job_id)
            spooled = self.delivery.spooled(job_id) if existing is None else []
            if existing is None and spooled and not force:
                raise JobAlreadyCompleted(
                    f"job {job_id!r} (cluster {self.cluster_id!r}) already has a result, spooled locally at "
                    f"{spooled[0][0]} because the store was unreachable when it finished; it is written to the store "
                    f"by the next recovery. It is not run again. To re-run it deliberately, "
                    f"{_rerun_hint(job_id, kind)}.", JobResultEntry(spooled[0][1], False, spooled[0][0]))
            if cleaning is not None and (force or existing is None):
                raise JobStoreError(f"job {job_id!r} finished and is still being cleaned up "
                                    f"({cleaning.result.steps_done}/{len(cleaning.result.cleanup)} steps done); wait "
                                    f"for its result to be clean before running it again")
            for path, old in spooled:  # forced: the older run's spooled result goes, its cleanup comes along
                log.warning("job %s: forced re-run; deleting its spooled result %s and carrying over its %d cleanup "
                            "steps", job_id, path, len(old.cleanup))
                with self._cond:
                    job.steps.extend(s for s in map(CleanupStep.of, old.cleanup) if s not in job.steps)
                job.replaced.add(old.run_id)
                self.delivery.drop_spooled(path)
            if existing is not None:
                if not force:
                    raise _completed(job_id, self.cluster_id, kind, existing)
                carried = [CleanupStep.of(s) for s in existing.result.cleanup if not s.done]
                job.replaced.add(existing.result.run_id)
                log.warning("job %s: forced re-run; deleting its stored %s %s result%s", job_id,
                            existing.status.value, existing.state,
                            f" and carrying over {len(carried)} unfinished cleanup steps" if carried else "")
                self.store.delete(job_id)
                with self._cond:
                    job.steps.extend(s for s in carried if s not in job.steps)
        except BaseException:
            with self._cond:
                self._running.pop(job_id, None)
            if job.lease is not None:
                job.lease.release()
            raise
        log.info("job %s (%s) started, run %s", job_id, kind, job.run_id)

    def set_application_id(self, job_id: str, application_id: str) -> None:
        with self._cond:
            if job_id in self._running:
                self._running[job_id].application_id = application_id

    def is_running(self, job_id: str) -> bool:
        with self._cond:
            return job_id in self._running

    def run_id(self, job_id: str) -> str | None:
        """The run id of ``job_id``'s live run in this service, or None."""
        with self._cond:
            job = self._running.get(job_id)
            return None if job is None else job.run_id

    def running(self) -> list[str]:
        """Ids of the jobs begun and not yet finished."""
        with self._cond:
            return sorted(self._running)

    def _job(self, job_id: str) -> _Running:
        job = self._running.get(job_id)
        if job is None or job.finishing:
            raise JobStoreError(f"job {job_id!r} is not running in this application; start it with st.job() "
                                f"(or it has already finished)")
        return job

    def add_cleanup_step(self, job_id: str, step: CleanupStep | dict[str, str]) -> None:
        """Add a step to run when the job finishes. InvalidRecordError if it can never run here."""
        if not isinstance(step, CleanupStep):
            step = CleanupStep.from_dict(step)
        step = self.registry.prepare(step)  # validated, target in normal form
        with self._cond:
            job = self._job(job_id)
            if step not in job.steps:
                job.steps.append(step)

    def record_spark_job_start(self, job_id: str, spark_job_id: int) -> None:
        """A Spark job started inside ``job_id`` (ignored if the job is not running)."""
        self._record(job_id, spark_job_id, "running", None)

    def record_spark_job_end(self, job_id: str, spark_job_id: int, outcome: str, reason: str | None = None) -> None:
        """A Spark job of ``job_id`` ended: ``outcome`` is ``succeeded`` or ``failed``."""
        self._record(job_id, spark_job_id, outcome, reason)

    def record_spark_job(self, job_id: str, spark_job_id: int, outcome: str = "running",
                         reason: str | None = None) -> None:
        """Start (``outcome="running"``) or end of a Spark job; see the two methods above."""
        self._record(job_id, spark_job_id, outcome, reason)

    def _record(self, job_id: str, spark_job_id: int, outcome: str, reason: str | None) -> None:
        outcome_rec = SparkJobOutcome(int(spark_job_id), str(outcome),
                                      None if reason is None else str(reason)[:MAX_REASON])
        with self._cond:
            job = self._running.get(job_id)
            if job is None:
                log.debug("job %s: ignoring Spark job %s event (the job is not running)", job_id, spark_job_id)
                return
            if spark_job_id in job.spark_jobs or len(job.spark_jobs) < MAX_SPARK_JOBS:
                job.spark_jobs[spark_job_id] = outcome_rec
            elif outcome == "running":
                job.dropped_spark_jobs += 1

    def finish(self, job_id: str, status: JobStatus | str, *, failure: Failure | dict[str, str] | None = None,
               payload: Any = None, wait: float | None = None,
               checkpoints: tuple[FinalCheckpoint, ...] = ()) -> JobResultEntry:
        """Write the job's result dirty, start its cleanup, and wait up to ``wait`` seconds for the commit.

        ``wait=None`` waits until the cleanup commits, gives up or the service closes; ``wait=0``
        does not wait. Returns the current entry: clean if the commit happened in time, else dirty
        with the steps' progress. ``checkpoints`` records each keyed state's last completed checkpoint
        in the job. If the service is closed, the result is written dirty and its
        cleanup left to the next driver.

        A failing store is retried under the cleanup retry policy for at most the shutdown timeout;
        then the result is spooled locally (the returned entry's ``source`` is the spool file) and
        the next JobService stores it and runs its cleanup.
        """
        with self._cond:  # from here on no steps are added; a snapshot of what was recorded
            job = self._job(job_id)
            job.finishing = True
            application_id, steps = job.application_id, [s.state() for s in job.steps]
            spark_jobs = sorted(job.spark_jobs.values(), key=lambda j: j.spark_job_id)
        try:
            result = JobResult(
                job_id=job_id, cluster_id=self.cluster_id, application_id=application_id,
                status=JobStatus.parse(status), start_time=job.start_time, end_time=self.clock.now(),
                spark_jobs=tuple(spark_jobs), failure=Failure.coerce(failure), payload=payload, cleanup=tuple(steps),
                run_id=job.run_id, checkpoints=tuple(checkpoints))
            entry, spooled = self.delivery.store_dirty(result, job.replaced, within=self.shutdown_timeout)
        except BaseException:
            with self._cond:
                job.finishing = False  # the caller may fix the cause and finish again
            raise
        with self._cond:
            self._running.pop(job_id, None)
        if job.dropped_spark_jobs:
            log.warning("job %s: %d Spark jobs beyond the first %d were not recorded", job_id,
                        job.dropped_spark_jobs, MAX_SPARK_JOBS)
        if spooled:
            if job.lease is not None:
                job.lease.release()
            return entry
        log.info("job %s: %s; result written dirty to %s, %d cleanup steps", job_id, result.status.value,
                 entry.source, len(result.cleanup))
        task = CleanupTask(result, entry.source)
        task.lease = job.lease
        if self.scheduler.schedule(task) is not task:
            if job.lease is not None:
                job.lease.release()
            return entry
        if wait is None or wait > 0:
            task.finished.wait(wait)
        return task.entry

    def flush_spool(self) -> list[str]:
        """Write the results spooled by an earlier ``finish`` to the store (dirty; recovery then runs
        their cleanup and commits). A result whose job already has another run's entry is dropped, with
        a warning. Returns the job ids written; a store that still fails leaves the files for later."""
        return self.delivery.flush()

    # --- cleanup scheduling --------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for every cleanup to end; True if none is left."""
        return self.scheduler.wait_idle(timeout)

    def cleaning(self) -> list[str]:
        """Ids of the results whose cleanup is scheduled or running here."""
        return self.scheduler.cleaning()

    # --- recovery, reads, retention ------------------------------------------------------------
    def recover(self, only: Iterable[str] | None = None, *, defer_leased: bool = True) -> list[str]:
        """Finish what a previous driver left: start cleanup for every dirty result in the store
        (or for the ids in ``only``).

        Also removes stale dirty files next to clean ones (an interrupted object-store commit) and
        logs unreadable files. Results spooled by a ``finish`` that could not reach the store are
        written first (:meth:`flush_spool`). A job whose lease is held (a live run in this or another
        process) is not touched while it is held: with ``defer_leased`` its recovery waits for the
        lease (the run may die, or fail before storing a result), else it is skipped. The listing runs
        in the caller's thread, the cleanup in the background. Returns the ids whose cleanup was
        started or deferred.
        """
        wanted = None if only is None else set(only)
        try:
            self.flush_spool()
        except StewardError as exc:
            log.warning("could not write spooled job results: %s", exc)
        listing = self.store.list(state="dirty")
        for path, why in listing.corrupt:
            log.error("unreadable job result %s: %s", path, why)
        for job_id in listing.stale:
            try:
                self.store.mark_clean(job_id)
            except StewardError as exc:
                log.warning("job %s: could not remove its stale dirty file: %s", job_id, exc)
        started = []
        for entry in listing.entries:
            if wanted is not None and entry.job_id not in wanted:
                continue
            if self.scheduler.task(entry.job_id) is not None:  # begun right now (begin will refuse it)
                continue
            try:
                leased = self.store.is_leased(entry.job_id)
            except (StewardError, OSError) as exc:
                log.warning("job %s: cannot tell whether it is running elsewhere, skipping it: %s", entry.job_id, exc)
                continue
            task = CleanupTask(entry.result, entry.source)
            if leased:
                log.info("job %s: a live run holds it; not recovering it%s", entry.job_id,
                         " while it does" if defer_leased else "")
                if not defer_leased:
                    continue
                task.deferred = True
            else:
                log.info("job %s: finishing the cleanup a previous driver left (%d/%d steps done)", entry.job_id,
                         entry.result.steps_done, len(entry.result.cleanup))
            if self.scheduler.schedule(task) is task:
                started.append(entry.job_id)
        return started

    def get(self, job_id: str) -> JobResultEntry | None:
        """The stored entry of ``job_id`` (dirty or clean), or None."""
        return self.store.get(validate_job_id(job_id))

    def list(self, *, state: str | None = None, status: JobStatus | str | None = None,
             ended_before: float | None = None) -> Listing:
        """Stored entries matching the filters, and the unreadable files."""
        return self.store.list(state=state, status=status, ended_before=ended_before)

    def prune(self, now: float | None = None, *, older_than: float | None = None) -> builtins.list[str]:
        """Delete clean results that ended more than ``older_than`` seconds (default: the retention)
        before ``now`` (default: the clock). A retention of 0 keeps everything."""
        age = self.retention if older_than is None else older_than
        if older_than is None and age <= 0:
            return []
        return self.store.prune(age, self.clock.now() if now is None else now)

    # --- requests ------------------------------------------------------------------------------
    def register_handlers(self, server: Any, *, application: Callable[[], str | None] = lambda: None,
                          max_message: int = 16 << 20) -> None:
        """Serve the ``jobs.*`` ops on ``server`` (an :class:`~sparksteward.wire.server.AgentServer`).
        ``application()``: the Spark application id a job begun by request runs in; ``max_message``:
        the frame bound, half of which a ``jobs.list`` page may fill."""
        self._application = application
        self._max_page = max_message // 2
        server.serve(JobBeginRequest, self._op_begin)
        server.serve(JobAddCleanupRequest, self._op_add_cleanup)
        server.serve(JobFinishRequest, self._op_finish)
        server.serve(JobGetRequest, self._op_get)
        server.serve(JobListRequest, self._op_list)

    def _op_begin(self, conn: Any, req: JobBeginRequest) -> JobBeginReply:
        try:
            self.begin(req.job_id, application_id=self._application(), force=req.force)
        except JobAlreadyCompleted as exc:
            return JobBeginReply(False, str(exc), None if exc.entry is None else exc.entry.to_dict())
        self.add_cleanup_step(req.job_id, CleanupStep("blob_job_dir", req.job_id))
        return JobBeginReply(True)

    def _op_add_cleanup(self, conn: Any, req: JobAddCleanupRequest) -> JobDone:
        self.add_cleanup_step(req.job_id, CleanupStep(req.step.kind, req.step.target))
        return JobDone()

    def _op_finish(self, conn: Any, req: JobFinishRequest) -> JobFinishReply:
        wait = self.shutdown_timeout if req.wait is None else req.wait
        entry = self.finish(req.job_id, req.status, failure=req.failure, payload=req.payload, wait=wait,
                            checkpoints=req.checkpoints)
        return JobFinishReply(entry.to_dict())

    def _op_get(self, conn: Any, req: JobGetRequest) -> JobEntryReply:
        entry = self.get(req.job_id)
        return JobEntryReply(None if entry is None else entry.to_dict())

    def _op_list(self, conn: Any, req: JobListRequest) -> JobListReply:
        limit = 1000 if req.limit is None else req.limit
        listing = self.store.list()
        page: builtins.list[dict[str, Any]] = []
        used, more, last = 0, False, None
        for e in listing.entries:  # sorted by job id
            if req.cursor is not None and e.job_id <= req.cursor:
                continue
            d = e.to_dict()
            size = len(orjson.dumps(d))
            if len(page) >= limit or (page and used + size > self._max_page):
                more = True
                break
            page.append(d)
            used += size
            last = e.job_id
        return JobListReply(page, builtins.list(listing.corrupt) if req.cursor is None else [],
                            last if more else None)

    # --- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (default: the shutdown timeout) for running cleanups, then
        stop them; unfinished results stay dirty for the next driver. Idempotent; joins its threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            unfinished = sorted(self._running)
        if unfinished:
            log.warning("jobs %s were still running at shutdown; no result is stored for them", ", ".join(unfinished))
        self.scheduler.close(self.shutdown_timeout if timeout is None else timeout)
        with self._cond:
            leases = [job.lease for job in self._running.values() if job.lease is not None]
        for lease in leases:  # jobs begun and never finished: no result, and their id is free again
            lease.release()

    def __enter__(self) -> JobService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
