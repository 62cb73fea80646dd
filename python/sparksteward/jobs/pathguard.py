"""The path guard of ``delete_path`` cleanup steps: which paths a cleanup may delete, and the delete.

A ``delete_path`` (or ``spark_checkpoint_dir``) target is any fsspec URL or absolute local path, file
or directory, deleted recursively. :func:`normalize_path_target` checks it when the step is recorded
and returns its normal form; :func:`delete_path` checks it again right before deleting, and for a
local path its real path too. Refused, with the rule named: ``~``, ``.`` and ``..`` components,
relative paths, file-system and bucket roots, and the home dir, the steward state dir and any
directory given to :func:`protect_path`, or a parent of one of them.
"""

from __future__ import annotations

import logging
import os
import re

from sparksteward.errors import InvalidRecordError
from sparksteward.storage import open_location

__all__ = ["check_path_target", "delete_path", "normalize_path_target", "protect_path"]

log = logging.getLogger("sparksteward.jobs.pathguard")

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3://..., file:///..., and Hadoop's file:/...


def _protected_dirs() -> list[str]:
    """Local directories a cleanup step may never delete, nor any of their parents: the home dir and
    the steward state dir (read when checking, so a changed ``HOME``/``XDG_STATE_HOME`` counts)."""
    from sparksteward.config import default_state_dir  # config imports nothing of ours back

    out = [os.path.expanduser("~"), str(default_state_dir())]
    out.extend(_EXTRA_PROTECTED)
    return [os.path.normpath(os.path.abspath(p)) for p in out if p]


_EXTRA_PROTECTED: list[str] = []


def protect_path(path: str) -> None:
    """Refuse ``path`` (and its parents) as a cleanup target in this process, e.g. a configured state
    dir outside the default location."""
    if path and "://" not in path:
        norm = os.path.normpath(os.path.abspath(os.path.expanduser(path)))
        if norm not in _EXTRA_PROTECTED:
            _EXTRA_PROTECTED.append(norm)


def _refuse(target: str, rule: str) -> InvalidRecordError:
    return InvalidRecordError(f"refusing to delete {target!r}: {rule}. Register the directory the job "
                              f"wrote instead (an absolute path or URL without '.', '..' or '~')")


def _split(target: str) -> tuple[str | None, str]:
    """``(protocol or None for a plain local path, path)``; Hadoop's ``file:/x`` counts as ``file``."""
    if "://" in target:
        protocol, rest = target.split("://", 1)
        return protocol.lower(), rest
    m = _SCHEME.match(target)
    if m and len(m.group(0)) > 2:  # 'file:/tmp/x' (not a Windows drive letter such as 'C:')
        return target[: m.end() - 1].lower(), target[m.end():]
    return None, target


def normalize_path_target(target: str) -> str:
    """Check a ``delete_path`` target and return its normal form; InvalidRecordError naming the rule.

    Rules, checked on the text as given (nothing is resolved first): no ``~``; no ``.`` or ``..``
    component; absolute (or a URL). Then the normal form (repeated and trailing slashes removed) must
    not be a file-system root, a bucket (or any protocol's) root, the home dir, the steward state dir,
    or a parent of one of them.
    """
    if target.startswith("~"):
        raise _refuse(target, "a path starting with '~' depends on the user that runs the cleanup")
    protocol, path = _split(target)
    if path.startswith("~"):
        raise _refuse(target, "a path starting with '~' depends on the user that runs the cleanup")
    if any(part in (".", "..") for part in path.replace("\\", "/").split("/")):
        raise _refuse(target, "it has a '.' or '..' component, which could point anywhere")
    if protocol is None and not os.path.isabs(target):
        raise InvalidRecordError(f"cleanup path {target!r} is relative; give an absolute path or a URL, because the "
                                 f"cleanup may run in another process (the driver agent, a later driver)")
    local = protocol in (None, "file", "local")
    if local:
        if protocol is not None and path and not path.startswith("/"):  # file://host/path is not local
            raise _refuse(target, "a file:// URL must name an absolute local path (file:///dir)")
        norm = "/" + "/".join(p for p in path.split("/") if p)
        if norm == "/":
            raise _refuse(target, "it is the root of the file system")
        for protected in _protected_dirs():
            if protected == norm or protected.startswith(norm.rstrip("/") + "/"):
                raise _refuse(target, f"it is, or contains, a protected directory ({protected}: the home or the "
                                      f"steward state dir)")
        return norm if protocol is None else f"{protocol}://{norm}"
    parts = [p for p in path.split("/") if p]
    if len(parts) < 2:
        raise _refuse(target, f"it is the root of a bucket or of the {protocol}:// file system")
    return f"{protocol}://{'/'.join(parts)}"


def check_path_target(target: str) -> None:
    """Reject a ``delete_path`` target that :func:`normalize_path_target` refuses."""
    normalize_path_target(target)


def delete_path(target: str) -> None:
    """Delete a file or directory (recursively) at any fsspec URL or absolute path.

    A missing path is success, so running it twice is fine. The target is checked again right before
    deleting (:func:`normalize_path_target`), and for a local path its real path (symlinks resolved)
    is checked too, so a target edited or swapped after it was recorded is still refused.
    """
    norm = normalize_path_target(target)
    loc = open_location(norm)
    if loc.is_local:
        real = os.path.realpath(loc.root)
        if real != loc.root:
            try:
                normalize_path_target(real)
            except InvalidRecordError as exc:
                raise _refuse(target, f"it resolves through a symbolic link to {real!r}, which is refused: {exc}") \
                    from exc
    elif "/" not in loc.root.strip("/"):
        raise _refuse(target, "it is the root of a bucket")
    if loc.delete(loc.root, recursive=True):
        log.debug("deleted %s", target)
