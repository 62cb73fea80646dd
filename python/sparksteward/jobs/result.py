"""Job results: immutable records with one versioned JSON encoding (orjson, never pickle).

A stored file holds ``{"version": 1, "result": {...}}``::

    {"version": 1,
     "result": {"job_id": "ingest-2026-11-22", "cluster_id": "default", "application_id": "app-1",
                "status": "SUCCEEDED", "start_time": 1700000000.0, "end_time": 1700000060.0,
                "spark_jobs": [{"id": 3, "outcome": "succeeded", "reason": null}],
                "failure": null,
                "payload": {"rows": 42},
                "cleanup": [{"kind": "delete_path", "target": "s3://bkt/tmp/x", "state": "done",
                             "attempts": 1, "last_error": null, "next_attempt_at": null}],
                "checkpoints": [{"state": "clicks", "checkpoint_id": 7,
                                 "path": "s3://bkt/chk/default/clicks/chk-7"}]}}

``checkpoints`` (absent in older records, read as empty) keeps each keyed state's final checkpoint of the
job, as FLIP-194 keeps a job's final checkpoint with its result.

:meth:`JobResult.from_json` rejects unknown versions and malformed input with
:class:`~sparksteward.errors.CorruptRecordError` naming the file. Every record validates its fields in
``__post_init__`` and raises :class:`~sparksteward.errors.InvalidRecordError` (or
:class:`~sparksteward.errors.InvalidIdError` for ids) when given a value it cannot hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from sparksteward.enums import ParsedEnum
from sparksteward.errors import CorruptRecordError, InvalidRecordError
from sparksteward.ids import validate_id, validate_job_id

__all__ = ["Failure", "FinalCheckpoint", "JobResult", "JobResultEntry", "JobStatus", "MAX_PAYLOAD_BYTES", "MAX_SPARK_JOBS",
           "STEP_STATES", "SparkJobOutcome", "StepState", "VERSION", "decode_result", "encode_result"]

VERSION = 1
"""The record version this code writes and reads."""
MAX_SPARK_JOBS = 1000
"""Spark jobs kept per result; later ones are counted by the service but not recorded."""
MAX_PAYLOAD_BYTES = 1 << 20
"""Largest encoded user payload. Keep big results elsewhere and store their path."""
MAX_CHECKPOINTS = 1000
"""Keyed states whose final checkpoint a result records."""
STEP_STATES = ("pending", "done", "failed")


def _fail(record: str, problem: str) -> InvalidRecordError:
    return InvalidRecordError(f"{record}: {problem}")


def _check_str(record: str, name: str, value: object, *, optional: bool = False, empty: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (not empty and not value):
        raise _fail(record, f"{name} must be a {'non-empty ' if not empty else ''}string"
                            f"{' or None' if optional else ''}, not {value!r}")


def _check_time(record: str, name: str, value: object, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _fail(record, f"{name} must be seconds since the epoch (a finite number >= 0), not {value!r}")
    return float(value)


class JobStatus(ParsedEnum):
    """Final status of a job; ``parse`` takes a JobStatus or its name in any case (``CANCELED`` is accepted)."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @classmethod
    def _text(cls, value: object) -> str | None:
        if not isinstance(value, str):
            return None
        name = value.strip().upper()
        return "CANCELLED" if name == "CANCELED" else name

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        return InvalidRecordError(f"job status {value!r} is not one of {', '.join(m.value for m in cls)}")


@dataclass(frozen=True, slots=True)
class SparkJobOutcome:
    """One Spark job that ran inside a steward job.

    ``outcome`` is ``running`` (it had not ended when the job finished), ``succeeded`` or ``failed``;
    ``reason`` is Spark's failure text, if any.
    """

    spark_job_id: int
    outcome: str
    reason: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.spark_job_id, bool) or not isinstance(self.spark_job_id, int) or self.spark_job_id < 0:
            raise _fail("spark job", f"id must be an integer >= 0, not {self.spark_job_id!r}")
        _check_str("spark job", "outcome", self.outcome, empty=False)
        _check_str("spark job", "reason", self.reason, optional=True)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.spark_job_id, "outcome": self.outcome, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Any) -> SparkJobOutcome:
        if isinstance(d, (list, tuple)) and len(d) == 3:  # the compact form, also accepted
            return cls(*d)
        return cls(d["id"], d["outcome"], d.get("reason"))


@dataclass(frozen=True, slots=True)
class FinalCheckpoint:
    """The last checkpoint a job completed for one keyed state (FLIP-194 keeps it with the result).

    ``state`` is the keyed state's name, ``checkpoint_id`` the id of its last completed checkpoint in the
    job, and ``path`` the URL of that checkpoint's directory (``.../chk-N``), which ``restore_from`` takes.
    """

    state: str
    checkpoint_id: int
    path: str

    def __post_init__(self) -> None:
        _check_str("final checkpoint", "state", self.state, empty=False)
        _check_str("final checkpoint", "path", self.path, empty=False)
        if isinstance(self.checkpoint_id, bool) or not isinstance(self.checkpoint_id, int) or self.checkpoint_id < 0:
            raise _fail("final checkpoint", f"checkpoint_id must be an integer >= 0, not {self.checkpoint_id!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "checkpoint_id": self.checkpoint_id, "path": self.path}

    @classmethod
    def from_dict(cls, d: Any) -> FinalCheckpoint:
        if not isinstance(d, dict):
            raise _fail("final checkpoint", f"expected {{state, checkpoint_id, path}}, not {d!r}")
        fields: Any = d  # unchecked JSON values: __post_init__ validates them
        return cls(fields.get("state"), fields.get("checkpoint_id"), fields.get("path"))


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a job failed: the exception type, its message and where it was raised (``file:line in fn``)."""

    type: str
    message: str
    where: str = ""

    def __post_init__(self) -> None:
        for name in ("type", "message", "where"):
            _check_str("failure", name, getattr(self, name))

    @classmethod
    def from_exception(cls, exc: BaseException, where: str = "") -> Failure:
        return cls(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), where)

    @classmethod
    def coerce(cls, value: Failure | dict[str, Any] | None) -> Failure | None:
        """A Failure from a Failure, a ``{type, message, where}`` dict, or None."""
        if value is None or isinstance(value, Failure):
            return value
        if isinstance(value, dict):
            return cls(str(value.get("type") or ""), str(value.get("message") or ""), str(value.get("where") or ""))
        raise _fail("failure", f"expected a Failure or a {{type, message, where}} dict, not {value!r}")

    def to_dict(self) -> dict[str, str]:
        return {"type": self.type, "message": self.message, "where": self.where}


@dataclass(frozen=True, slots=True)
class StepState:
    """Progress of one cleanup step.

    ``state`` is ``pending`` (not tried yet), ``done`` or ``failed`` (``last_error`` says why;
    ``next_attempt_at`` is when the driver that recorded it meant to retry, or None if it gave up).
    """

    kind: str
    target: str
    state: str = "pending"
    attempts: int = 0
    last_error: str | None = None
    next_attempt_at: float | None = None

    def __post_init__(self) -> None:
        _check_str("cleanup step", "kind", self.kind, empty=False)
        _check_str("cleanup step", "target", self.target, empty=False)
        if self.state not in STEP_STATES:
            raise _fail("cleanup step", f"state {self.state!r} is not one of {', '.join(STEP_STATES)}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 0:
            raise _fail("cleanup step", f"attempts must be an integer >= 0, not {self.attempts!r}")
        _check_str("cleanup step", "last_error", self.last_error, optional=True)
        object.__setattr__(self, "next_attempt_at",
                           _check_time("cleanup step", "next_attempt_at", self.next_attempt_at, optional=True))

    @property
    def done(self) -> bool:
        return self.state == "done"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "state": self.state, "attempts": self.attempts,
                "last_error": self.last_error, "next_attempt_at": self.next_attempt_at}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepState:
        return cls(d["kind"], d["target"], d.get("state", "pending"), d.get("attempts", 0),
                   d.get("last_error"), d.get("next_attempt_at"))


@dataclass(frozen=True, slots=True)
class JobResult:
    """The durable result of one job, identified by (cluster id, job id).

    Parameters
    ----------
    job_id, cluster_id
        The job's global identity. ``job_id`` is any printable text without path separators.
    application_id
        The Spark application that ran the job, if known.
    status
        The final :class:`JobStatus` (a status name is accepted too).
    start_time, end_time
        Seconds since the epoch.
    spark_jobs
        The Spark jobs that ran inside the job, with their outcomes.
    failure
        Why the job failed or was cancelled, or None.
    payload
        Any JSON value the job set as its result (at most :data:`MAX_PAYLOAD_BYTES` encoded).
    cleanup
        The state of each cleanup step.
    run_id
        The identity of the run that wrote the result (random, one per ``begin``). Every update and
        commit of a stored entry compares it, so an older run's cleanup never overwrites or commits
        over a newer run of the same job id. None in records written before runs had identities.
    """

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
    run_id: str | None = None
    checkpoints: tuple[FinalCheckpoint, ...] = ()

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)
        validate_id(self.cluster_id, "cluster id")
        record = f"job result {self.job_id!r}"
        _check_str(record, "application_id", self.application_id, optional=True)
        _check_str(record, "run_id", self.run_id, optional=True, empty=False)
        object.__setattr__(self, "status", JobStatus.parse(self.status))
        object.__setattr__(self, "start_time", _check_time(record, "start_time", self.start_time))
        object.__setattr__(self, "end_time", _check_time(record, "end_time", self.end_time))
        for name, typ in (("spark_jobs", SparkJobOutcome), ("cleanup", StepState),
                          ("checkpoints", FinalCheckpoint)):
            items = getattr(self, name)
            if not isinstance(items, (tuple, list)) or not all(isinstance(i, typ) for i in items):
                raise _fail(record, f"{name} must be a sequence of {typ.__name__}, not {items!r}")
            object.__setattr__(self, name, tuple(items))
        if len(self.spark_jobs) > MAX_SPARK_JOBS:
            raise _fail(record, f"{len(self.spark_jobs)} spark jobs; at most {MAX_SPARK_JOBS} are kept")
        if len(self.checkpoints) > MAX_CHECKPOINTS:
            raise _fail(record, f"{len(self.checkpoints)} final checkpoints; at most {MAX_CHECKPOINTS} are kept")
        if self.failure is not None and not isinstance(self.failure, Failure):
            raise _fail(record, f"failure must be a Failure or None, not {self.failure!r}")
        try:
            size = len(orjson.dumps(self.payload))
        except TypeError as exc:
            raise _fail(record, f"the payload must be a JSON value (dict, list, str, number, bool or "
                                f"None): {exc}") from exc
        if size > MAX_PAYLOAD_BYTES:
            raise _fail(record, f"the payload encodes to {size} bytes; the limit is {MAX_PAYLOAD_BYTES}. "
                                f"Store large results elsewhere and keep their path in the payload")

    # --- derived -----------------------------------------------------------------------------
    @property
    def cleanup_done(self) -> bool:
        """True if every cleanup step is done (vacuously, with no steps)."""
        return all(s.done for s in self.cleanup)

    @property
    def steps_done(self) -> int:
        return sum(s.done for s in self.cleanup)

    def with_cleanup(self, cleanup: tuple[StepState, ...] | list[StepState]) -> JobResult:
        return replace(self, cleanup=tuple(cleanup))

    # --- encoding ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "cluster_id": self.cluster_id, "application_id": self.application_id,
            "status": self.status.value, "start_time": self.start_time, "end_time": self.end_time,
            "spark_jobs": [j.to_dict() for j in self.spark_jobs],
            "failure": None if self.failure is None else self.failure.to_dict(),
            "payload": self.payload,
            "cleanup": [s.to_dict() for s in self.cleanup],
            "run_id": self.run_id,
            "checkpoints": [c.to_dict() for c in self.checkpoints],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResult:
        """Build from :meth:`to_dict`'s form. Raises KeyError, TypeError or ValueError if malformed."""
        if not isinstance(d, dict):
            raise TypeError(f"a job result must be an object, not {type(d).__name__}")
        failure = d.get("failure")
        return cls(
            job_id=d["job_id"], cluster_id=d["cluster_id"], application_id=d.get("application_id"),
            status=JobStatus.parse(d["status"]), start_time=d["start_time"], end_time=d["end_time"],
            spark_jobs=tuple(SparkJobOutcome.from_dict(j) for j in d.get("spark_jobs") or ()),
            failure=None if failure is None else Failure(failure["type"], failure["message"], failure.get("where", "")),
            payload=d.get("payload"),
            cleanup=tuple(StepState.from_dict(s) for s in d.get("cleanup") or ()),
            run_id=d.get("run_id"),
            checkpoints=tuple(FinalCheckpoint.from_dict(c) for c in d.get("checkpoints") or ()),
        )

    def to_json(self) -> bytes:
        """The stored bytes: ``{"version": 1, "result": {...}}``."""
        return orjson.dumps({"version": VERSION, "result": self.to_dict()}, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes, source: str) -> JobResult:
        """Parse stored bytes.

        Raises
        ------
        CorruptRecordError
            If ``data`` is partial, unparsable, of an unknown version or malformed; the message names
            ``source`` (the file or URL it came from) and how to get rid of it.
        """
        hint = "Move it aside with `steward jobs quarantine`, or delete it if the job may run again."
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            what = "is empty" if not data else "is not valid JSON (a partial or damaged write?)"
            raise CorruptRecordError(f"job result {source} {what}: {exc}. {hint}") from exc
        if not isinstance(doc, dict) or "version" not in doc:
            raise CorruptRecordError(f"job result {source} is not a versioned job result record "
                                     f"(expected {{\"version\": {VERSION}, \"result\": ...}}). {hint}")
        if doc["version"] != VERSION:
            raise CorruptRecordError(f"job result {source} has version {doc['version']!r}, but this spark-steward "
                                     f"reads version {VERSION}. Upgrade spark-steward, or: {hint}")
        try:
            return cls.from_dict(doc["result"])
        except (KeyError, TypeError, ValueError) as exc:  # InvalidRecordError and InvalidIdError are ValueErrors
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CorruptRecordError(f"job result {source} is malformed: {what}. {hint}") from exc


@dataclass(frozen=True)
class JobResultEntry:
    """A stored result, whether its cleanup has committed (``clean``) or not (dirty), and where it is.

    ``source`` is the file or URL the entry was read from or written to; it does not take part in
    equality.
    """

    result: JobResult
    clean: bool
    source: str = field(default="", compare=False)

    @property
    def dirty(self) -> bool:
        return not self.clean

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
        """``clean`` or ``dirty``."""
        return "clean" if self.clean else "dirty"

    def to_dict(self) -> dict[str, Any]:
        """The wire form (agent to client): ``{state, source, result}``."""
        return {"state": self.state, "source": self.source, "result": self.result.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResultEntry:
        if d.get("state") not in ("clean", "dirty"):
            raise InvalidRecordError(f"job result entry state {d.get('state')!r} is not 'clean' or 'dirty'")
        return cls(JobResult.from_dict(d["result"]), d["state"] == "clean", d.get("source", ""))

    def __str__(self) -> str:
        r = self.result
        return (f"job {r.job_id!r} (cluster {r.cluster_id!r}): {r.status.value}, {self.state}, "
                f"{r.steps_done}/{len(r.cleanup)} cleanup steps done")


def encode_result(result: JobResult) -> bytes:
    """The stored bytes of ``result`` (same as :meth:`JobResult.to_json`)."""
    return result.to_json()


def decode_result(data: bytes, source: str) -> JobResult:
    """Parse stored bytes (same as :meth:`JobResult.from_json`)."""
    return JobResult.from_json(data, source)
