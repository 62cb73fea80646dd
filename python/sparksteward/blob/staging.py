"""Staged files of the BlobServer's uploads: every upload is written into a file of the server's own
before it is hashed and moved or linked into place (see :mod:`sparksteward.blob.server`).

A copied or moved upload (``blob.put_path``) is staged under a fresh name in ``incoming/``
(:meth:`StagingArea.path`). A streamed one (``blob.put``) goes into an empty file that is already open
(:meth:`StagingArea.take`): where the kernel allows, an unnamed ``O_TMPFILE`` file, linked into its
job's directory through ``/proc/self/fd`` once verified (:func:`link_staged`), else a named one,
renamed into place (:func:`commit_staged`).
Making a file (an inode) is the largest cost of a small put, and on some file systems (ext4 without a
journal scans recently deleted inodes) it is most of it, so a thread of the area's own (started by the
first streamed upload) keeps up to :data:`SPARES` empty ones ready in ``@spare/``, outside
``incoming/``: no client can name one. An unnamed spare leaves nothing behind and is placed without
touching the directory the spare thread creates in (a rename locks both directories) and without a
stat first (the link fails if the blob is there).

Thread-safety: :meth:`StagingArea.take` and :meth:`StagingArea.path` may be called from any thread;
``close`` joins the spare thread and closes the spares. It logs to ``sparksteward.blob.staging``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

__all__ = ["SPARES", "StagingArea", "commit_staged", "copy_file", "link_open_file", "link_staged", "unlink_quietly",
           "unnamed_files"]

log = logging.getLogger("sparksteward.blob.staging")

#: How many empty staged files the area keeps ready for streamed uploads (refilled below half).
SPARES = 32


def copy_file(src: Path, dest: Path) -> None:
    """Copy ``src`` into the new file ``dest``: an independent copy (a reflink where the file system
    shares extents copy-on-write, else ``copy_file_range``), never a hard link."""
    with open(src, "rb") as fin, open(dest, "xb", buffering=0) as fout:
        try:
            while os.copy_file_range(fin.fileno(), fout.fileno(), 1 << 30):
                pass
        except OSError:  # e.g. EXDEV on old kernels, or a file system without it
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 4 << 20)


_proc_fd: int | None = None  # this process's /proc/self/fd, opened once (see _proc_fd_dir)


def _forget_proc_fd() -> None:
    global _proc_fd
    _proc_fd = None  # a forked child's /proc/self is not its parent's


os.register_at_fork(after_in_child=_forget_proc_fd)


def _proc_fd_dir() -> int:
    """An fd of this process's ``/proc/self/fd``: an open file is linked by its number in there."""
    global _proc_fd
    if _proc_fd is None:
        _proc_fd = os.open(f"/proc/{os.getpid()}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return _proc_fd


def link_open_file(fd: int, dest: str) -> None:
    """Give the open, unnamed file ``fd`` the name ``dest`` (FileExistsError if ``dest`` exists)."""
    os.link(str(fd), dest, src_dir_fd=_proc_fd_dir(), follow_symlinks=True)


def unnamed_files(directory: Path) -> bool:
    """Whether unnamed files (``O_TMPFILE``) made in ``directory`` can be linked into it through
    ``/proc/self/fd`` (Linux 3.11+, on most local file systems). Tried once, by doing it."""
    probe = None
    try:
        probe = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        name = str(directory / f".probe-{uuid.uuid4().hex}")
        link_open_file(probe, name)
        os.unlink(name)
        return True
    except (OSError, AttributeError) as exc:  # not Linux, no /proc, or a file system without O_TMPFILE
        log.debug("staged uploads are named files: unnamed ones cannot be linked in %s (%s)", directory, exc)
        return False
    finally:
        if probe is not None:
            os.close(probe)


def commit_staged(staged: str, dest: str) -> None:
    """Rename a staged, verified file into place as ``dest``, making its directory if it is the job's
    first blob (the local store is scratch: no fsync, see decision 0008)."""
    try:
        os.replace(staged, dest)
    except FileNotFoundError:
        if not os.path.exists(staged):
            raise
        os.makedirs(os.path.dirname(dest), exist_ok=True)  # the job's first blob
        os.replace(staged, dest)


def link_staged(fd: int, dest: str) -> bool:
    """Link the unnamed staged file ``fd`` into place as ``dest``; False if ``dest`` is there already."""
    for attempt in (1, 2):
        try:
            link_open_file(fd, dest)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            if attempt == 2:
                raise
            os.makedirs(os.path.dirname(dest), exist_ok=True)  # the job's first blob
    raise AssertionError("unreachable")


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class StagingArea:
    """The staged files of one BlobServer: named ones in ``incoming`` and spare open ones made in
    ``spare_dir`` (see the module docstring). ``unnamed``: use ``O_TMPFILE`` files where the kernel
    allows. ``close`` is idempotent."""

    def __init__(self, incoming: Path, spare_dir: Path, *, unnamed: bool = True) -> None:
        self.incoming = incoming
        self.spare_dir = spare_dir
        self._prefix = f"{incoming}/.stage-{uuid.uuid4().hex[:12]}-"
        self._spare_prefix = f"{spare_dir}/{uuid.uuid4().hex[:12]}-"
        self._seq = itertools.count()
        #: whether streamed uploads go into unnamed files (tried once, see :func:`unnamed_files`)
        self.unnamed = unnamed and unnamed_files(spare_dir)
        #: the spare files, open for writing: ``(None, fd)`` if unnamed, else ``(path, fd)``
        self.spare: collections.deque[tuple[str | None, int]] = collections.deque()
        self._low = threading.Event()
        self._thread = threading.Thread(target=self._make_spares, name="steward-blob-stage", daemon=True)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def path(self) -> str:
        """A fresh name for a staged file in ``incoming`` (the server's own: ``.stage-*``)."""
        return f"{self._prefix}{next(self._seq)}.tmp"

    def _new(self, spare: bool) -> tuple[str | None, int]:
        """A new, empty staged file, open for writing: ``(None, fd)`` if it is unnamed, else
        ``(path, fd)``, in ``spare_dir`` for a spare one and in ``incoming`` otherwise."""
        if self.unnamed:
            return None, os.open(self.spare_dir, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        path = f"{self._spare_prefix}{next(self._seq)}.tmp" if spare else self.path()
        return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def take(self) -> tuple[str | None, int]:
        """A new, empty staged file (see :meth:`_new`), a spare one if there is; the caller closes the
        fd and removes a named file it did not place."""
        try:
            path, fd = self.spare.popleft()
        except IndexError:
            path, fd = self._new(spare=False)
        if len(self.spare) < SPARES // 2:
            if not self._started:
                with self._lock:
                    if not self._started and not self._closed:
                        self._thread.start()
                        self._started = True
            self._low.set()
        return path, fd

    def _make_spares(self) -> None:
        while not self._closed:
            while len(self.spare) < SPARES and not self._closed:
                try:
                    path, fd = self._new(spare=True)
                except OSError as exc:  # a full disk: uploads make their own file and say so
                    log.debug("cannot make a spare staged file: %s", exc)
                    break
                self.spare.append((path, fd))
            self._low.wait()
            self._low.clear()
        self._drop_spares()

    def _drop_spares(self) -> None:
        while True:
            try:
                _, fd = self.spare.popleft()
            except IndexError:
                return
            os.close(fd)

    def close(self) -> None:
        """Stop the spare thread and close the spares (a named spare stays until its directory goes)."""
        with self._lock:
            self._closed = True
            started = self._started
        self._low.set()
        if started:
            self._thread.join()
        self._drop_spares()
