"""Storage helpers over fsspec, shared by the blob store, the JobResultStore and cleanup.

Every durable write stages, then renames. On a local file system that is a temp file in the same
directory plus ``os.replace`` (or ``os.link`` for create-if-absent). On an object store a single PUT is
already all-or-nothing, so the object is written in place; "create if absent" uses a conditional PUT
where the store supports it and an existence check otherwise.

Local files that a store lists and reads back are read with :func:`read_regular`: opened with
``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before reading, so a symlink, a FIFO or a
directory named like a record is reported (:class:`NotRegularFileError`) instead of followed or
blocked on.

Options. Every process that opens a store opens it with the fsspec options of
``spark.steward.storage.options`` (:data:`OPTIONS_KEY`, per protocol, parsed by the config registry): the agents
set them process-wide (:func:`set_default_options`); the user's driver and the Python tasks of a
distributed read, which share their process with other work, apply them to what they open in one
context (:func:`options_scope`); the ``steward`` command takes them as ``--conf``. Without
``client_kwargs`` among the S3 options, the endpoint is ``AWS_ENDPOINT_URL`` if set; credentials
missing from them come from the usual environment (``AWS_ACCESS_KEY_ID``, ...) or an instance profile.
The options may hold credentials: this module never logs them, and a bad value is reported without
quoting it.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import os
import posixpath
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sparksteward.errors import StorageError

__all__ = ["OPTIONS_KEY", "Location", "NotRegularFileError", "fsync_dir", "fsync_file", "open_location",
           "options_scope", "read_regular", "regular_files", "set_default_options"]

log = logging.getLogger("sparksteward.storage")


class Location:
    """A directory on some fsspec file system, with atomic write helpers.

    Thread-safe as far as the underlying fsspec file system is.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.url = url

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        """Join ``parts`` under the root. Parts must be single names (validated by the caller)."""
        for part in parts:
            for piece in part.split("/"):
                if piece in ("", ".", ".."):
                    raise StorageError(f"refusing path component {part!r} under {self.url}")
        return posixpath.join(self.root, *parts)

    def child(self, *parts: str) -> Location:
        return Location(self.fs, self.path(*parts), posixpath.join(self.url, *parts))

    def display(self, path: str) -> str:
        """``path`` as the user would write it (with the protocol)."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path}"

    # --- reads -------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot read {self.display(path)}: {exc}") from exc

    def read_many(self, paths: list[str]) -> dict[str, bytes | Exception]:
        """Read several files in one batch (concurrent on async backends such as s3fs).

        Each value is the file's bytes, or the exception reading it raised.
        """
        try:
            out = self.fs.cat(paths, on_error="return")
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot read {len(paths)} files under {self.url}: {exc}") from exc
        return {p: out.get(p, out.get(self.fs._strip_protocol(p), FileNotFoundError(p))) for p in paths}

    def exists(self, path: str) -> bool:
        try:
            return self.fs.exists(path)
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot check {self.display(path)}: {exc}") from exc

    def listdir(self, path: str | None = None) -> list[dict[str, Any]]:
        """Entries directly under ``path`` (default: root); a missing directory lists as empty.

        The listing is not left in fsspec's directory cache: s3fs answers ``info``/``open`` of a
        path from its parent's cached listing, so a file another process writes afterwards (an
        executor agent's upload) would look missing to this one.
        """
        target = path or self.root
        try:
            self.fs.invalidate_cache(target)
            return self.fs.ls(target, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot list {self.display(target)}: {exc}") from exc
        finally:
            self.fs.invalidate_cache(target)

    # --- writes ------------------------------------------------------------------------------
    def makedirs(self, path: str | None = None) -> None:
        if self.is_local:
            os.makedirs(path or self.root, exist_ok=True)
        # object stores have no directories

    def lexists(self, path: str) -> bool:
        """Like :meth:`exists`, but a local symlink (even a dangling one or a loop) exists."""
        if self.is_local:
            return os.path.lexists(path)
        return self.exists(path)

    def version(self, path: str) -> str | None:
        """The object's ETag on an object store (for :meth:`replace_if`); None locally or if missing."""
        if self.is_local:
            return None
        try:
            self.fs.invalidate_cache(path)
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot check {self.display(path)}: {exc}") from exc
        etag = info.get("ETag") or info.get("etag")
        return None if etag is None else str(etag)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that readers see the old bytes or all of the new ones.

        Local: a staged temp file, fsynced, renamed over ``path``, then the directory fsynced, so the
        new bytes survive a power loss once this returns.
        """
        try:
            if self.is_local:
                d = os.path.dirname(path)
                os.makedirs(d, exist_ok=True)
                with _staged(d, os.path.basename(path)) as tmp:
                    _write_synced(tmp, data)
                    os.replace(tmp, path)
                fsync_dir(d)
            else:
                self.fs.pipe_file(path, data)
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot write {self.display(path)}: {exc}") from exc

    def replace_if(self, path: str, data: bytes, version: str | None) -> bool:
        """Replace ``path`` only if it is still at ``version`` (:meth:`version`); False if it changed.

        Object stores: a conditional PUT (``If-Match``). Local files have no versions: the caller holds
        a lock, and this is :meth:`write_atomic`.
        """
        if self.is_local:
            self.write_atomic(path, data)
            return True
        if version is None:
            return False
        try:
            self.fs.pipe_file(path, data, IfMatch=version)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL and "condition" in str(exc):  # s3fs: 412 PreconditionFailed
                return False
            raise StorageError(f"cannot write {self.display(path)}: {exc}") from exc
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot write {self.display(path)}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(path)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists; return False if it already existed.

        Local: staged temp file, fsynced, then ``os.link`` (atomic, fails if the target exists), then
        the directory fsynced. Object stores: a conditional PUT (``If-None-Match: *``) where supported,
        else check-then-put.
        """
        try:
            if self.is_local:
                d = os.path.dirname(path)
                os.makedirs(d, exist_ok=True)
                with _staged(d, os.path.basename(path)) as tmp:
                    _write_synced(tmp, data)
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        return False
                fsync_dir(d)
                return True
            if self.fs.exists(path):
                return False
            try:
                self.fs.pipe_file(path, data, mode="create")
            except TypeError:  # an fsspec backend without mode=
                self.fs.pipe_file(path, data)
            except FileExistsError:
                return False
            return True
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot create {self.display(path)}: {exc}") from exc

    def link_or_create(self, src: str, dst: str, data: bytes) -> bool:
        """Make ``dst`` hold ``src``'s bytes (``data``) without ever replacing an existing ``dst``;
        False if ``dst`` exists. Local: ``os.link`` then a directory fsync; object stores: a
        conditional create of ``data``. ``src`` is left in place."""
        if not self.is_local:
            return self.create_exclusive(dst, data)
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot link {self.display(src)} to {self.display(dst)}: {exc}") from exc
        fsync_dir(os.path.dirname(dst))
        return True

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (atomic locally, then both directories fsynced; copy-then-delete on
        object stores). Locally any kind of file moves, symlinks and FIFOs included."""
        try:
            if self.is_local:
                os.replace(src, dst)
                fsync_dir(os.path.dirname(dst))
                if os.path.dirname(src) != os.path.dirname(dst):
                    fsync_dir(os.path.dirname(src))
            else:
                self.fs.mv(src, dst)
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot rename {self.display(src)} to {self.display(dst)}: {exc}") from exc

    def delete(self, path: str, recursive: bool = False) -> bool:
        """Delete ``path``; a missing path is not an error (returns False). Idempotent. Locally the
        parent directory is fsynced after the unlink, so the deletion is durable."""
        try:
            if self.is_local and not (recursive and os.path.isdir(path) and not os.path.islink(path)):
                os.unlink(path)
            else:
                self.fs.rm(path, recursive=recursive)
            if self.is_local:
                fsync_dir(os.path.dirname(path.rstrip("/")) or "/")
            return True
        except FileNotFoundError:
            return False
        except Exception as exc:  # OSError, or a backend's own (botocore) error: translate here
            raise StorageError(f"cannot delete {self.display(path)}: {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(path)


def _write_synced(path: str, data: bytes) -> None:
    """Write a new local file and fsync it (its bytes are durable before it is renamed or linked)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a local file's data and metadata to stable storage (before it is renamed or linked)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a link, rename or unlink in ``directory`` durable: fsync the directory itself.

    A no-op where directories cannot be opened (Windows); object stores need nothing.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (tmpfs on old kernels) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


