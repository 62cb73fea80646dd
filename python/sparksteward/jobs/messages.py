"""The typed messages of the ``jobs.*`` ops (FLIP-194), served by the driver agent's
:class:`~sparksteward.jobs.service.JobService` (:meth:`~sparksteward.jobs.service.JobService.register_handlers`)
and sent by the user's driver (:class:`~sparksteward.jobscope.JobScope`,
:class:`~sparksteward.jobscope.JobResults`).

Each request is the JSON object the op has always carried (see :mod:`sparksteward.wire.messages`).
Entries travel as :meth:`JobResultEntry.to_dict <sparksteward.jobs.result.JobResultEntry.to_dict>`
objects, read with ``JobResultEntry.from_dict``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from sparksteward.errors import InvalidRequestError
from sparksteward.jobs.result import MAX_CHECKPOINTS, FinalCheckpoint, JobStatus
from sparksteward.wire import Fields
from sparksteward.wire.messages import Message, custom, flag, integer, mapping, nested, number, op, sequence, text
from sparksteward.wire.messages import job_id as job_field

__all__ = ["MAX_WAIT", "JobAddCleanupRequest", "JobBeginReply", "JobBeginRequest", "JobCleanupStep", "JobDone",
           "JobEntryReply", "JobFinishReply", "JobFinishRequest", "JobGetRequest", "JobListReply", "JobListRequest"]

#: The longest ``jobs.finish`` may ask to wait for its commit (seconds).
MAX_WAIT = 7 * 86400.0
_ANY = sys.maxsize   # replies: a list is as long as the agent made it (the frame bound still applies)


def _checkpoints(f: Fields, name: str) -> tuple[FinalCheckpoint, ...]:
    raw = f.req.get(name) or []
    if not isinstance(raw, list) or len(raw) > MAX_CHECKPOINTS:
        raise InvalidRequestError(f"{f.op}: checkpoints must be a list of at most {MAX_CHECKPOINTS} "
                                  f"{{state, checkpoint_id, path}} objects")
    return tuple(FinalCheckpoint.from_dict(c) for c in raw)


# --- replies --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobDone(Message):
    """An empty reply: the op is done."""


@dataclass(frozen=True, slots=True)
class JobBeginReply(Message):
    """``started``, or not: then ``message`` says why and ``entry`` is the stored result that refused it."""

    started: bool = flag()
    message: str | None = text(default=None, omit_none=True)
    entry: dict[str, Any] | None = mapping(default=None, omit_none=True)


@dataclass(frozen=True, slots=True)
class JobEntryReply(Message):
    entry: dict[str, Any] | None = mapping(default=None)   # a JobResultEntry.to_dict(); None: no result


@dataclass(frozen=True, slots=True)
class JobFinishReply(Message):
    entry: dict[str, Any] = mapping()   # a JobResultEntry.to_dict(): clean if the commit happened in time


@dataclass(frozen=True, slots=True)
class JobListReply(Message):
    """One page of entries, sorted by job id; ``next`` is the cursor of the next page (None: the last)."""

    entries: list[dict[str, Any]] = sequence(max_items=_ANY, of=dict)
    corrupt: list[Any] = sequence(default=[], max_items=_ANY)   # [path, why] of unreadable files (first page)
    next: str | None = text(default=None)


# --- requests -------------------------------------------------------------------------------------------
@op("jobs.begin", reply=JobBeginReply)
@dataclass(frozen=True, slots=True)
class JobBeginRequest(Message):
    """Start a scoped job (``st.job``); refused with its stored result if the job id already has one,
    unless ``force``."""

    job_id: str = job_field()
    force: bool = flag(default=False)


@dataclass(frozen=True, slots=True)
class JobCleanupStep(Message):
    """A cleanup step: its kind (``delete_path``, ...) and target."""

    kind: str = text()
    target: str = text()


@op("jobs.add_cleanup", reply=JobDone)
@dataclass(frozen=True, slots=True)
class JobAddCleanupRequest(Message):
    """Add a cleanup step (such as deleting a path) to run when the job reaches a final state."""

    job_id: str = job_field()
    step: JobCleanupStep = nested(JobCleanupStep)


@op("jobs.finish", reply=JobFinishReply)
@dataclass(frozen=True, slots=True)
class JobFinishRequest(Message):
    """Finish a job: write its result dirty, run its cleanup and wait up to ``wait`` seconds (null: the
    cleanup shutdown timeout) for the commit; the reply is the entry as it then stands."""

    job_id: str = job_field()
    status: JobStatus = custom(lambda f, n: JobStatus.parse(f.text(n, max_len=32)), lambda s: JobStatus.parse(s).value)
    failure: dict[str, Any] | None = mapping(default=None)
    payload: Any = custom(lambda f, n: f.req.get(n), default=None)   # any JSON value
    wait: float | None = number(default=None, lo=0, hi=MAX_WAIT)
    checkpoints: tuple[FinalCheckpoint, ...] = custom(_checkpoints, lambda cs: [c.to_dict() for c in cs],
                                                      default=())


@op("jobs.get", reply=JobEntryReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class JobGetRequest(Message):
    """Read the stored result of a job (dirty or clean), or null."""

    job_id: str = job_field()


@op("jobs.list", reply=JobListReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class JobListRequest(Message):
    """List the stored results of this cluster id, a page at a time (after ``cursor``, at most ``limit``)."""

    limit: int | None = integer(default=None, lo=1, hi=100_000, omit_none=True)   # None: 1000
    cursor: str | None = text(default=None, omit_none=True)
