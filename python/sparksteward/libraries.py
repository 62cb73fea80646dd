"""Libraries added with ``Steward.add_library``, as seen from inside Python workers.

When an import fails in a worker, :class:`LibraryFinder` asks the executor agent for the
application's libraries (``blob.libraries``, sent by the ``fetch`` the daemon installs it with). The
agent fetches each into its content-addressed cache
(once per executor) and answers with local paths: wheels, eggs and zips are importable as they are
(zipimport); a ``.py`` file is served from a directory of its own. The finder appends new paths to
``sys.path`` and retries the import. A name that still cannot be found is remembered until the
application adds another library, so optional imports (``try: import x``) do not call the agent again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LibraryFinder", "install_finder", "library_kind", "validate_library_name"]

log = logging.getLogger("sparksteward.libraries")

_KINDS = {".whl": "zip", ".zip": "zip", ".egg": "zip", ".py": "py"}
_MAX_NAME = 200
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\.(whl|zip|egg|py)")


def library_kind(name: str) -> str:
    """``zip`` or ``py`` for a library file name; raise ValueError naming the name otherwise."""
    for suffix, kind in _KINDS.items():
        if name.endswith(suffix):
            return kind
    raise ValueError(f"{name!r} is not a library: add a .whl, .zip, .egg or .py file")


def validate_library_name(name: object) -> str:
    """Return ``name`` if it is a plain library file name, else raise InvalidIdError naming it.

    A name is one path component (no ``/``, ``\\`` or ``..``), at most 200 characters of letters,
    digits and ``_ . + -``, starting with a letter, digit or ``_``, ending in .whl, .zip, .egg or .py.
    """
    from sparksteward.errors import InvalidIdError

    if not isinstance(name, str):
        raise InvalidIdError(f"library name must be a string, not {type(name).__name__}")
    if len(name) > _MAX_NAME:
        raise InvalidIdError(f"library name {name[:40]!r}... is {len(name)} characters long; the limit is "
                             f"{_MAX_NAME}: rename the file")
    if "/" in name or "\\" in name or ".." in name or not _NAME.fullmatch(name):
        raise InvalidIdError(f"library name {name!r} is not a plain file name: use one path component of "
                             f"letters, digits and '_.+-' (no '/', '\\' or '..') ending in .whl, .zip, .egg or .py")
    return name


#: ``fetch() -> (version, paths)``: the version of the application's library list and the importable
#: paths of the executor's cached copies (the executor agent's ``blob.libraries``).
Fetch = Callable[[], "tuple[int, list[str]]"]


class LibraryFinder(importlib.abc.MetaPathFinder):
    """A last-resort finder that pulls the application's libraries from the executor agent with
    ``fetch`` (see :data:`Fetch`)."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._lock = threading.Lock()
        self._version = -1
        self._missing: set[str] = set()
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if path is not None or self._busy:  # only top-level packages; never recurse
            return None
        with self._lock:
            if fullname in self._missing:
                return None
            self._busy = True
            try:
                new_paths = self._refresh()
            except Exception as exc:  # noqa: BLE001 - an import must fail as ImportError, not with our error
                log.debug("library lookup for %s failed: %s", fullname, exc)
                return None
            finally:
                self._busy = False
            spec = importlib.machinery.PathFinder.find_spec(fullname, new_paths) if new_paths else None
            if spec is None:
                self._missing.add(fullname)
            return spec

    def _refresh(self) -> list[str]:
        version, paths = self._fetch()
        if version != self._version:
            self._version = version
            self._missing.clear()
        added = [p for p in paths if p not in sys.path]
        sys.path.extend(added)
        if added:
            importlib.invalidate_caches()
        return added


def install_finder(fetch: Fetch) -> LibraryFinder:
    """Append the finder (asking ``fetch``) to ``sys.meta_path`` once per process and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, LibraryFinder):
            return finder
    finder = LibraryFinder(fetch)
    sys.meta_path.append(finder)
    return finder
