"""The typed messages of the ``blob.*`` ops (FLIP-19): the requests and replies of the driver agent's
:class:`~sparksteward.blob.server.BlobServer` and of each executor agent's
:class:`~sparksteward.blob.cache.BlobCache`.

Each request is the JSON object the op has always carried (see :mod:`sparksteward.wire.messages`).
``blob.put`` is followed by the blob's bytes (a body the server reads itself); ``blob.get`` is answered
by a reply followed by them, or, on the server's own host, by the path of its file. Two ops are served
by both agents: ``blob.open_file`` (a ``steward://`` URL opened through the agent's store or cache) and
``blob.libraries`` (the driver answers with the libraries, an executor agent with the importable paths
of its cached copies of them).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from sparksteward.blob.key import TYPES_BY_VALUE, BlobKey, BlobType
from sparksteward.errors import InvalidIdError
from sparksteward.ids import validate_job_id
from sparksteward.wire import Fields
from sparksteward.wire.messages import Message, custom, flag, integer, mapping, op, sequence, text
from sparksteward.wire.messages import job_id as job_field

__all__ = ["BlobAcquireRequest", "BlobAddLibraryReply", "BlobAddLibraryRequest", "BlobCacheStatsRequest",
           "BlobDeleteJobRequest", "BlobDeletedJobsReply", "BlobDeletedJobsRequest", "BlobDone", "BlobGetReply",
           "BlobGetRequest", "BlobInfoReply", "BlobInfoRequest", "BlobLibrariesReply", "BlobLibrariesRequest",
           "BlobListReply", "BlobListRequest", "BlobOpenFileReply", "BlobOpenFileRequest", "BlobOpenReply",
           "BlobOpenRequest", "BlobPutPathRequest", "BlobPutReply", "BlobPutRequest", "BlobRefsReply",
           "BlobReleaseRequest", "BlobReleaseTaskRequest", "BlobStatsReply", "BlobStatsRequest"]

_ANY = sys.maxsize   # replies: a list is as long as the agent made it (the frame bound still applies)


def _key() -> Any:
    """A blob key: its text (``p-<32 hex>`` or ``t-<32 hex>``) on the wire, a :class:`BlobKey` here."""
    return custom(lambda f, n: BlobKey.parse(f.text(n, max_len=64)), str, fast="type(v) is str and len(v) == 34",
                  convert=BlobKey.parse)


def _type() -> Any:
    """The blob type: ``"p"`` (permanent) or ``"t"`` (transient, the default)."""
    return custom(lambda f, n: TYPES_BY_VALUE[f.text(n, default="t", choices=("p", "t"))], lambda t: t.value,
                  default=BlobType.TRANSIENT)


def _job_or_none(value: object) -> str | None:
    return None if value is None else validate_job_id(value)


def _job_ids(f: Fields, name: str) -> list[str | None]:
    value = f.req.get(name)
    if not isinstance(value, list):
        raise InvalidIdError(f"blob.deleted_jobs takes a list of job ids in 'job_ids', not {value!r}")
    return [_job_or_none(j) for j in value]


# --- replies --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlobDone(Message):
    """An empty reply: the op is done."""


@dataclass(frozen=True, slots=True)
class BlobInfoReply(Message):
    incoming: str = text()     # the server's incoming directory, where same-host clients stage puts
    pid: int = integer()


@dataclass(frozen=True, slots=True)
class BlobPutReply(Message):
    key: BlobKey = _key()
    size: int = integer(lo=0)
    ha: bool = flag()          # a permanent blob is durable in the HA store


@dataclass(frozen=True, slots=True)
class BlobGetReply(Message):
    """``size`` bytes follow it as a body, or, for a caller on the server's kernel, ``path`` names the
    server's file and nothing follows."""

    size: int = integer(lo=0)
    path: str | None = text(default=None, omit_none=True)


@dataclass(frozen=True, slots=True)
class BlobRefsReply(Message):
    refs: int = integer(lo=0)  # the references left on the blob


@dataclass(frozen=True, slots=True)
class BlobDeletedJobsReply(Message):
    deleted: list[str | None] = sequence(max_items=_ANY)


@dataclass(frozen=True, slots=True)
class BlobListReply(Message):
    blobs: list[dict[str, Any]] = sequence(max_items=_ANY, of=dict)   # {job_dir, key, size, refs}


@dataclass(frozen=True, slots=True)
class BlobStatsReply(Message):
    stats: dict[str, int] = mapping()


@dataclass(frozen=True, slots=True)
class BlobAddLibraryReply(Message):
    version: int = integer(lo=0)   # the version of the library list: its length


@dataclass(frozen=True, slots=True)
class BlobLibrariesReply(Message):
    """The driver's answer carries ``libraries`` ({job_id, key, name}); an executor agent's carries the
    importable ``paths`` of its cached copies."""

    version: int = integer(lo=0)
    libraries: list[dict[str, Any]] | None = sequence(default=None, max_items=_ANY, omit_none=True)
    paths: list[str] | None = sequence(default=None, max_items=_ANY, omit_none=True)


@dataclass(frozen=True, slots=True)
class BlobOpenFileReply(Message):
    path: str = text()
    size: int = integer(lo=0)


