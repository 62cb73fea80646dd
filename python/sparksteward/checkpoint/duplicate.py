"""Fast duplication of checkpoint files (FLIP-428's ``DuplicatingFileSystem``).

:func:`can_fast_duplicate` answers, without remote calls, whether a copy from ``src`` to ``dst`` can
avoid moving bytes through this process: both on one S3 endpoint (server-side ``CopyObject`` through
s3fs's ``copy``), or both on one local file system (hard link; ``copy_file_range`` in the kernel if
linking is refused). :class:`Duplicator` copies a batch of ``(src, dst)`` URLs that way, and streams
the bytes in every other case, calling an optional ``progress(done, total)`` as the files go. It
counts the bytes that passed through the process (``bytes_streamed``), so callers and tests can
assert that a NO_CLAIM restore moved nothing.

Destinations are written all-or-nothing: a streamed or kernel copy goes to a staged temp file that is
renamed, a link over an existing file is made under a temp name and renamed; an S3 CopyObject is
atomic. A pair whose source and destination are one place (:func:`place`) is refused before anything
is copied: on S3 a CopyObject onto itself fails, and a caller cleaning up after that failure would
delete the source.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fsspec.implementations.local import LocalFileSystem

from sparksteward.errors import CheckpointError, CheckpointNotFoundError, StorageError
from sparksteward.storage import fsync_file, open_location

__all__ = ["Duplicator", "DuplicationStats", "can_fast_duplicate", "overlaps", "place"]

log = logging.getLogger("sparksteward.checkpoint.duplicate")
_CHUNK = 4 << 20
_S3_BATCH = 128   # server-side copies per progress report (s3fs issues 128 at a time anyway)


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _existing_parent(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def place(url: str) -> str:
    """``url`` in one canonical form, to compare locations without remote calls: a local path as
    ``file://`` + its real absolute path (symlinks resolved), any other URL as ``<protocol>://`` + its
    non-empty path components (``s3a`` is ``s3``), never with a trailing slash."""
    protocol = _protocol(url)
    rest = url.split("://", 1)[-1]
    if protocol in ("file", "local"):
        return "file://" + os.path.realpath(os.path.expanduser(rest))
    protocol = "s3" if protocol == "s3a" else protocol
    return f"{protocol}://" + "/".join(p for p in rest.split("/") if p)


def overlaps(a: str, b: str) -> bool:
    """True if the :func:`place` ``a`` is, contains or lies under the place ``b``."""
    (pa, ra), (pb, rb) = a.split("://", 1), b.split("://", 1)
    ca, cb = [c for c in ra.split("/") if c], [c for c in rb.split("/") if c]
    n = min(len(ca), len(cb))
    return pa == pb and ca[:n] == cb[:n]


def can_fast_duplicate(src: str, dst: str) -> bool:
    """True if copying ``src`` to ``dst`` needs no bytes through this process (no remote calls)."""
    ps, pd = _protocol(src), _protocol(dst)
    if ps in ("s3", "s3a") and pd in ("s3", "s3a"):
        return True  # one endpoint per process (AWS_ENDPOINT_URL / storage options)
    if ps in ("file", "local") and pd in ("file", "local"):
        s = _existing_parent(src.split("://", 1)[-1])
        d = _existing_parent(dst.split("://", 1)[-1])
        return os.stat(s).st_dev == os.stat(d).st_dev
    return False


@dataclass
class DuplicationStats:
    linked: int = 0
    kernel_copied: int = 0
    server_side: int = 0
    streamed: int = 0
    bytes_streamed: int = 0


class Duplicator:
    """Copies files between checkpoint locations, as cheaply as the stores allow. Thread-safe."""

    def __init__(self) -> None:
        self.stats = DuplicationStats()
        self._lock = threading.Lock()

    @property
    def bytes_streamed(self) -> int:
        return self.stats.bytes_streamed

    def duplicate(self, pairs: Iterable[tuple[str, str]],
                  progress: Callable[[int, int], None] | None = None) -> None:
        """Copy every ``src`` URL to its ``dst`` URL. A missing source raises CheckpointNotFoundError;
        a pair whose source and destination are one place raises CheckpointError before anything is
        copied. ``progress(done, total)`` is called after each linked or streamed file and after each
        batch of server-side copies."""
        pairs = list(pairs)
        for src, dst in pairs:
            if place(src) == place(dst):
                raise CheckpointError(f"cannot duplicate {src} onto itself ({dst} is the same place): nothing was "
                                      f"copied. Copy it to another path")
        by_kind: dict[str, list[tuple[str, str]]] = {}
        for src, dst in pairs:
            kind = "local" if _protocol(src) in ("file", "local") and _protocol(dst) in ("file", "local") else (
                "s3" if can_fast_duplicate(src, dst) else "stream")
            by_kind.setdefault(kind, []).append((src, dst))
        done = 0

        def copied(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, len(pairs))

        for src, dst in by_kind.get("local", []):
            self._local(src.split("://", 1)[-1], dst.split("://", 1)[-1])
            copied(1)
        server = by_kind.get("s3", [])
        step = _S3_BATCH if progress is not None else max(len(server), 1)   # without progress: one call, as before
        for i in range(0, len(server), step):
            self._s3(server[i:i + step])
            copied(len(server[i:i + step]))
        for src, dst in by_kind.get("stream", []):
            self._stream(src, dst)
            copied(1)

    # --- local -------------------------------------------------------------------------------
    def _local(self, src: str, dst: str) -> None:
        if not os.path.exists(src):
            raise CheckpointNotFoundError(f"cannot duplicate {src}: it does not exist")
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        try:
            os.link(src, dst)
            self._count(linked=1)
            return
        except FileExistsError:
            if os.path.samefile(src, dst):
                return
            if self._relink(src, dst):  # dst stays whole: a linked temp name is renamed over it
                return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise StorageError(f"cannot link {src} to {dst}: {exc}") from exc
        tmp = f"{dst}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                try:
                    while os.copy_file_range(fin.fileno(), fout.fileno(), 1 << 30):
                        pass
                    self._count(kernel_copied=1)
                except OSError:  # no copy_file_range across these file systems
                    fin.seek(0)
                    fout.seek(0)
                    fout.truncate()
                    n = 0
                    while chunk := fin.read(_CHUNK):
                        fout.write(chunk)
                        n += len(chunk)
                    self._count(streamed=1, bytes_streamed=n)
            fsync_file(tmp)
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _relink(self, src: str, dst: str) -> bool:
        """Replace ``dst`` by a hard link of ``src`` atomically; False if the file system refuses links."""
        tmp = f"{dst}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            os.link(src, tmp)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                return False
            raise StorageError(f"cannot link {src} to {dst}: {exc}") from exc
        try:
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._count(linked=1)
        return True

    # --- s3 ----------------------------------------------------------------------------------
    def _s3(self, pairs: list[tuple[str, str]]) -> None:
        loc = open_location(pairs[0][0])
        fs = loc.fs
        srcs = [fs._strip_protocol(s) for s, _ in pairs]
        dsts = [fs._strip_protocol(d) for _, d in pairs]
        try:
            # s3fs: one CopyObject per file (multipart copy above 5 GB), issued concurrently; no bytes
            # pass through this process
            fs.copy(srcs, dsts, on_error="raise")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"cannot duplicate {exc.filename or exc}: it does not exist") from exc
        except Exception as exc:  # backend errors become ours here
            raise StorageError(f"cannot copy {len(pairs)} files on the server ({srcs[0]} -> {dsts[0]}, ...): "
                               f"{exc}") from exc
        self._count(server_side=len(pairs))

    # --- any other pair -----------------------------------------------------------------------
    def _stream(self, src: str, dst: str) -> None:
        sloc = open_location(src)   # with the storage options, as every store is opened
        sfs, spath = sloc.fs, sloc.root
        dloc = open_location(dst)
        dfs, dpath = dloc.fs, dloc.root
        tmp = f"{dpath}.{uuid.uuid4().hex[:8]}.tmp" if isinstance(dfs, LocalFileSystem) else dpath
        n = 0
        try:
            if isinstance(dfs, LocalFileSystem):
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with sfs.open(spath, "rb") as fin, dfs.open(tmp, "wb") as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)
                    n += len(chunk)
            if tmp != dpath:
                fsync_file(tmp)
                os.replace(tmp, dpath)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"cannot duplicate {src}: it does not exist") from exc
        finally:
            if tmp != dpath:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        self._count(streamed=1, bytes_streamed=n)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)
