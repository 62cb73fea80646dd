"""Ids that name directories and files: cluster ids and job ids.

A cluster id must already be filename-safe. A job id may be any printable text up to
:data:`MAX_ID_LENGTH` characters; ``/`` is allowed (``daily/2026-11-22``), but an id that is empty,
``.``/``..``, or has a ``.``/``..`` or empty segment between slashes is refused, as are ``\\``, NUL and control
characters (:class:`InvalidIdError`).

:func:`job_id_to_filename` encodes a job id into one safe file-name stem:

- lower-case ASCII letters, digits, ``-``, ``.`` and ``_`` stay as they are;
- an upper-case letter ``X`` becomes ``^x``, so that two ids differing only in case never map to
  names that a case-insensitive store (macOS, Windows, some SMB/NFS servers) would treat as one;
- every other byte of the UTF-8 form becomes ``%XX`` (upper-case hex digits only);
- a leading ``.`` and a trailing ``_dirty`` are escaped, so a name can hide no file and collide with
  no dirty marker;
- a stem longer than :data:`MAX_STEM_BYTES` keeps a readable prefix and ends in ``~`` plus 32 hex
  digits of the id's SHA-256. Such a stem is not reversible: :func:`job_id_from_filename` refuses
  it (:func:`is_hashed_filename` tells it apart) and the id is read from the record the file holds (every record stores its id, and
  readers check it).
"""

from __future__ import annotations

import hashlib
import re

from sparksteward.errors import InvalidIdError

__all__ = ["MAX_ID_LENGTH", "MAX_STEM_BYTES", "is_hashed_filename", "job_id_from_filename", "job_id_to_filename",
           "validate_id", "validate_job_id"]

MAX_ID_LENGTH = 200
MAX_STEM_BYTES = 120
"""Longest encoded stem, in bytes. Suffixes (``_DIRTY.json``, staged ``.tmp`` names, quarantine
tags) keep every file name well under the usual 255-byte limit."""
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_KEEP = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")
_HASH_MARK = "~"
_HASH_HEX = 32
_STEM = re.compile(r"(?:[a-z0-9._-]|\^[a-z]|%[0-9A-F]{2})+")
_HASHED = re.compile(rf"(?:[a-z0-9._-]|\^[a-z]|%[0-9A-F]{{2}})*{_HASH_MARK}[0-9a-f]{{{_HASH_HEX}}}")
_DIRTY_TAIL = "_dirty"


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a filename-safe id (letters, digits, ``.``, ``_``, ``-``)."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or not _SAFE.fullmatch(value):
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
    elif value in (".", ".."):
        problem = f"{value!r} names a directory, not a job"
    elif any(seg in (".", "..") for seg in value.split("/")):
        problem = "it has a '.' or '..' segment between slashes, which reads as a relative path"
    elif "" in value.split("/"):
        problem = "it starts or ends with '/' or has '//' (an empty segment between slashes)"
    elif "\\" in value:
        problem = "it contains '\\', which is a path separator on some systems"
    elif any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value):
        problem = "it contains control characters"
    if problem:
        raise InvalidIdError(
            f"job id {value!r} is not valid: {problem}. Use printable text such as 'ingest-2026-11-22' or "
            f"'daily/2026-11-22'"
        )
    return value


def _encode(job_id: str) -> list[str]:
    """The id as a list of encoded units (one per kept character, ``^x`` or ``%XX``)."""
    units: list[str] = []
    for ch in job_id:
        if ch in _KEEP:
            units.append(ch)
        elif "A" <= ch <= "Z":
            units.append("^" + ch.lower())
        else:  # one unit per character, so a hashed stem's prefix never splits one
            units.append("".join(f"%{b:02X}" for b in ch.encode("utf-8")))
    if units and units[0] == ".":
        units[0] = "%2E"
    if "".join(units[-len(_DIRTY_TAIL):]) == _DIRTY_TAIL:  # each of those units is one character
        units[-len(_DIRTY_TAIL)] = "%5F"
    return units


def job_id_to_filename(job_id: str) -> str:
    """Encode a job id into one safe file-name stem (see the module docstring).

    Short ids round-trip through :func:`job_id_from_filename`; ids whose encoding exceeds
    :data:`MAX_STEM_BYTES` get a hashed stem that :func:`is_hashed_filename` recognizes.
    """
    validate_job_id(job_id)
    units = _encode(job_id)
    stem = "".join(units)
    if len(stem) <= MAX_STEM_BYTES:
        return stem
    digest = hashlib.sha256(job_id.encode("utf-8")).hexdigest()[:_HASH_HEX]
    budget = MAX_STEM_BYTES - len(_HASH_MARK) - _HASH_HEX
    prefix, size = [], 0
    for unit in units:  # whole units only: the prefix never ends inside an escape
        if size + len(unit) > budget:
            break
        prefix.append(unit)
        size += len(unit)
    return "".join(prefix) + _HASH_MARK + digest


def is_hashed_filename(stem: str) -> bool:
    """True if ``stem`` is a hashed (irreversible) stem written by :func:`job_id_to_filename`."""
    return len(stem) <= MAX_STEM_BYTES and _HASHED.fullmatch(stem) is not None


def _decode(stem: str) -> str:
    out = bytearray()
    i = 0
    while i < len(stem):
        c = stem[i]
        if c == "%":
            out.append(int(stem[i + 1:i + 3], 16))
            i += 3
        elif c == "^":
            out += stem[i + 1].upper().encode()
            i += 2
        else:
            out += c.encode()
            i += 1
    return out.decode("utf-8")


def job_id_from_filename(stem: str) -> str:
    """Decode a stem written by :func:`job_id_to_filename`.

    Raises InvalidIdError for a stem that :func:`job_id_to_filename` could not have written, and for
    a hashed stem (:func:`is_hashed_filename`), whose id only the record it names can tell.
    """
    if is_hashed_filename(stem):
        raise InvalidIdError(f"file name {stem!r} is the hashed name of a long job id; read the id from the record")
    job_id = None
    if _STEM.fullmatch(stem):
        try:
            job_id = _decode(stem)
            if job_id_to_filename(job_id) != stem:
                job_id = None
        except (InvalidIdError, UnicodeDecodeError, ValueError):
            job_id = None
    if job_id is None:
        raise InvalidIdError(f"file name {stem!r} does not encode a job id")
    return job_id