@dataclass(frozen=True, slots=True)
class BlobOpenReply(Message):
    path: str = text()


# --- the driver agent's BlobServer ------------------------------------------------------------------------
@op("blob.info", reply=BlobInfoReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class BlobInfoRequest(Message):
    """Name the BlobServer's incoming directory, where a client on its host stages files for ``blob.put_path``."""


@op("blob.put", reply=BlobPutReply, streams=True)
@dataclass(frozen=True, slots=True)
class BlobPutRequest(Message):
    """Store the ``size`` bytes that follow as a blob of the job (content-addressed: a second put of the
    same bytes is a no-op); a permanent one is in the HA store before the reply."""

    job_id: str | None = job_field(nullable=True)
    size: int = integer(lo=0)
    type: BlobType = _type()


@op("blob.put_path", reply=BlobPutReply)
@dataclass(frozen=True, slots=True)
class BlobPutPathRequest(Message):
    """Store a file a client on the server's host staged in its incoming directory (moved or copied
    into place: no bytes cross the socket)."""

    path: str = text()
    job_id: str | None = job_field(nullable=True)
    type: BlobType = _type()
    move: bool = flag(default=False)


@op("blob.get", reply=BlobGetReply, repeatable=True, streams=True)
@dataclass(frozen=True, slots=True)
class BlobGetRequest(Message):
    """Download a blob: a reply followed by its bytes, or, for a caller whose ``boot_id`` is the server's
    (the same kernel), the path of the server's verified file to copy in-kernel."""

    job_id: str | None = job_field(nullable=True)
    key: BlobKey = _key()
    boot_id: str | None = text(default=None, omit_none=True)


@op("blob.acquire", reply=BlobRefsReply)
@dataclass(frozen=True, slots=True)
class BlobAcquireRequest(Message):
    """Take a reference on a blob: staged cleanup never deletes a referenced blob."""

    key: BlobKey = _key()
    job_id: str | None = job_field(nullable=True)


@op("blob.release", reply=BlobRefsReply)
@dataclass(frozen=True, slots=True)
class BlobReleaseRequest(Message):
    """Drop a reference on a blob; at none left, staged cleanup deletes it after one to two retention intervals."""

    key: BlobKey = _key()
    job_id: str | None = job_field(nullable=True)


@op("blob.delete_job", reply=BlobDone)
@dataclass(frozen=True, slots=True)
class BlobDeleteJobRequest(Message):
    """Delete every blob of a job from local and HA storage, whatever its references (idempotent)."""

    job_id: str | None = job_field(nullable=True)


@op("blob.deleted_jobs", reply=BlobDeletedJobsReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class BlobDeletedJobsRequest(Message):
    """Say which of ``job_ids`` had their blobs deleted, so that executor caches drop their copies."""

    job_ids: list[str | None] = custom(_job_ids)


@op("blob.list", reply=BlobListReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class BlobListRequest(Message):
    """List the blobs in the server's local store, with their sizes and references."""


@op("blob.stats", reply=BlobStatsReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class BlobStatsRequest(Message):
    """Read the BlobServer's counters (uploads, dedup hits, bytes served, HA fetches, cleanup, ...)."""


@op("blob.add_library", reply=BlobAddLibraryReply)
@dataclass(frozen=True, slots=True)
class BlobAddLibraryRequest(Message):
    """Add a stored blob to the application's libraries, importable in every Python worker from then on."""

    job_id: str | None = job_field(nullable=True)
    key: BlobKey = _key()
    name: str = text(max_len=4096)   # validate_library_name bounds it further


@op("blob.libraries", reply=BlobLibrariesReply, repeatable=True, served_by="both")
@dataclass(frozen=True, slots=True)
class BlobLibrariesRequest(Message):
    """List the application's libraries: the driver agent names the blobs, an executor agent answers
    with the importable paths of its cached copies."""


@op("blob.open_file", reply=BlobOpenFileReply, repeatable=True, served_by="both")
@dataclass(frozen=True, slots=True)
class BlobOpenFileRequest(Message):
    """Open a ``steward://`` URL of this application (or its cluster): the path and size of the agent's
    verified local copy."""

    url: str = text(max_len=4096)


# --- each executor agent's BlobCache ----------------------------------------------------------------------
@op("blob.open", reply=BlobOpenReply, served_by="executor")
@dataclass(frozen=True, slots=True)
class BlobOpenRequest(Message):
    """Open a blob through the executor's cache (fetched once per executor) for a task attempt, whose
    reference keeps it from eviction until the attempt ends."""

    key: BlobKey = _key()
    job_id: str | None = job_field(nullable=True)
    task_attempt_id: int | None = integer(default=None, lo=0)


@op("blob.release_task", reply=BlobDone, served_by="executor")
@dataclass(frozen=True, slots=True)
class BlobReleaseTaskRequest(Message):
    """Release every cache reference of one task attempt."""

    task_attempt_id: int = integer(lo=0)


@op("blob.cache_stats", reply=BlobStatsReply, repeatable=True, served_by="executor")
@dataclass(frozen=True, slots=True)
class BlobCacheStatsRequest(Message):
    """Read the executor cache's counters (hits, transfers, HA fetches, local copies, evictions, ...)."""
