"""Storage helpers over fsspec, shared by the blob store, the JobResultStore and cleanup.

Every durable write stages, then renames. On a local file system that is a temp file in the same
directory plus ``os.replace`` (or ``os.link`` for create-if-absent). On an object store a single PUT is
already all-or-nothing, so the object is written in place; "create if absent" uses a conditional PUT
where the store supports it and an existence check otherwise.

Conditional writes. Some stores ignore them: an fsspec backend without ``mode=`` (the create above
falls back to check-then-put), or an S3-compatible store that answers a ``PUT`` with ``If-None-Match``
or ``If-Match`` as if it were plain. Whoever relies on them for a compare-and-swap (the writer lease of
a state) asks :func:`probe_conditional_writes` first: once per store (bucket) and process it tries both
conditions on a probe object and reports (:class:`ConditionalWrites`) whether the store refused what it
must.

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
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sparksteward.errors import StorageError

__all__ = ["OPTIONS_KEY", "PROBE_PREFIX", "ConditionalWrites", "Location", "NotRegularFileError", "fsync_dir",
           "fsync_file", "open_location", "options_scope", "probe_conditional_writes", "read_regular",
           "regular_files", "set_default_options", "default_options"]

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

    @property
    def store(self) -> str:
        """The store this location is on, as a URL: ``file://`` for a local file system, else the
        protocol and the first part of the path (an object store's bucket or container)."""
        if self.is_local:
            return "file://"
        return self.display(self.fs._strip_protocol(self.root).strip("/").split("/")[0])

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
        swapped = self._put_if_match(path, data, version)
        if swapped is None:
            raise StorageError(f"cannot write {self.display(path)} conditionally: its fsspec backend "
                               f"{type(self.fs).__name__} takes no IfMatch=")
        return swapped

    def _put_if_match(self, path: str, data: bytes, version: str) -> bool | None:
        """One conditional PUT (``If-Match: version``): True if it replaced ``path``, False if the store
        refused (412), None if the fsspec backend takes no ``IfMatch=``."""
        try:
            self.fs.pipe_file(path, data, IfMatch=version)
            return True
        except TypeError:  # an fsspec backend without IfMatch=
            return None
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
        else check-then-put. A store may ignore the condition: :func:`probe_conditional_writes` finds
        out, and the writer lease of a state refuses such a store.
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
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot create {self.display(path)}: {exc}") from exc
        created = self._put_if_absent(path, data)
        if created is None:  # an fsspec backend without mode=
            try:
                self.fs.pipe_file(path, data)
            except Exception as exc:  # backends raise their own errors
                raise StorageError(f"cannot create {self.display(path)}: {exc}") from exc
            return True
        return created

    def _put_if_absent(self, path: str, data: bytes) -> bool | None:
        """One conditional PUT of an object (``If-None-Match: *``), with no existence check first: True
        if it created ``path``, False if the store refused because it exists, None if the fsspec
        backend takes no ``mode=``."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except TypeError:  # an fsspec backend without mode=
            return None
        except FileExistsError:
            return False
        except Exception as exc:  # backends raise their own errors
            raise StorageError(f"cannot create {self.display(path)}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(path)
        return True

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


PROBE_PREFIX = "_conditional-writes-probe."
"""The name of the object :func:`probe_conditional_writes` writes and deletes under a root (plus 32 hex)."""

_WRONG_VERSION = '"00000000000000000000000000000000"'   # an ETag no object has


@dataclass(frozen=True, slots=True)
class ConditionalWrites:
    """What a store does with conditional writes, as :func:`probe_conditional_writes` found it.

    ``create``: a second conditional create of one object failed, as it must. ``replace``: a
    conditional replace with a wrong version failed, and one with the right version succeeded.
    ``store`` is :attr:`Location.store` (an object store's bucket); ``detail`` says how that was found
    (where the probe object was), or what the store did instead, for an error naming the store and a
    state's info.
    """

    store: str
    create: bool
    replace: bool
    detail: str

    @property
    def honoured(self) -> bool:
        """Both kinds of condition hold: a compare-and-swap on this store is one."""
        return self.create and self.replace

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store, "honoured": self.honoured, "create": self.create, "replace": self.replace,
                "detail": self.detail}


_probes_lock = threading.Lock()
_probed: dict[tuple[Any, str], ConditionalWrites] = {}   # (file system, store) -> its probe
_probing: dict[tuple[Any, str], threading.Lock] = {}     # (file system, store) -> held while it is probed


def probe_conditional_writes(loc: Location) -> ConditionalWrites:
    """Find out whether ``loc``'s store honours conditional writes, once per store and process.

    On an object store this writes ``<root>/_conditional-writes-probe.<hex>`` (under ``loc``, where
    the caller may write) with a conditional create (``If-None-Match: *``), creates it once more (the
    store must refuse), replaces it with a wrong version (``If-Match``: must be refused) and with the
    right one (must succeed), then deletes it: four PUTs, a HEAD and a DELETE. A local file system
    needs no probe: a create is an ``os.link`` and the callers swap under an ``flock``.

    The result is cached in this process per file system (its endpoint and options) and store
    (:attr:`Location.store`, the bucket), whether honoured or not: a bucket honours the conditions on
    every prefix. A probe the store failed to answer raises :class:`StorageError` and is tried again
    next time.

    Thread-safe: concurrent callers on one store wait for one probe; other stores are probed meanwhile.
    """
    key = (loc.fs, loc.store)
    with _probes_lock:
        done = _probed.get(key)
        if done is not None:
            return done
        probing = _probing.setdefault(key, threading.Lock())
    with probing:
        with _probes_lock:
            done = _probed.get(key)
        if done is None:
            done = _probe(loc)
            log.info("conditional writes on %s: %s", done.store, "honoured" if done.honoured else done.detail)
            with _probes_lock:
                _probed[key] = done
                _probing.pop(key, None)
        return done


def _probe(loc: Location) -> ConditionalWrites:
    if loc.is_local:
        return ConditionalWrites(loc.store, True, True, "a local file system: a create is an os.link, which fails "
                                 "if the target exists, and a replace compares the bytes under an flock")
    backend = type(loc.fs).__name__
    path = loc.path(f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        first = loc._put_if_absent(path, b"probe 1")
        if first is None:
            return ConditionalWrites(loc.store, False, False, f"its fsspec backend {backend} takes no mode='create', "
                                     f"so a create cannot be conditional")
        if not first:
            raise StorageError(f"cannot probe {loc.url}: a conditional create of the new object "
                               f"{loc.display(path)} was refused as if it existed")
        second = loc._put_if_absent(path, b"probe 2")
        create = second is False
        version = loc.version(path)
        if version is None:
            replace, why = False, "it reports no version (ETag) of an object to replace it against"
        else:
            wrong = loc._put_if_match(path, b"probe 3", _WRONG_VERSION)
            if wrong is None:
                replace, why = False, f"its fsspec backend {backend} takes no IfMatch="
            elif wrong:
                replace, why = False, "a PUT with If-Match of a wrong ETag replaced the object"
            elif not loc._put_if_match(path, b"probe 4", version):
                replace, why = False, "a PUT with If-Match of the object's own ETag was refused"
            else:
                replace, why = True, ""
    finally:
        try:
            loc.delete(path)
        except StorageError as exc:
            log.warning("could not delete the probe object %s (delete it by hand): %s", loc.display(path), exc)
    found = []
    if not create:
        found.append("a second PUT with If-None-Match: * of the same object succeeded")
    if not replace:
        found.append(why)
    if found:
        return ConditionalWrites(loc.store, create, replace, f"probed at {loc.url}: " + "; ".join(found))
    return ConditionalWrites(loc.store, True, True, f"probed at {loc.url}: a second PUT with If-None-Match: * of "
                             f"one object and a PUT with If-Match of a wrong ETag were refused")


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


def default_options() -> dict[str, dict[str, Any]]:
    """A copy of the process-wide options :func:`set_default_options` set."""
    return {k: dict(v) for k, v in _DEFAULT_OPTIONS.items()}


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

