"""The HA blob store: a read interface (:class:`BlobView`), a write interface (:class:`BlobStore`),
an fsspec implementation and a null object.

Layout on any fsspec URL: ``<path>/<cluster-id>/blob/<job>/<key>``, with job ids encoded by
:func:`sparksteward.ids.job_id_to_filename` and job-less blobs under ``@none`` (``@`` never appears
in an encoded job id). Executor caches get only a :class:`BlobView`.

Every read verifies the content against the key while copying into a temp file next to the
destination; only a verified copy is renamed into place, and a mismatch deletes the copy and raises
:class:`~sparksteward.errors.ChecksumMismatchError` naming the URL.

Durability (HA puts; local stores and caches are scratch, see decision 0008): every staged file is fsynced before it is renamed into place, and the directory after
each rename or unlink that commits state (and after creating a directory), so a put that returned
survives a power loss. On object stores a completed PUT is durable by itself. A process killed
mid-put leaves only staged names (``*.tmp``), never a partial file under a key;
:meth:`FileSystemBlobStore.sweep_staged` removes old ones.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fsspec.callbacks import Callback

from sparksteward.blob.key import BlobKey
from sparksteward.errors import BlobNotFoundError, ChecksumMismatchError, StorageError
from sparksteward.hashing import Hasher
from sparksteward.ids import job_id_from_filename, job_id_to_filename, validate_id
from sparksteward.storage import Location, fsync_dir, fsync_file, open_location
from sparksteward.wire.connection import write_all

__all__ = ["BlobStore", "BlobView", "FileSystemBlobStore", "NO_JOB", "VoidBlobStore", "job_dir_name",
           "makedirs_durable", "verified_copy"]

NO_JOB = "@none"
_CHUNK = 4 << 20


def job_dir_name(job_id: str | None) -> str:
    return NO_JOB if job_id is None else job_id_to_filename(job_id)


def makedirs_durable(directory: str | os.PathLike[str], mode: int = 0o777) -> None:
    """``os.makedirs(exist_ok=True)``, fsyncing the parent of every directory it creates."""
    directory = os.path.abspath(directory)
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    if parent != directory:
        makedirs_durable(parent, mode)
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise
        return
    fsync_dir(parent)


def verified_copy(src, dest: Path, key: BlobKey, source: str, *,
                  progress: Callable[[int], None] | None = None) -> int:
    """Copy the readable ``src`` into ``dest`` through a temp file, verifying ``key``; return the size.

    ``dest`` is scratch storage (a local store or cache copy, re-verified after any restart), so it is
    not fsynced; durable copies go through :meth:`FileSystemBlobStore.put` (decision 0008).
    ``progress(copied)`` is called with the bytes copied so far after each chunk (after each
    ``copy_file_range`` call on the kernel path), before the content is verified.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    h = Hasher()
    size = 0
    try:
        with open(tmp, "wb", buffering=0) as out:
            kernel_src = getattr(src, "src", None)
            if kernel_src is not None:  # same host: copy in the kernel, then hash what landed
                infd, outfd = kernel_src.fileno(), out.fileno()
                while n := os.copy_file_range(infd, outfd, 1 << 30):
                    size += n
                    if progress is not None:
                        progress(size)
                out.flush()
                with open(tmp, "rb") as back:
                    while len(chunk := back.read(_CHUNK)):
                        h.update(chunk)
            else:
                while len(chunk := src.read(_CHUNK)):
                    h.update(chunk)
                    write_all(out, chunk)   # write(2) may take part of a chunk (a full disk)
                    size += len(chunk)
                    if progress is not None:
                        progress(size)
            if h.digest() != key.digest:
                raise ChecksumMismatchError(f"{source} does not match its key {key} (corrupt copy discarded)")
        os.replace(tmp, dest)
        return size
    finally:
        if tmp.exists():
            tmp.unlink()


class _UploadProgress(Callback):
    """fsspec's transfer callback (``set_size``, ``relative_update``) as ``progress(sent, size)``."""

    def __init__(self, progress: Callable[[int, int], None]) -> None:
        super().__init__()
        self._progress = progress
        self._last: tuple[int, int] | None = None

    def call(self, hook_name: str | None = None, **kwargs: Any) -> None:
        if self.size is not None:
            self._last = (self.value, self.size)
            self._progress(self.value, self.size)

    def finish(self, size: int) -> None:
        """Report the whole file once, unless the backend already did (a local copy reports nothing)."""
        if self._last != (size, size):
            self._progress(size, size)


class BlobView(Protocol):
    """Read side: what an executor cache may do with the HA store."""

    def get(self, job_id: str | None, key: BlobKey, dest: Path) -> int: ...
    def exists(self, job_id: str | None, key: BlobKey) -> bool: ...


class BlobStore(BlobView, Protocol):
    """Write side, used by the BlobServer only."""

    def put(self, job_id: str | None, key: BlobKey, local: Path) -> None: ...
    def delete(self, job_id: str | None, key: BlobKey) -> None: ...
    def delete_job(self, job_id: str | None) -> None: ...
    def jobs(self) -> list[str | None]: ...


