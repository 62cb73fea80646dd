"""Scoped jobs declared in the user's driver: ``with st.job("ingest-2026-11-22") as job: ...``.

A scope asks the driver agent to begin the job (which refuses, with :class:`JobAlreadyCompleted`, if
the JobResultStore already holds a result for the id), tags every Spark job started in the scope's
thread with ``sparksteward-job-<id>`` so the agent attributes them, and on exit reports the final status
(SUCCEEDED, FAILED or CANCELLED), the failure and the payload. The agent then writes the result dirty,
runs the job's cleanup and commits it.

Not thread-safe: Spark job tags are thread-local, so use a scope from the thread that runs its Spark
work (``pyspark.InheritableThread`` carries tags to child threads).
"""

from __future__ import annotations

import traceback
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import quote, unquote

import orjson

from sparksteward.errors import InvalidIdError, JobAlreadyCompleted
from sparksteward.ids import validate_job_id

__all__ = ["JobResults", "JobScope", "TAG_PREFIX", "job_id_from_tag", "job_tag"]

TAG_PREFIX = "sparksteward-job-"


class _Steward(Protocol):
    """What a scope needs of its :class:`~sparksteward.client.Steward` (which imports this module)."""

    spark: Any
    _local: Any

    def ask(self, request: Any) -> Any: ...


def job_tag(job_id: str) -> str:
    """The Spark job tag that attributes Spark jobs to ``job_id``: the id percent-encoded once, so it
    has no commas (Spark joins tags with them) and :func:`job_id_from_tag` reverses it exactly."""
    return TAG_PREFIX + quote(validate_job_id(job_id), safe="")


def job_id_from_tag(tag: str) -> str | None:
    """The job id a Spark job tag names (``job_tag``'s output, possibly behind a SparkSession prefix
    such as ``spark-session-<uuid>-thread-<uuid>-``), or None if the tag names no job."""
    i = tag.find(TAG_PREFIX)
    if i < 0:
        return None
    encoded = tag[i + len(TAG_PREFIX):]
    try:
        job_id = unquote(encoded, errors="strict")
        validate_job_id(job_id)
    except (InvalidIdError, UnicodeDecodeError):
        return None
    return job_id if quote(job_id, safe="") == encoded else None


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    text = str(exc).lower()
    return "cancelled" in text or "canceled" in text


class JobScope:
    """One scoped job; returned by :meth:`Steward.job`. See the module docstring."""

    def __init__(self, steward: _Steward, job_id: str, *, force: bool = False,
                 wait: float | None = None) -> None:
        self.steward = steward
        self.job_id = validate_job_id(job_id)
        self.force = force
        self.wait = wait
        self.tag = job_tag(job_id)
        self.entry: Any = None
        self._payload: Any = None
        self._checkpoints: dict[str, dict[str, Any]] = {}  # state name -> its last completed checkpoint
        self._active = False

    def __enter__(self) -> JobScope:
        from sparksteward.jobs.messages import JobBeginRequest  # the jobs package loads on first use
        from sparksteward.jobs.result import JobResultEntry

        reply = self.steward.ask(JobBeginRequest(self.job_id, self.force))
        if not reply.started:
            raise JobAlreadyCompleted(reply.message, JobResultEntry.from_dict(reply.entry))
        self._active = True
        if getattr(self.steward, "remote", False):   # Spark Connect: the session's tag (Connect prefixes it)
            self.steward.spark.addTag(self.tag)
        else:
            self._sc().addJobTag(self.tag)
        scopes = getattr(self.steward._local, "scope", None) or []
        self.steward._local.scope = [*scopes, self.job_id]
        self.steward._local.scope_objects = [*(getattr(self.steward._local, "scope_objects", None) or []), self]
        return self

    def _sc(self) -> Any:
        if self.steward.spark is None:
            from pyspark import SparkContext

            sc = SparkContext._active_spark_context
            if sc is None:
                raise InvalidIdError("no active SparkContext for this job scope")
            return sc
        return self.steward.spark.sparkContext

    def cleanup_path(self, url: str) -> None:
        """Delete ``url`` (any fsspec URL, file or directory) when the job reaches a final state."""
        from sparksteward.jobs.messages import JobAddCleanupRequest, JobCleanupStep

        self.steward.ask(JobAddCleanupRequest(self.job_id, JobCleanupStep("delete_path", str(url))))

    def set_result(self, payload: Any) -> None:
        """Keep ``payload`` (any JSON value) in the job's result; ``run_once`` returns it later."""
        try:
            orjson.dumps(payload)
        except TypeError as exc:
            raise InvalidIdError(f"job result payload must be JSON-serializable: {exc}") from exc
        self._payload = payload

    def note_checkpoint(self, state: str, checkpoint_id: int, path: str) -> None:
        """Record that keyed state ``state`` completed ``checkpoint_id`` (at ``path``) in this job; the
        job's result keeps the last one per state (``KeyedState.commit`` calls this)."""
        self._checkpoints[state] = {"state": state, "checkpoint_id": int(checkpoint_id), "path": str(path)}

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._active:
            return
        self._active = False
        scopes = getattr(self.steward._local, "scope", None) or []
        self.steward._local.scope = [j for j in scopes if j != self.job_id]
        objects = getattr(self.steward._local, "scope_objects", None) or []
        self.steward._local.scope_objects = [s for s in objects if s is not self]
        try:
            if getattr(self.steward, "remote", False):
                self.steward.spark.removeTag(self.tag)
            else:
                self._sc().removeJobTag(self.tag)
        except Exception:  # noqa: BLE001 - the context may already be stopped; the result still matters
            pass
        failure = None
        if exc is None:
            status = "SUCCEEDED"
        else:
            status = "CANCELLED" if _is_cancellation(exc) else "FAILED"
            frames = traceback.extract_tb(tb) if tb is not None else []
            where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
            failure = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                       "message": str(exc)[:4000], "where": where}
        from sparksteward.jobs.messages import JobFinishReply, JobFinishRequest
        from sparksteward.jobs.result import FinalCheckpoint, JobResultEntry, JobStatus

        reply: JobFinishReply = self.steward.ask(JobFinishRequest(
            self.job_id, JobStatus.parse(status), failure=failure, payload=self._payload, wait=self.wait,
            checkpoints=tuple(FinalCheckpoint.from_dict(c) for c in self._checkpoints.values())))
        self.entry = JobResultEntry.from_dict(reply.entry)


class JobResults:
    """Read-only view of the application's JobResultStore, through the driver agent."""

    def __init__(self, steward: _Steward) -> None:
        self._steward = steward

    def get(self, job_id: str) -> Any:
        """The :class:`~sparksteward.jobs.result.JobResultEntry` of ``job_id``, or None."""
        from sparksteward.jobs.messages import JobGetRequest
        from sparksteward.jobs.result import JobResultEntry

        entry = self._steward.ask(JobGetRequest(job_id)).entry
        return None if entry is None else JobResultEntry.from_dict(entry)

    def list(self) -> list[Any]:
        """Every readable entry of this cluster id, sorted by job id."""
        from sparksteward.jobs.messages import JobListRequest
        from sparksteward.jobs.result import JobResultEntry

        out: list[Any] = []
        request = JobListRequest()
        while True:   # a page at a time, following the reply's cursor
            reply = self._steward.ask(request)
            out.extend(JobResultEntry.from_dict(e) for e in reply.entries)
            if reply.next is None:
                return out
            request = JobListRequest(cursor=reply.next)
