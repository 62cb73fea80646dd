"""Ids that name directories and files: cluster ids and job ids.

A cluster id must already be filename-safe. A job id may be any printable text without path
separators; :func:`job_id_to_filename` encodes it reversibly (percent-encoding) so that it is always a
single safe file name, and :func:`job_id_from_filename` decodes it. Ids that could escape their
directory (``..``, ``/``, ``\\``, NUL, control characters) are rejected with :class:`InvalidIdError`.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from sparksteward.errors import InvalidIdError

__all__ = ["MAX_ID_LENGTH", "job_id_from_filename", "job_id_to_filename", "validate_id", "validate_job_id"]

MAX_ID_LENGTH = 200
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SAFE_CHARS = "-._"  # quote() keeps ASCII letters and digits, plus these
_RESERVED_SUFFIX = "_DIRTY"


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a filename-safe id (letters, digits, ``.``, ``_``, ``-``)."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or not _SAFE.match(value):
        raise InvalidIdError(
            f"{what} {value!r} is not valid: use 1 to {MAX_ID_LENGTH} letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    return value


def validate_job_id(value: object) -> str:
    """Return ``value`` if it can name a job; reject anything that could escape a directory."""
    if not isinstance(value, str):
        raise InvalidIdError(f"job id {value!r} is not valid: it must be a string, not {type(value).__name__}")
    problem = None
    if not value.strip():
        problem = "it is empty"
    elif len(value) > MAX_ID_LENGTH:
        problem = f"it is longer than {MAX_ID_LENGTH} characters"
    elif value in (".", "..") or "/" in value or "\\" in value:
        problem = "it contains a path separator or is '.'/'..', which could escape the store directory"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        problem = "it contains control characters"
    if problem:
        raise InvalidIdError(
            f"job id {value!r} is not valid: {problem}. Use printable text without '/' or '\\', "
            f"such as 'ingest-2026-11-22'"
        )
    return value


def job_id_to_filename(job_id: str) -> str:
    """Encode a job id into one safe file-name stem, reversibly.

    Filename-safe ids map to themselves, except that a leading ``.`` and a trailing ``_DIRTY`` are
    escaped so they cannot hide a file or collide with a dirty marker.
    """
    validate_job_id(job_id)
    name = quote(job_id, safe=_SAFE_CHARS)
    if name.startswith("."):
        name = "%2E" + name[1:]
    if name.endswith(_RESERVED_SUFFIX):
        name = name[: -len(_RESERVED_SUFFIX)] + "%5FDIRTY"
    return name


def job_id_from_filename(stem: str) -> str:
    """Decode a stem written by :func:`job_id_to_filename`; reject stems it could not have written."""
    job_id = unquote(stem, errors="strict")
    try:
        ok = job_id_to_filename(job_id) == stem
    except InvalidIdError:
        ok = False
    if not ok:
        raise InvalidIdError(f"file name {stem!r} does not encode a job id")
    return job_id