class FileSystemBlobStore:
    """HA blob store on any fsspec URL. Thread-safe as far as the fsspec backend is."""

    def __init__(self, url: str, cluster_id: str = "default") -> None:
        self.cluster_id = validate_id(cluster_id, "cluster id")
        self.base: Location = open_location(url).child(self.cluster_id, "blob")
        self.url = url

    def _path(self, job_id: str | None, key: BlobKey) -> str:
        return self.base.path(job_dir_name(job_id), str(key))

    def get(self, job_id: str | None, key: BlobKey, dest: Path, *,
            progress: Callable[[int, int], None] | None = None) -> int:
        """Copy the blob into ``dest``, verified (:func:`verified_copy`); return its size.

        ``progress(copied, size)`` is called after each chunk (``steward blobs get``'s progress line).
        """
        path = self._path(job_id, key)
        try:
            with self.base.fs.open(path, "rb") as src:
                if progress is None:
                    return verified_copy(src, dest, key, self.base.display(path))
                report = progress
                total = src.size if isinstance(getattr(src, "size", None), int) else self.base.fs.size(path)
                return verified_copy(src, dest, key, self.base.display(path),
                                     progress=lambda copied: report(copied, total))
        except (FileNotFoundError, ChecksumMismatchError):
            raise
        except Exception as exc:  # backend errors become ours at this boundary
            raise StorageError(f"cannot read {self.base.display(path)}: {type(exc).__name__}: {exc}") from exc

    def exists(self, job_id: str | None, key: BlobKey) -> bool:
        return self.base.exists(self._path(job_id, key))

    def put(self, job_id: str | None, key: BlobKey, local: Path, *,
            progress: Callable[[int, int], None] | None = None) -> None:
        """Store the file ``local`` under ``key``, durably (see the module docstring).

        ``progress(sent, size)`` is called as an object store's upload goes (fsspec's ``callback``:
        per part of a multipart upload) and once the blob is stored, on any store (``steward blobs
        put``'s progress line). The BlobServer passes none.
        """
        path = self._path(job_id, key)
        reporter = None if progress is None else _UploadProgress(progress)
        try:
            if self.base.is_local:
                # durable before the put returns (the server acknowledges after it): staged file,
                # fsync, rename, fsync the directory
                tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
                makedirs_durable(posixpath.dirname(path))
                try:
                    self.base.fs.put_file(str(local), tmp)
                    fsync_file(tmp)
                    os.replace(tmp, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                fsync_dir(posixpath.dirname(path))
            elif reporter is None:
                self.base.fs.put_file(str(local), path)  # one PUT or multipart upload: all or nothing
            else:
                self.base.fs.put_file(str(local), path, callback=reporter)
        except Exception as exc:
            raise StorageError(f"cannot upload {key} to {self.base.display(path)}: {exc}") from exc
        if reporter is not None:
            reporter.finish(os.path.getsize(local))

    def delete(self, job_id: str | None, key: BlobKey) -> None:
        """Delete one blob (a missing one is fine); on a local store, also its job dir once empty."""
        path = self._path(job_id, key)
        self.base.delete(path)
        if self.base.is_local:
            job_dir = posixpath.dirname(path)
            fsync_dir(job_dir)
            with contextlib.suppress(OSError):
                os.rmdir(job_dir)  # fails while other blobs (or staged files) remain
                fsync_dir(posixpath.dirname(job_dir))

    def delete_job(self, job_id: str | None) -> None:
        path = self.base.path(job_dir_name(job_id))
        self.base.delete(path, recursive=True)
        if self.base.is_local:
            fsync_dir(posixpath.dirname(path))

    def sweep_staged(self, max_age: float = 3600.0) -> int:
        """Delete staged files (``*.tmp``) older than ``max_age`` seconds that killed uploads left in
        a local HA store; return how many. Object stores have none (a PUT is all or nothing)."""
        if not self.base.is_local:
            return 0
        swept, cutoff = 0, time.time() - max_age
        for job in self.base.listdir():
            if job.get("type") != "directory":
                continue
            for info in self.base.listdir(job["name"]):
                name = info["name"]
                if name.endswith(".tmp") and info.get("type") == "file":
                    with contextlib.suppress(FileNotFoundError):
                        if os.lstat(name).st_mtime <= cutoff:
                            os.unlink(name)
                            swept += 1
            if swept:
                fsync_dir(job["name"])
        return swept

    def jobs(self) -> list[str | None]:
        out: list[str | None] = []
        for info in self.base.listdir():
            name = posixpath.basename(info["name"].rstrip("/"))
            if name == NO_JOB:
                out.append(None)
            else:
                try:
                    out.append(job_id_from_filename(name))
                except ValueError:
                    continue
        return out

    def keys(self, job_id: str | None) -> list[tuple[BlobKey, int]]:
        out = []
        for info in self.base.listdir(self.base.path(job_dir_name(job_id))):
            try:
                out.append((BlobKey.parse(posixpath.basename(info["name"])), int(info.get("size") or 0)))
            except ValueError:
                continue
        return out


class VoidBlobStore:
    """No HA store: nothing is kept for recovery (``spark.steward.blob.ha.storage-path=none``)."""

    url = "none"

    def get(self, job_id: str | None, key: BlobKey, dest: Path) -> int:
        raise BlobNotFoundError(f"blob {key} is not in an HA store (none is configured)")

    def exists(self, job_id: str | None, key: BlobKey) -> bool:
        return False

    def put(self, job_id: str | None, key: BlobKey, local: Path) -> None:
        pass

    def delete(self, job_id: str | None, key: BlobKey) -> None:
        pass

    def delete_job(self, job_id: str | None) -> None:
        pass

    def sweep_staged(self, max_age: float = 3600.0) -> int:
        return 0

    def jobs(self) -> list[str | None]:
        return []

    def keys(self, job_id: str | None) -> list[tuple[BlobKey, int]]:
        return []


def open_blob_store(url: str | None, cluster_id: str) -> FileSystemBlobStore | VoidBlobStore:
    return VoidBlobStore() if url is None else FileSystemBlobStore(url, cluster_id)