class NotRegularFileError(Exception):
    """A local file that is not a regular file (reported, never read); the message says what it is.

    Not a :class:`~sparksteward.errors.StewardError`: callers translate it at their boundary (the
    JobResultStore into a ``CorruptRecordError`` naming the file)."""


def regular_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The entries of a local directory, sorted, all regular files; a symbolic link or any other
    non-regular entry raises :class:`NotRegularFileError` naming it (never followed)."""
    out = []
    for p in sorted(Path(directory).iterdir()):
        mode = p.lstat().st_mode
        if not stat.S_ISREG(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else f"not a regular file (mode {oct(mode)})"
            raise NotRegularFileError(f"{p} is {what}")
        out.append(p)
    return out


def read_regular(path: str) -> bytes | None:
    """The bytes of a local regular file; None if it does not exist. Never follows a symlink and never
    blocks (a FIFO is detected by ``fstat`` after a non-blocking open)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise NotRegularFileError("is a symbolic link, not a regular file") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a file")
            raise NotRegularFileError(f"is {kind}, not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _staged(directory: str, name: str) -> Iterator[str]:
    """A temp path next to the target that is removed if still present afterwards."""
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


OPTIONS_KEY = "spark.steward.storage.options"
"""The Spark setting of the fsspec options per protocol, such as ``{"s3": {"client_kwargs": {...}}}``."""

_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {}
_SCOPED: contextvars.ContextVar[dict[str, dict[str, Any]] | None] = contextvars.ContextVar(
    "sparksteward_storage_options", default=None)


def set_default_options(options: dict[str, dict[str, Any]]) -> None:
    """Process-wide fsspec options per protocol (:data:`OPTIONS_KEY`): for processes that hold one
    application's stores only (the agents, the ``steward`` command), set once at start."""
    _DEFAULT_OPTIONS.clear()
    _DEFAULT_OPTIONS.update(options)


@contextlib.contextmanager
def options_scope(options: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Open every location in this context (this thread, until the block ends) with ``options`` per
    protocol, over the process-wide ones: for a process that does other work too, such as the user's
    driver or a Python worker. Threads started in the block do not inherit it."""
    token = _SCOPED.set(options)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def open_location(url: str, **storage_options: Any) -> Location:
    """Open ``url`` (a plain path or any fsspec URL) as a :class:`Location`, with the options of its
    protocol: the process-wide ones, those of the :func:`options_scope` in force, then ``storage_options``."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    scoped = _SCOPED.get() or {}
    storage_options = {**_DEFAULT_OPTIONS.get(protocol, {}), **scoped.get(protocol, {}), **storage_options}
    if not url:
        raise StorageError("empty storage path: set a path such as /data/steward or s3://bucket/steward")
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if url.startswith(("s3://", "s3a://")) and endpoint and "client_kwargs" not in storage_options:
        # make the endpoint part of fsspec's instance-cache key, so a changed endpoint takes effect
        storage_options["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        fs, root = fsspec.core.url_to_fs(os.path.expanduser(url), **storage_options)
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"cannot open storage path {url!r}: {exc}. Install the fsspec backend for its protocol "
            f"(for s3:// that is `pip install spark-steward[s3]`)"
        ) from exc
    return Location(fs, root, url)

