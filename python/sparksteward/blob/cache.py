"""The BlobCache, hosted by each executor agent (FLIP-19).

``open(job, key, task)`` returns the path of a verified local copy, from the local cache, else the
HA store (a :class:`~sparksteward.blob.store.BlobView`, read only), else the BlobServer. Every
transfer goes to a temp file and is renamed into place only when complete and verified, so no reader
sees a partial file; a copy that fails its checksum is discarded and the next source is tried.
Concurrent requests for one blob share one transfer (single flight). On the BlobServer's own host the
transfer is an in-kernel copy of the server's file (``copy_file_range``) instead of a socket stream;
either way the copy is the cache's own file and is verified before it is renamed into place. The cache holds at most
``max_size`` bytes: unreferenced blobs are evicted least recently used first; blobs referenced by a
running task attempt never are. Task attempts release their references through the executor
plugin's task events (``release_task``). ``close`` deletes the cache directory; a new cache removes
temp files a killed process left behind.

Thread-safety: one lock for the bookkeeping, one per key for transfers.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from sparksteward.blob.key import BlobKey, hash_file
from sparksteward.blob.server import BOOT_ID
from sparksteward.blob.store import job_dir_name, verified_copy
from sparksteward.errors import BlobNotFoundError, ChecksumMismatchError, StewardError
from sparksteward.libraries import library_kind
from sparksteward.wire import Connection, Fields, RawReader

__all__ = ["BlobCache"]

log = logging.getLogger("sparksteward.blob.cache")

Ref = tuple["str | None", BlobKey]


class BlobCache:
    """See the module docstring. A context manager; ``close`` is idempotent."""

    def __init__(self, cache_dir: str | Path, ha: Any, server_endpoint: str | None, secret: str, *,
                 max_size: int = 10 << 30, fetch_retries: int = 5, same_host: bool | None = None) -> None:
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.rglob(".*.tmp"):  # left by a process killed mid-transfer
            stale.unlink(missing_ok=True)
        self.ha = ha
        self.endpoint = server_endpoint
        self._secret = secret
        self.max_size = max_size
        self.retries = fetch_retries
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._key_locks: dict[Ref, threading.Lock] = collections.defaultdict(threading.Lock)
        self._lru: collections.OrderedDict[Ref, int] = collections.OrderedDict()  # ref -> size, verified
        self._task_refs: dict[int, collections.Counter[Ref]] = collections.defaultdict(collections.Counter)
        self._same_host = bool(BOOT_ID) if same_host is None else same_host
        self._closed = False

    def path(self, job_id: str | None, key: BlobKey) -> Path:
        return self.dir / job_dir_name(job_id) / str(key)

    # --- reading -----------------------------------------------------------------------------
    def open(self, job_id: str | None, key: BlobKey, task_attempt_id: int | None = None) -> Path:
        """Return the verified local path of a blob, fetching it once if needed."""
        ref = (job_id, key)
        if task_attempt_id is not None:
            with self._lock:
                self._task_refs[task_attempt_id][ref] += 1
        try:
            with self._key_locks[ref]:
                path = self.path(job_id, key)
                with self._lock:
                    known = ref in self._lru
                    if known:
                        self._lru.move_to_end(ref)
                if known and path.exists():
                    self.stats["hits"] += 1
                    return path
                if path.exists() and hash_file(path) == key.digest:  # e.g. a restarted agent's file
                    self.stats["hits"] += 1
                else:
                    path.unlink(missing_ok=True)
                    self._fetch(job_id, key, path)
                with self._lock:
                    self._lru[ref] = path.stat().st_size
                self._evict()
                return path
        except BaseException:
            if task_attempt_id is not None:
                self._drop_task_ref(task_attempt_id, ref)
            raise

    def _fetch(self, job_id: str | None, key: BlobKey, dest: Path) -> None:
        tried = []
        if key.permanent:
            try:
                self.ha.get(job_id, key, dest)
                self.stats["ha_fetches"] += 1
                return
            except (FileNotFoundError, ChecksumMismatchError, StewardError, OSError) as exc:
                tried.append(f"HA store {getattr(self.ha, 'url', '')}: {exc}")
        for attempt in range(self.retries + 1):
            if not self.endpoint:
                tried.append("BlobServer: no endpoint")
                break
            try:
                with Connection.connect(self.endpoint, self._secret) as conn:
                    if self._same_host:
                        conn.send({"op": "blob.get", "job_id": job_id, "key": str(key), "boot_id": BOOT_ID})
                        reply = Connection._check(conn.recv())
                        if "path" in reply and self._copy_local(reply["path"], dest, key):
                            self.stats["transfers"] += 1
                            self.stats["local_copies"] += 1
                            return
                        self._same_host = "path" not in reply
                    if not self._same_host:
                        conn.send({"op": "blob.get", "job_id": job_id, "key": str(key)})
                        reply = Connection._check(conn.recv())
                        verified_copy(RawReader(conn, int(reply["size"])), dest, key, f"BlobServer {self.endpoint}")
                self.stats["transfers"] += 1
                return
            except BlobNotFoundError as exc:
                tried.append(f"BlobServer: {exc}")
                break
            except (StewardError, OSError) as exc:
                tried.append(f"BlobServer attempt {attempt + 1}: {exc}")
                log.warning("fetching %s failed (attempt %d): %s", key, attempt + 1, exc)
        raise BlobNotFoundError(f"blob {key} of job {job_id!r}: no good copy could be fetched; tried "
                                + "; ".join(tried))

    def _copy_local(self, src: str, dest: Path, key: BlobKey) -> bool:
        """Copy the server's file in-kernel into a verified file of our own; False if not visible."""
        try:
            fin = open(src, "rb")
        except OSError:
            self._same_host = False  # same kernel, other mount namespace: stream from now on
            return False
        with fin:
            verified_copy(_KernelCopier(fin), dest, key, f"BlobServer file {src}")
        return True

    # --- references and size limit -------------------------------------------------------------
    def _drop_task_ref(self, task_attempt_id: int, ref: Ref) -> None:
        with self._lock:
            refs = self._task_refs.get(task_attempt_id)
            if refs:
                refs[ref] -= 1
                if refs[ref] <= 0:
                    del refs[ref]

    def release_task(self, task_attempt_id: int) -> None:
        """Release every reference of one task attempt (on task success, failure or kill)."""
        with self._lock:
            self._task_refs.pop(task_attempt_id, None)
        self._evict()

    def referenced(self) -> set[Ref]:
        with self._lock:
            return {r for refs in self._task_refs.values() for r in refs}

    def _evict(self) -> None:
        with self._lock:
            used = {r for refs in self._task_refs.values() for r in refs}
            total = sum(self._lru.values())
            victims = []
            for ref, size in list(self._lru.items()):  # least recently used first
                if total <= self.max_size:
                    break
                if ref not in used:
                    victims.append(ref)
                    total -= size
                    del self._lru[ref]
            if total > self.max_size:
                log.warning("blob cache holds %d bytes, over its %d limit, all referenced by running tasks",
                            total, self.max_size)
        for job_id, key in victims:
            self.path(job_id, key).unlink(missing_ok=True)  # open memory maps keep their pages
            self.stats["evictions"] += 1

    # --- libraries -----------------------------------------------------------------------------
    def library_paths(self, libraries: list[dict[str, Any]]) -> list[str]:
        """Fetch each library once and return importable paths (zip-likes as files, .py as a dir)."""
        paths = []
        for lib in libraries:
            key = BlobKey.parse(lib["key"])
            path = self.open(lib["job_id"], key)
            if library_kind(lib["name"]) == "zip":
                paths.append(str(path))
            else:
                d = self.dir / "@py" / str(key)
                if not (d / lib["name"]).exists():
                    d.mkdir(parents=True, exist_ok=True)
                    tmp = d / f".{uuid.uuid4().hex}.tmp"
                    os.link(path, tmp)
                    os.replace(tmp, d / lib["name"])
                paths.append(str(d))
        return paths

    # --- socket ------------------------------------------------------------------------------
    def register_handlers(self, server: Any) -> None:
        server.add_handler("blob.open", self._op_open)
        server.add_handler("blob.release_task", self._op_release_task)
        server.add_handler("blob.libraries", self._op_libraries)
        server.add_handler("blob.cache_stats", lambda conn, req: {"stats": dict(self.stats)})

    def _op_open(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        job_id, key = f.job_id(nullable=True), BlobKey.parse(f.text("key", max_len=64))
        path = self.open(job_id, key, f.integer("task_attempt_id", default=None, lo=0))
        return {"path": str(path)}

    def _op_release_task(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        self.release_task(Fields(req).integer("task_attempt_id", lo=0))
        return {}

    def _op_libraries(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        if not self.endpoint:
            return {"version": 0, "paths": []}
        with Connection.connect(self.endpoint, self._secret) as c:
            reply = c.request("blob.libraries")
        return {"version": reply["version"], "paths": self.library_paths(reply["libraries"])}

    def close(self) -> None:
        """Delete the cache directory. Idempotent."""
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BlobCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KernelCopier:
    """Marks ``verified_copy`` to copy with ``copy_file_range`` and hash the result afterwards."""

    def __init__(self, src: Any) -> None:
        self.src = src
