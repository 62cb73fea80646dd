"""Leases and the store lock: ``flock`` holds on the files of a local JobResultStore.

- :class:`Lease`: a live run's hold on its job id, released by :meth:`Lease.release` (idempotent).
  A lease built without a release function is the null lease of object stores: it holds nothing.
- :func:`acquire_file_lease` and :func:`is_file_leased`: a job's lease on a local store, an exclusive
  ``flock`` of its ``.<job>.lease`` file. Recovery skips leased jobs.
- :func:`store_lock`: the exclusive ``flock`` of ``.lock`` that every compare-and-swap (update,
  commit) on a local store holds, in this process and any other on the same store.

The kernel releases a ``flock`` when the process that holds it dies, so a killed run leaves no stale
lease or lock behind. Object stores have neither: their compare-and-swap is a conditional write
(``If-Match`` on the ETag that was read, ``If-None-Match: *`` for creates, see
:meth:`sparksteward.storage.Location.replace_if`), and they report no leases.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Iterator

from sparksteward.errors import JobStoreError, StorageError

__all__ = ["LOCK_NAME", "Lease", "acquire_file_lease", "is_file_leased", "store_lock"]

LOCK_NAME = ".lock"


class Lease:
    """A live run's hold on its job id (see :meth:`FileSystemJobResultStore.lease`); ``release`` is
    idempotent. The null lease (object stores) holds nothing."""

    def __init__(self, job_id: str, release: Callable[[], None] | None = None) -> None:
        self.job_id = job_id
        self._release = release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            fn, self._release = self._release, None
        if fn is not None:
            fn()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_file_lease(path: str, job_id: str, run_id: str) -> Lease:
    """Hold ``job_id`` for the live run ``run_id``: an exclusive ``flock`` of the lease file ``path``
    (created with its directory; it holds the run id), released on :meth:`Lease.release` or when the
    process dies. JobStoreError if another live run holds it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobStoreError(f"job {job_id!r} is running in another process (it holds {path}); a job id runs "
                                f"once at a time. Wait for it to finish") from None
        try:  # the file we locked must still be the one at the path (a releaser may have unlinked it)
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, run_id.encode())

    def release() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still locked: a waiter that opened this inode re-checks the path
        os.close(fd)

    return Lease(job_id, release)


def is_file_leased(path: str) -> bool:
    """True if a live run holds the lease file ``path`` (a missing file is not held)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def store_lock(directory: str, url: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` of ``<directory>/.lock`` (creating the directory) while the block
    runs. ``url`` names the store in errors. Blocks until other holders release it."""
    os.makedirs(directory, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), flags, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot open the lock file of {url}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock
