"""The BlobCache, hosted by each executor agent (FLIP-19).

``open(job, key, task)`` returns the path of a verified local copy, from the local cache, else the
HA store (a :class:`~sparksteward.blob.store.BlobView`, read only), else the BlobServer. Every
transfer goes to a temp file and is renamed into place only when complete and verified, so no reader
sees a partial file; a copy that fails its checksum is discarded and the next source is tried.
Concurrent requests for one blob share one transfer (single flight). On the BlobServer's own host the
transfer is an in-kernel copy of the server's file (``copy_file_range``) instead of a socket stream;
either way the copy is the cache's own file and is verified before it is renamed into place. A server
on another kernel (another boot id), or whose file is not visible here (another mount namespace),
streams the body instead. Requests to the BlobServer go over pooled connections (an
:class:`~sparksteward.wire.link.AgentLink`). Failed server fetches are retried with capped, jittered
exponential backoff on the injected clock. The cache holds at most
``max_size`` bytes: unreferenced blobs are evicted least recently used first; blobs referenced by a
running task attempt never are, nor are libraries handed to workers (``library_paths`` pins them for
the cache's lifetime: a worker that imported a zip reads it again for every module it loads).
Eviction holds the blob's key lock while it unlinks, so it cannot race ``open``. Task attempts
release their references through the executor plugin's task events (``release_task``).

The cache directory is private (0700) and holds an owner file (:mod:`sparksteward.owner`);
:func:`sparksteward.owner.sweep_dead` deletes sibling caches whose owner is proven dead (a killed or restarted
executor agent). ``close`` deletes the cache directory; a new cache removes temp files a killed
process left behind.

Thread-safety: one lock for the bookkeeping, one per key (:class:`KeyedLocks`) for transfers and
eviction. The cache starts no threads; ``close`` also closes its connections.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import random
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from sparksteward.blob.key import BlobKey
from sparksteward.blob.locks import KeyedLocks
from sparksteward.blob.messages import (
    BlobCacheStatsRequest,
    BlobDone,
    BlobGetReply,
    BlobGetRequest,
    BlobLibrariesReply,
    BlobLibrariesRequest,
    BlobOpenFileReply,
    BlobOpenFileRequest,
    BlobOpenReply,
    BlobOpenRequest,
    BlobReleaseTaskRequest,
    BlobStatsReply,
)
from sparksteward.blob.store import job_dir_name, verified_copy
from sparksteward.blob.url import BlobUrl
from sparksteward.clock import Clock, SystemClock
from sparksteward.errors import BlobNotFoundError, ChecksumMismatchError, ConfigError, ProtocolError, StewardError
from sparksteward.hashing import hash_file
from sparksteward.libraries import library_kind
from sparksteward.owner import OwnerRecord, private_dir
from sparksteward.owner import boot_id as host_boot_id
from sparksteward.wire import AgentServer, Connection, RawReader
from sparksteward.wire.link import AgentLink
from sparksteward.wire.messages import read_reply

__all__ = ["BlobCache"]

log = logging.getLogger("sparksteward.blob.cache")

Ref = tuple["str | None", BlobKey]


class BlobCache:
    """See the module docstring. A context manager; ``close`` is idempotent."""

    def __init__(self, cache_dir: str | Path, ha: Any, server_endpoint: str | None, secret: str, *,
                 max_size: int = 10 << 30, fetch_retries: int = 5, same_host: bool | None = None,
                 rpc_timeout: float = 120.0,
                 boot_id: str | None = None, clock: Clock | None = None, rng: random.Random | None = None,
                 initial_backoff: float = 0.1, max_backoff: float = 5.0) -> None:
        self.dir = private_dir(Path(cache_dir))
        OwnerRecord.current().write(self.dir)
        for stale in self.dir.rglob(".*.tmp"):  # left by a process killed mid-transfer
            stale.unlink(missing_ok=True)
        self.ha = ha
        self.endpoint = server_endpoint
        self._secret = secret
        self.max_size = max_size
        self.retries = fetch_retries
        self.rpc_timeout = rpc_timeout
        #: pooled connections to the BlobServer (None without an endpoint)
        self.link = AgentLink(server_endpoint, secret, timeout=rpc_timeout) if server_endpoint else None
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._key_locks = KeyedLocks()
        self._lru: collections.OrderedDict[Ref, int] = collections.OrderedDict()  # ref -> size, verified
        self._pinned: set[Ref] = set()  # libraries handed to workers: never evicted
        self._task_refs: dict[int, collections.Counter[Ref]] = collections.defaultdict(collections.Counter)
        #: this host's kernel boot id, sent with ``blob.get``; the server names its file only when it matches
        self.boot_id = host_boot_id() if boot_id is None else boot_id
        self._same_host = bool(self.boot_id) if same_host is None else same_host
        if not 0 < initial_backoff <= max_backoff:
            raise ConfigError(f"blob fetch backoff: need 0 < initial ({initial_backoff}) <= max ({max_backoff})")
        self._clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._backoff = (initial_backoff, max_backoff)
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
                self._evict()  # never removes this ref: its key lock is held here
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
        link = self.link
        if link is None:
            tried.append("BlobServer: no endpoint")
        for attempt in range(self.retries + 1 if link is not None else 0):
            if attempt:
                self._clock.sleep(self._retry_delay(attempt))
            try:
                # one try per attempt (no resend inside): a failed attempt is retried here, after a backoff
                self._server_get(job_id, key, dest)
                self.stats["transfers"] += 1
                return
            except BlobNotFoundError as exc:
                tried.append(f"BlobServer: {exc}")
                break
            except (StewardError, OSError) as exc:
                tried.append(f"BlobServer attempt {attempt + 1}: {exc}")
                log.warning("fetching %s failed (attempt %d of %d): %s", key, attempt + 1, self.retries + 1, exc)
        raise BlobNotFoundError(f"blob {key} of job {job_id!r}: no good copy could be fetched; tried "
                                + "; ".join(tried))

    def _retry_delay(self, retry: int) -> float:
        """Exponential backoff before retry number ``retry`` (1-based), capped, with jitter in [d/2, d]."""
        initial, cap = self._backoff
        delay = min(cap, initial * 2.0 ** (retry - 1))
        return delay * (1.0 - 0.5 * self._rng.random())

    def _server_get(self, job_id: str | None, key: BlobKey, dest: Path) -> None:
        assert self.link is not None
        self.link.run(lambda conn: self._get_from_server(conn, job_id, key, dest))

    def _get_from_server(self, conn: Connection, job_id: str | None, key: BlobKey, dest: Path) -> None:
        """One ``blob.get`` on ``conn``: an in-kernel copy of the server's file when it is on this host
        and visible here, else the body the server streams. Raises on any failure (the caller retries);
        a connection left mid-body is marked broken (never pooled again)."""
        request = BlobGetRequest(job_id, key)
        if self._same_host:
            reply = self._ask_get(conn, BlobGetRequest(job_id, key, self.boot_id))
            if reply.path is None:
                # another kernel (another host): the server streams the body right after this reply
                self._same_host = False
                self._receive_body(conn, reply, dest, key)
                return
            if self._copy_local(reply.path, dest, key):
                self.stats["local_copies"] += 1
                return
            # the same kernel, but the file is not visible here: nothing was streamed, ask for the body
        self._receive_body(conn, self._ask_get(conn, request), dest, key)

    @staticmethod
    def _ask_get(conn: Connection, request: BlobGetRequest) -> BlobGetReply:
        conn.send({"op": request.OP, **request.to_wire()})
        reply = Connection._check(conn.recv())
        try:
            return read_reply(request, reply)
        except StewardError:
            conn.broken = True   # a reply we cannot read: whatever follows it is not ours to read
            raise

    def _receive_body(self, conn: Connection, reply: BlobGetReply, dest: Path, key: BlobKey) -> None:
        if reply.path is not None:
            raise ProtocolError(f"BlobServer {self.endpoint} answered blob.get for {key} without a streamed "
                                f"body of a valid size: {reply.to_wire()!r}")
        reader = RawReader(conn, reply.size)
        try:
            verified_copy(reader, dest, key, f"BlobServer {self.endpoint}")
        except BaseException:
            conn.broken = conn.broken or reader.left > 0 or not reader._verified
            raise

    def _copy_local(self, src: str, dest: Path, key: BlobKey) -> bool:
        """Copy the server's file in-kernel into a verified file of our own; False if it is not usable here.

        The server names its file when our boot ids match, but a peer in another mount namespace (a
        container on the same kernel) cannot see it, or sees another file under that name. Either way
        we fall back to the stream, for this blob and from now on.
        """
        try:
            fin = open(src, "rb")
        except OSError as exc:
            log.info("the BlobServer's file %s is not visible here (%s): streaming blobs from now on", src, exc)
            self._same_host = False  # same kernel, other mount namespace
            return False
        with fin:
            try:
                verified_copy(_KernelCopier(fin), dest, key, f"BlobServer file {src}")
            except ChecksumMismatchError as exc:
                log.warning("the BlobServer's file %s is not the blob here (%s): streaming blobs from now on",
                            src, exc)
                self._same_host = False
                return False
            except OSError as exc:  # e.g. EXDEV: copy_file_range refuses this pair of file systems
                log.warning("copying the BlobServer's file %s failed (%s): streaming this blob", src, exc)
                if exc.errno in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                    self._same_host = False
                return False
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
        """Unlink least recently used, unreferenced, unpinned blobs until the cache fits ``max_size``.

        Victims are chosen under the bookkeeping lock; each is then unlinked only while holding its key
        lock (skipped if that lock is busy: someone is opening it) and after checking again that it is
        still unreferenced and was not re-opened meanwhile.
        """
        with self._lock:
            used = {r for refs in self._task_refs.values() for r in refs} | self._pinned
            total = sum(self._lru.values())
            victims = []
            for ref, size in list(self._lru.items()):  # least recently used first
                if total <= self.max_size:
                    break
                if ref not in used:
                    victims.append((ref, size))
                    total -= size
            if total > self.max_size:
                log.warning("blob cache holds %d bytes, over its %d limit, all referenced by running tasks "
                            "or pinned libraries", total, self.max_size)
        for ref, _size in victims:
            with self._key_locks.try_hold(ref) as got:
                if not got:
                    continue  # being opened right now: not a victim
                with self._lock:
                    if ref in self._pinned or any(ref in refs for refs in self._task_refs.values()):
                        continue
                    if self._lru.get(ref) is None:
                        continue  # already gone
                    del self._lru[ref]
                path = self.path(*ref)
                path.unlink(missing_ok=True)  # open memory maps keep their pages until unmapped
                self.stats["evictions"] += 1

    # --- finished jobs ------------------------------------------------------------------------
    def job_ids(self) -> set[str | None]:
        """The jobs this cache holds verified blobs of."""
        with self._lock:
            return {job_id for job_id, _ in self._lru}

    def drop_job(self, job_id: str | None) -> int:
        """Delete this cache's copies of a finished job's blobs; return how many were deleted.

        Copies referenced by a running task attempt, or being opened right now, are kept (LRU eviction
        takes them later); open memory maps keep their pages. Idempotent."""
        with self._lock:
            used = {r for refs in self._task_refs.values() for r in refs}
            candidates = [r for r in self._lru if r[0] == job_id and r not in used]
        dropped = 0
        for ref in candidates:
            with self._key_locks.try_hold(ref) as got:
                if not got:
                    continue  # being opened: in use
                with self._lock:  # a task may have taken a reference since
                    if any(ref in refs for refs in self._task_refs.values()) or self._lru.pop(ref, None) is None:
                        continue
                self.path(*ref).unlink(missing_ok=True)
                dropped += 1
        try:
            (self.dir / job_dir_name(job_id)).rmdir()  # only once empty
        except OSError:
            pass
        if dropped:
            self.stats["job_drops"] += dropped
        return dropped

    # --- libraries -----------------------------------------------------------------------------
    def library_paths(self, libraries: list[dict[str, Any]]) -> list[str]:
        """Fetch each library once and return importable paths (zip-likes as files, .py as a dir)."""
        paths = []
        for lib in libraries:
            key = BlobKey.parse(lib["key"])
            with self._lock:  # pinned before it is opened: eviction never takes a worker's library
                self._pinned.add((lib["job_id"], key))
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
    def register_handlers(self, server: AgentServer) -> None:
        """Serve the executor agent's ``blob.*`` ops of :mod:`sparksteward.blob.messages` on ``server``."""
        server.serve(BlobOpenRequest, self._op_open)
        server.serve(BlobReleaseTaskRequest, self._op_release_task)
        server.serve(BlobLibrariesRequest, self._op_libraries)
        server.serve(BlobCacheStatsRequest, lambda conn, req: BlobStatsReply(dict(self.stats)))
        server.serve(BlobOpenFileRequest, self._op_open_file)

    def _op_open_file(self, conn: Connection | None, req: BlobOpenFileRequest) -> BlobOpenFileReply:
        """Open a ``steward://`` URL of this application (or its cluster) through the cache: the verified
        local copy's path and size. ``conn`` is None when the shim asks over the agent's pipes."""
        text = req.url
        try:
            url = BlobUrl.parse(text)
            url.check_scope(self._secret, getattr(self.ha, "cluster_id", None))
            path = self.open(url.job_id, url.key)
        except (StewardError, OSError) as exc:  # into the executor log; the caller's task fails with it
            log.error("cannot open %s: %s", text, exc)
            raise
        self.stats["file_opens"] += 1
        return BlobOpenFileReply(str(path), path.stat().st_size)

    def _op_open(self, conn: Connection, req: BlobOpenRequest) -> BlobOpenReply:
        return BlobOpenReply(str(self.open(req.job_id, req.key, req.task_attempt_id)))

    def _op_release_task(self, conn: Connection, req: BlobReleaseTaskRequest) -> BlobDone:
        self.release_task(req.task_attempt_id)
        return BlobDone()

    def _op_libraries(self, conn: Connection, req: BlobLibrariesRequest) -> BlobLibrariesReply:
        if self.link is None:
            return BlobLibrariesReply(0, paths=[])
        reply = self.link.ask(BlobLibrariesRequest())
        return BlobLibrariesReply(reply.version, paths=self.library_paths(reply.libraries or []))

    def close(self) -> None:
        """Close the connections to the BlobServer and delete the cache directory. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.link is not None:
                self.link.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BlobCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KernelCopier:
    """Marks ``verified_copy`` to copy with ``copy_file_range`` and hash the result afterwards."""

    def __init__(self, src: Any) -> None:
        self.src = src
