"""Job results: immutable records with one versioned JSON encoding (never pickle).

A stored file holds ``{"version": 1, "result": {...}}``. :func:`decode_result` rejects unknown
versions and malformed input with :class:`~sparksteward.errors.CorruptRecordError` naming the file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from sparksteward.errors import CorruptRecordError
from sparksteward.ids import validate_job_id

__all__ = ["Failure", "JobResult", "JobResultEntry", "JobStatus", "SparkJobOutcome", "StepState",
           "decode_result", "encode_result"]

VERSION = 1
MAX_SPARK_JOBS = 1000


class JobStatus(str, enum.Enum):
    """Final status of a job."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclass(frozen=True, slots=True)
class SparkJobOutcome:
    """One Spark job that ran inside a steward job."""

    spark_job_id: int
    outcome: str  # running | succeeded | failed
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a job failed: exception type, message and where it was raised."""

    type: str
    message: str
    where: str = ""


@dataclass(frozen=True, slots=True)
class StepState:
    """Progress of one cleanup step: ``state`` is pending, done or failed."""

    kind: str
    target: str
    state: str = "pending"
    attempts: int = 0
    last_error: str | None = None
    next_attempt_at: float | None = None


@dataclass(frozen=True, slots=True)
class JobResult:
    """The durable result of one job, identified by (cluster id, job id)."""

    job_id: str
    cluster_id: str
    application_id: str | None
    status: JobStatus
    start_time: float
    end_time: float
    spark_jobs: tuple[SparkJobOutcome, ...] = ()
    failure: Failure | None = None
    payload: Any = None
    cleanup: tuple[StepState, ...] = ()

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)
        if not isinstance(self.status, JobStatus):
            object.__setattr__(self, "status", JobStatus(self.status))

    @property
    def cleanup_done(self) -> bool:
        return all(s.state == "done" for s in self.cleanup)

    def with_cleanup(self, cleanup: tuple[StepState, ...]) -> JobResult:
        return replace(self, cleanup=cleanup)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "cluster_id": self.cluster_id, "application_id": self.application_id,
            "status": self.status.value, "start_time": self.start_time, "end_time": self.end_time,
            "spark_jobs": [[j.spark_job_id, j.outcome, j.reason] for j in self.spark_jobs],
            "failure": None if self.failure is None else
            {"type": self.failure.type, "message": self.failure.message, "where": self.failure.where},
            "payload": self.payload,
            "cleanup": [{"kind": s.kind, "target": s.target, "state": s.state, "attempts": s.attempts,
                         "last_error": s.last_error, "next_attempt_at": s.next_attempt_at} for s in self.cleanup],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResult:
        failure = d.get("failure")
        return cls(
            job_id=d["job_id"], cluster_id=d["cluster_id"], application_id=d.get("application_id"),
            status=JobStatus(d["status"]), start_time=float(d["start_time"]), end_time=float(d["end_time"]),
            spark_jobs=tuple(SparkJobOutcome(int(i), str(o), r) for i, o, r in d.get("spark_jobs", ())),
            failure=None if failure is None else Failure(failure["type"], failure["message"], failure.get("where", "")),
            payload=d.get("payload"),
            cleanup=tuple(StepState(**s) for s in d.get("cleanup", ())),
        )


@dataclass(frozen=True)
class JobResultEntry:
    """A stored result and whether its cleanup has committed (``clean``) or not (dirty)."""

    result: JobResult
    clean: bool
    source: str = field(default="", compare=False)

    @property
    def job_id(self) -> str:
        return self.result.job_id

    @property
    def status(self) -> JobStatus:
        return self.result.status

    @property
    def payload(self) -> Any:
        return self.result.payload

    @property
    def state(self) -> str:
        return "clean" if self.clean else "dirty"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "source": self.source, "result": self.result.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResultEntry:
        return cls(JobResult.from_dict(d["result"]), d["state"] == "clean", d.get("source", ""))

    def __str__(self) -> str:
        r = self.result
        return (f"job {r.job_id!r} (cluster {r.cluster_id!r}): {r.status.value}, {self.state}, "
                f"{sum(s.state == 'done' for s in r.cleanup)}/{len(r.cleanup)} cleanup steps done")


def encode_result(result: JobResult) -> bytes:
    """The stored bytes of ``result``."""
    return orjson.dumps({"version": VERSION, "result": result.to_dict()}, option=orjson.OPT_INDENT_2)


def decode_result(data: bytes, source: str) -> JobResult:
    """Parse stored bytes; raise CorruptRecordError naming ``source`` if they are not a v1 result."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CorruptRecordError(f"job result {source} is not valid JSON (partial or damaged write?): {exc}. "
                                 f"Move it aside with `steward jobs quarantine`.") from exc
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise CorruptRecordError(f"job result {source} has unknown version {version!r} (this spark-steward reads "
                                 f"version {VERSION}); upgrade spark-steward or quarantine the file")
    try:
        return JobResult.from_dict(doc["result"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptRecordError(f"job result {source} is malformed: {type(exc).__name__}: {exc}") from exc
