"""The BlobServer, hosted by the driver agent (FLIP-19).

Local store ``<dir>/<job>/<key>`` (a fresh directory per agent, deleted on close), plus an HA store on any fsspec
URL laid out the same way. Uploads land in the local store and, for permanent blobs, in the HA store before they are
acknowledged. Downloads are served from the local store with ``sendfile``; a missing or corrupt local copy is
refilled from HA. Content addressing makes a second upload of the same content a no-op (counted in
``stats["dedup"]``).

Ref counts live per (job, key). A blob whose count reaches 0 enters staged cleanup: the first pass after the release
marks it, the next pass deletes its local copy, so it lives between one and two ``retention`` intervals. The HA copy
of a permanent blob stays until its job is final, except for orphans (``retain_jobs``: blobs of jobs that are gone)
and job-less blobs, whose HA copies staged cleanup deletes too. A failed HA delete is logged and retried on the next
pass; it never stops the pass. ``delete_job`` removes a job's directory from local and HA storage whatever the
counts say; executor caches ask ``blob.deleted_jobs`` and drop their copies of such jobs. A put of the job is
ordered against it (a forced re-run may put while the old run's cleanup deletes): a put waits while the job's delete
runs, and a put that was storing when the delete began stores its copies again after it, so an acknowledged
permanent put always has its HA copy unless it finished before the delete began.

Every upload is staged as the server's own file (moved into ``incoming/``, or copied, never hard-linked, so the
caller cannot change it afterwards; a streamed one into an open, often unnamed, file of
:class:`~sparksteward.blob.staging.StagingArea`), hashed and renamed or linked into place (the local store is
scratch and is not fsynced: [decision 0008]); a permanent blob is then put to HA (durably, see
:class:`~sparksteward.blob.store.FileSystemBlobStore`) before the reply says ``"ha": true``. On a dedup hit the
existing local file is re-hashed before it is trusted (always before it is uploaded to HA); a corrupt one is
replaced by the incoming, verified bytes.

Same-host uploads (``blob.put_path``) never cross a socket: the client writes into ``incoming/`` and the server
renames it into place (``move``) or copies it. Paths outside ``incoming/`` are refused. Same-host downloads (a
caller with this kernel's boot id) get the file's path instead of a stream and copy it in-kernel into their own,
independently verified file; if that path is not visible to them (another mount namespace) they ask for a stream.

Thread-safety: one lock guards the bookkeeping; a lock per key (:class:`KeyedLocks`, which forgets free keys)
serializes placing, refilling and deleting a blob. A gate per job (:class:`JobGate`) lets the puts and refills of a
job run side by side and ``delete_job`` of it run alone; it is taken before the key lock. ``close`` joins the
cleanup thread.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.locks import JobGate, KeyedLocks
from sparksteward.blob.messages import (
    BlobAcquireRequest,
    BlobAddLibraryReply,
    BlobAddLibraryRequest,
    BlobDeletedJobsReply,
    BlobDeletedJobsRequest,
    BlobDeleteJobRequest,
    BlobDone,
    BlobGetReply,
    BlobGetRequest,
    BlobInfoReply,
    BlobInfoRequest,
    BlobLibrariesReply,
    BlobLibrariesRequest,
    BlobListReply,
    BlobListRequest,
    BlobOpenFileReply,
    BlobOpenFileRequest,
    BlobPutPathRequest,
    BlobPutReply,
    BlobPutRequest,
    BlobRefsReply,
    BlobReleaseRequest,
    BlobStatsReply,
    BlobStatsRequest,
)
from sparksteward.blob.staging import StagingArea, commit_staged, copy_file, link_open_file, link_staged, unlink_quietly
from sparksteward.blob.store import job_dir_name
from sparksteward.blob.url import BlobUrl
from sparksteward.clock import SystemClock
from sparksteward.errors import (
    BlobNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    InvalidIdError,
    MessageTooLargeError,
)
from sparksteward.hashing import Hasher, hash_file
from sparksteward.ids import validate_job_id
from sparksteward.libraries import validate_library_name
from sparksteward.owner import boot_id
from sparksteward.wire import AgentServer, Connection

__all__ = ["BlobServer"]

log = logging.getLogger("sparksteward.blob.server")


#: Identifies this machine's running kernel: equal boot ids mean the same host.
BOOT_ID = boot_id()

#: How many deleted job ids ``blob.deleted_jobs`` remembers (oldest forgotten first).
_DELETED_JOBS_KEPT = 4096

Ref = tuple["str | None", BlobKey]


def _job(value: object) -> str | None:
    return None if value is None else validate_job_id(value)


class BlobServer:
    """See the module docstring. A context manager; ``close`` is idempotent."""

    def __init__(self, local_dir: str | Path, ha: Any, *, retention: float = 1800.0, max_size: int = 16 << 30,
                 clock: Any = None, timer: bool = True, secret: str | None = None,
                 unnamed_staging: bool = True) -> None:
        self.dir = Path(local_dir)
        #: the application secret, only to recognize this application's steward:// URLs (blob.open_file)
        self.secret = secret
        self.incoming = self.dir / "@incoming"
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._dir_str = str(self.dir)
        # spare staged files wait outside incoming/: no client can name one
        self.spare_dir = self.dir / "@spare"
        self.spare_dir.mkdir(exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.ha = ha
        self.retention = retention
        self.max_size = max_size
        self.clock = clock or SystemClock()
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._key_locks = KeyedLocks()
        # puts and refills of a job against delete_job of it (see _place and delete_job)
        self._job_gate = JobGate(on_wait=self._count_gate_wait)
        self._refs: collections.Counter[Ref] = collections.Counter()
        self._verified: set[Ref] = set()
        self._marked: set[Ref] = set()     # released, deleted at the next pass
        self._released: set[Ref] = set()  # released since the last pass
        self._orphans: set[Ref] = set()   # HA blobs of jobs that are gone: their HA copy goes too
        self._put_in_pass: set[Ref] = set()  # put since the current pass chose its victims: spared
        self._libraries: list[dict[str, Any]] = []
        self._deleted_jobs: collections.OrderedDict[str | None, None] = collections.OrderedDict()
        self._next_pass = self.clock.now() + retention
        self._stop = threading.Event()
        self._closed = False
        self._timer = threading.Thread(target=self._run_timer, name="steward-blob-cleanup", daemon=True)
        if timer:
            self._timer.start()
        #: the uploads' staged files, with spares made ahead of streamed uploads (see blob.staging)
        self.staging = StagingArea(self.incoming, self.spare_dir, unnamed=unnamed_staging)

    def _count_gate_wait(self, what: str) -> None:
        # job_gate_waits: puts and refills that wait for their job's delete; job_delete_waits: deletes
        # that wait for the puts and refills of their job inside
        self.stats["job_gate_waits" if what == "enter" else "job_delete_waits"] += 1

    # --- storage -----------------------------------------------------------------------------
    def local_path(self, job_id: str | None, key: BlobKey) -> Path:
        return Path(self._local(job_id, key))

    def _local(self, job_id: str | None, key: BlobKey) -> str:
        return f"{self._dir_str}/{job_dir_name(job_id)}/{key}"

    def put_file(self, src: Path, job_id: str | None, btype: BlobType, *, move: bool = False) -> tuple[BlobKey, int]:
        """Store the file ``src`` as a blob and return ``(key, size)``.

        With ``move`` the server takes ownership of ``src`` (renamed away); without, it copies it, so
        later changes to ``src`` cannot reach the blob. Either way the server hashes its own staged
        file. A permanent blob is durable in HA when this returns.
        """
        job_id = _job(job_id)
        size = src.stat().st_size
        if size > self.max_size:
            raise MessageTooLargeError(f"blob of {size} bytes exceeds spark.steward.blob.max-size ({self.max_size})")
        staged = self.staging.path()
        try:
            if move:
                if src.stat().st_dev == self.incoming.stat().st_dev:
                    os.replace(src, staged)
                else:
                    shutil.move(src, staged)
            else:
                copy_file(src, Path(staged))
            size = os.stat(staged).st_size
            if size > self.max_size:  # the caller's file grew while it was copied
                raise MessageTooLargeError(f"blob of {size} bytes exceeds spark.steward.blob.max-size "
                                           f"({self.max_size})")
            return self._place(staged, job_id, btype, hash_file(staged), size)
        except BaseException:
            unlink_quietly(staged)
            raise

    def _place(self, staged: str | int, job_id: str | None, btype: BlobType, digest: bytes,
               size: int) -> tuple[BlobKey, int]:
        """Make the staged file, whose content hashes to ``digest``, the blob's local copy (or drop it
        if an intact copy is there) and, for a permanent blob, put it to HA. ``staged`` is a path, or
        the fd of an unnamed file (which the caller closes). On success a named ``staged`` is gone;
        after an error the caller removes it.

        Ordered against :meth:`delete_job` of the job (its :class:`JobGate`): a put waits while the job
        is being deleted, and one that was storing when the delete began stores its copies again after
        it, so the put is acknowledged only with copies the delete does not remove."""
        key = BlobKey(btype, digest)
        ref = (job_id, key)
        dest = self._local(job_id, key)
        gate = self._job_gate
        gate.enter(job_id)
        try:
            self._store(staged, job_id, key, ref, dest)
        except BaseException:
            gate.leave(job_id)
            raise
        if gate.try_leave(job_id):
            return key, size
        # delete_job(job_id) began while this put was storing, and deletes its copies as soon as it
        # leaves: keep the bytes (a second name of the local copy, the server's own file, in incoming/)
        # and store them again once the delete is done: the put is ordered after the delete
        try:
            again = self.staging.path()
            os.link(dest, again)
        finally:
            gate.leave(job_id)
        self.stats["puts_after_delete"] += 1
        log.info("a put of %s for job %s overlapped the job's delete; storing it again after the delete", key, job_id)
        try:
            return self._place(again, job_id, btype, digest, size)
        except BaseException:
            unlink_quietly(again)
            raise

    def _store(self, staged: str | int, job_id: str | None, key: BlobKey, ref: Ref, dest: str) -> None:
        """:meth:`_place`'s work, inside the job's gate."""
        with self._key_locks[ref]:
            with self._lock:
                self._deleted_jobs.pop(job_id, None)  # a forced re-run stores blobs under the job again
                # a put revives a blob that staged cleanup was about to take
                self._marked.discard(ref)
                self._released.discard(ref)
                self._orphans.discard(ref)
                self._put_in_pass.add(ref)
            needs_ha = key.permanent and not self.ha.exists(job_id, key)
            if isinstance(staged, int):
                placed = link_staged(staged, dest)
            elif placed := not os.path.exists(dest):
                commit_staged(staged, dest)
            if placed:
                self.stats["uploads"] += 1
            elif (needs_ha or ref not in self._verified) and hash_file(dest) != key.digest:
                log.warning("local copy %s does not match its key; replacing it with the uploaded bytes", dest)
                self.stats["corrupt_replaced"] += 1
                self._verified.discard(ref)
                if isinstance(staged, int):  # a rename replaces, a link does not: name it first
                    named = self.staging.path()
                    link_open_file(staged, named)
                    try:
                        commit_staged(named, dest)
                    except BaseException:
                        unlink_quietly(named)
                        raise
                else:
                    commit_staged(staged, dest)
            else:
                if isinstance(staged, str):
                    os.unlink(staged)
                self.stats["dedup"] += 1
            self._verified.add(ref)
            if needs_ha:
                try:
                    self.ha.put(job_id, key, Path(dest))
                    self.stats["ha_uploads"] += 1
                except Exception:
                    self._verified.discard(ref)
                    unlink_quietly(dest)  # acknowledged only when the HA copy is durable
                    raise

    def in_ha(self, key: BlobKey) -> bool:
        """Whether an acknowledged put of ``key`` is stored in an HA store."""
        return key.permanent and getattr(self.ha, "url", "none") != "none"

    def receive(self, conn: Connection, job_id: str | None, btype: BlobType, size: int) -> tuple[BlobKey, int]:
        """Receive ``size`` raw bytes from ``conn`` into the store; a truncated or tampered upload
        leaves nothing (its body tag is verified before the last bytes are written)."""
        if not isinstance(size, int) or size < 0 or size > self.max_size:
            raise MessageTooLargeError(f"announced blob size {size!r} is not between 0 and "
                                       f"spark.steward.blob.max-size ({self.max_size})")
        path, fd = self.staging.take()
        h = Hasher()
        try:
            conn.recv_into_file(fd, size, h.update)
            return self._place(fd if path is None else path, _job(job_id), btype, h.digest(), size)
        except BaseException:
            if path is not None:
                unlink_quietly(path)
            raise
        finally:
            os.close(fd)  # an unnamed file that was not linked goes with it

    def ensure_local(self, job_id: str | None, key: BlobKey) -> Path:
        """The verified local copy of a blob, refilled from HA if missing or corrupt."""
        return Path(self._ensure_local(job_id, key))

    def _ensure_local(self, job_id: str | None, key: BlobKey) -> str:
        job_id = _job(job_id)
        # inside the job's gate: a refill from HA never lands after delete_job removed the local copies
        self._job_gate.enter(job_id)
        try:
            return self._ensure_local_in_gate(job_id, key)
        finally:
            self._job_gate.leave(job_id)

    def _ensure_local_in_gate(self, job_id: str | None, key: BlobKey) -> str:
        path = self._local(job_id, key)
        with self._key_locks[(job_id, key)]:
            exists = os.path.exists(path)
            if exists and (job_id, key) not in self._verified:
                if hash_file(path) == key.digest:
                    self._verified.add((job_id, key))
                else:
                    log.warning("local copy of %s is corrupt; discarding it", key)
                    os.unlink(path)
                    exists = False
            if not exists:
                if not key.permanent:
                    raise BlobNotFoundError(f"blob {key} of job {job_id!r} is not stored on this server")
                try:
                    self.ha.get(job_id, key, Path(path))
                except (FileNotFoundError, ChecksumMismatchError) as exc:
                    raise BlobNotFoundError(f"blob {key} of job {job_id!r}: no good copy locally or in the HA "
                                            f"store {self.ha.url}: {exc}") from exc
                self.stats["ha_fetches"] += 1
                self._verified.add((job_id, key))
            return path

    # --- references and staged cleanup ---------------------------------------------------------
    def acquire(self, job_id: str | None, key: BlobKey) -> int:
        with self._lock:
            ref = (_job(job_id), key)
            self._refs[ref] += 1
            self._marked.discard(ref)
            self._released.discard(ref)
            return self._refs[ref]

    def release(self, job_id: str | None, key: BlobKey) -> int:
        with self._lock:
            ref = (_job(job_id), key)
            if self._refs[ref] > 0:
                self._refs[ref] -= 1
            if self._refs[ref] == 0:
                del self._refs[ref]
                self._released.add(ref)
                return 0
            return self._refs[ref]

    def run_cleanup(self) -> list[Ref]:
        """One staged-cleanup pass: delete what the previous pass marked and is still unreferenced.

        Local copies always go; HA copies of transient, orphaned and job-less blobs too. One failing
        HA delete is logged and retried on the next pass; the rest of the pass goes on. Returns the
        refs deleted.
        """
        with self._lock:
            self._put_in_pass.clear()
            doomed = [r for r in self._marked if self._refs[r] == 0]
            self._marked, self._released = {r for r in self._released if self._refs[r] == 0}, set()
        deleted: list[Ref] = []
        failed: list[Ref] = []
        for ref in doomed:
            if self._stop.is_set():  # closing: the rest waits for the next agent's recovery
                failed.append(ref)
                continue
            job_id, key = ref
            with self._key_locks[ref]:
                with self._lock:
                    if self._refs[ref] > 0 or ref in self._put_in_pass:  # acquired or put again meanwhile
                        continue
                    from_ha = not key.permanent or job_id is None or ref in self._orphans
                try:
                    if from_ha:
                        self.ha.delete(job_id, key)
                except Exception as exc:  # noqa: BLE001 - any backend error: retry next pass
                    self.stats["ha_delete_failures"] += 1
                    log.warning("staged cleanup could not delete %s of job %s from the HA store %s (retried "
                                "on the next pass): %s", key, job_id, getattr(self.ha, "url", ""), exc)
                    failed.append(ref)
                    continue
                path = self.local_path(job_id, key)
                if path.exists():
                    path.unlink(missing_ok=True)
                try:
                    path.parent.rmdir()  # whole job directory, once empty
                except OSError:
                    pass
                with self._lock:
                    self._verified.discard(ref)
                    self._orphans.discard(ref)
                deleted.append(ref)
        with self._lock:
            self._marked |= {r for r in failed if self._refs[r] == 0}
        if deleted:
            self.stats["cleanup_deleted"] += len(deleted)
            log.info("staged cleanup deleted %d blob(s)", len(deleted))
        return deleted

    def tick(self) -> None:
        """Run a cleanup pass if ``retention`` has passed on the clock since the last one."""
        if self.clock.now() >= self._next_pass:
            self._next_pass = self.clock.now() + self.retention
            self.run_cleanup()

    def _run_timer(self) -> None:
        while not self._stop.wait(min(max(self.retention, 0.05), 1.0)):
            try:
                self.tick()
            except Exception:
                log.exception("staged blob cleanup failed")

    def delete_job(self, job_id: str | None) -> None:
        """Delete a job's blobs from local and HA storage, whatever their counts (idempotent).

        Runs alone in the job's :class:`JobGate`: it waits for the puts and refills of the job that are
        inside, and new ones wait for it, so nothing of the job is stored between its local and its HA
        delete. A put that was storing when it began stores its copies again after it (see
        :meth:`_place`). A put that finished before it began is deleted with the job.
        """
        job_id = _job(job_id)
        with self._job_gate.alone(job_id):
            with self._lock:
                for ref in [r for r in list(self._refs) + list(self._marked) + list(self._released)
                            if r[0] == job_id]:
                    self._refs.pop(ref, None)
                    self._marked.discard(ref)
                    self._released.discard(ref)
                self._verified = {r for r in self._verified if r[0] != job_id}
                self._orphans = {r for r in self._orphans if r[0] != job_id}
                self._libraries = [lib for lib in self._libraries if lib["job_id"] != job_id]
                self._deleted_jobs[job_id] = None
                self._deleted_jobs.move_to_end(job_id)
                while len(self._deleted_jobs) > _DELETED_JOBS_KEPT:
                    self._deleted_jobs.popitem(last=False)
            shutil.rmtree(self.dir / job_dir_name(job_id), ignore_errors=True)
            self.ha.delete_job(job_id)
        log.info("deleted the blobs of job %s (local and HA)", job_id)

    def deleted_jobs(self, job_ids: list[str | None]) -> list[str | None]:
        """Those of ``job_ids`` whose blobs :meth:`delete_job` deleted (and none were stored since).

        Executor caches ask this to drop the blob directories of finished jobs."""
        with self._lock:
            return [j for j in job_ids if j in self._deleted_jobs]

    def retain_jobs(self, live: set[str | None]) -> list[str | None]:
        """Put the HA blobs of every job not in ``live`` into staged cleanup (orphans): after the
        retention their HA copies are deleted too."""
        orphans = [j for j in self.ha.jobs() if j not in live]
        found = [(job_id, key) for job_id in orphans for key, _ in self.ha.keys(job_id)]
        with self._lock:
            for ref in found:
                if self._refs[ref] == 0:
                    self._released.add(ref)
                    self._orphans.add(ref)
        return orphans

    # --- libraries ---------------------------------------------------------------------------
    def add_library(self, job_id: str | None, key: BlobKey, name: str) -> int:
        with self._lock:
            lib = {"job_id": _job(job_id), "key": str(key), "name": validate_library_name(name)}
            if lib not in self._libraries:
                self._libraries.append(lib)
            return len(self._libraries)

    def libraries(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._libraries)

    # --- socket ------------------------------------------------------------------------------
    def register_handlers(self, server: AgentServer) -> None:
        """Serve the ``blob.*`` ops of :mod:`sparksteward.blob.messages` on ``server``."""
        server.serve(BlobInfoRequest, self._op_info)
        server.serve(BlobPutRequest, self._op_put, body=True)   # a refused header closes the connection
        server.serve(BlobPutPathRequest, self._op_put_path)
        server.serve(BlobGetRequest, self._op_get)
        server.serve(BlobAcquireRequest, self._op_acquire)
        server.serve(BlobReleaseRequest, self._op_release)
        server.serve(BlobDeleteJobRequest, self._op_delete_job)
        server.serve(BlobListRequest, self._op_list)
        server.serve(BlobStatsRequest, self._op_stats)
        server.serve(BlobAddLibraryRequest, self._op_add_library)
        server.serve(BlobLibrariesRequest, self._op_libraries)
        server.serve(BlobDeletedJobsRequest, self._op_deleted_jobs)
        server.serve(BlobOpenFileRequest, self._op_open_file)

    def _op_info(self, conn: Connection, req: BlobInfoRequest) -> BlobInfoReply:
        return BlobInfoReply(str(self.incoming), os.getpid())

    def _op_put(self, conn: Connection, req: BlobPutRequest) -> BlobPutReply:
        key, size = self.receive(conn, req.job_id, req.type, req.size)
        return BlobPutReply(key, size, self.in_ha(key))

    def _op_put_path(self, conn: Connection, req: BlobPutPathRequest) -> BlobPutReply:
        src = Path(os.path.realpath(req.path))
        if src.parent != self.incoming.resolve() or not src.is_file() or src.name.startswith(".stage-"):
            # .stage-*: the server's own staged uploads, which it may still be writing into
            raise InvalidIdError(f"blob.put_path takes a file directly in {self.incoming} (ask blob.info) that a "
                                 f"client staged there, not {req.path!r}")
        key, size = self.put_file(src, req.job_id, req.type, move=req.move)
        return BlobPutReply(key, size, self.in_ha(key))

    def _op_get(self, conn: Connection, req: BlobGetRequest) -> None:
        """Stream the blob after the reply, or name its file to a caller on this kernel."""
        job_id, key = req.job_id, req.key
        path = self._local(job_id, key)
        fd = -1
        if (job_id, key) in self._verified:  # the common case: no key lock, no stat before the open
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # deleted since it was verified: the slow path refills or refuses
                pass
        if fd < 0:
            path = self._ensure_local(job_id, key)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if req.boot_id and req.boot_id == BOOT_ID:
                # same kernel: the caller copies the file in-kernel (copy_file_range); no socket copy
                conn.send({"ok": True, **BlobGetReply(size, path).to_wire()})
                self.stats["served"] += 1
                self.stats["served_local"] += 1
                return
            conn.send_file(fd, size, head={"ok": True, **BlobGetReply(size).to_wire()})
        finally:
            os.close(fd)
        self.stats["served"] += 1
        self.stats["bytes_served"] += size
        return

    def _op_acquire(self, conn: Connection, req: BlobAcquireRequest) -> BlobRefsReply:
        return BlobRefsReply(self.acquire(req.job_id, req.key))

    def _op_release(self, conn: Connection, req: BlobReleaseRequest) -> BlobRefsReply:
        return BlobRefsReply(self.release(req.job_id, req.key))

    def _op_delete_job(self, conn: Connection, req: BlobDeleteJobRequest) -> BlobDone:
        self.delete_job(req.job_id)
        return BlobDone()

    def _op_list(self, conn: Connection, req: BlobListRequest) -> BlobListReply:
        out = []
        for job_dir in sorted(p for p in self.dir.iterdir() if p.is_dir() and p not in (self.incoming, self.spare_dir)):
            for f in sorted(job_dir.iterdir()):
                if not f.name.startswith("."):
                    out.append({"job_dir": job_dir.name, "key": f.name, "size": f.stat().st_size})
        with self._lock:
            refs = {f"{job_dir_name(j)}/{k}": n for (j, k), n in self._refs.items()}
        for b in out:
            b["refs"] = refs.get(f"{b['job_dir']}/{b['key']}", 0)
        return BlobListReply(out)

    def _op_deleted_jobs(self, conn: Connection, req: BlobDeletedJobsRequest) -> BlobDeletedJobsReply:
        return BlobDeletedJobsReply(self.deleted_jobs(req.job_ids))

    def _op_open_file(self, conn: Connection | None, req: BlobOpenFileRequest) -> BlobOpenFileReply:
        """A ``steward://`` URL of this application (or its cluster): the verified local copy in this
        server's store (refilled from HA), for the driver's own reads (``addJar`` checks it exists)."""
        url = BlobUrl.parse(req.url)
        if self.secret is None:
            raise ConfigError("this BlobServer was made without the application secret: it cannot check the "
                              "scope of steward:// URLs (pass secret= to BlobServer)")
        url.check_scope(self.secret, getattr(self.ha, "cluster_id", None))
        path = self.ensure_local(url.job_id, url.key)
        self.stats["file_opens"] += 1
        return BlobOpenFileReply(str(path), path.stat().st_size)

    def _op_stats(self, conn: Connection, req: BlobStatsRequest) -> BlobStatsReply:
        return BlobStatsReply(dict(self.stats))

    def _op_add_library(self, conn: Connection, req: BlobAddLibraryRequest) -> BlobAddLibraryReply:
        self.ensure_local(req.job_id, req.key)
        return BlobAddLibraryReply(self.add_library(req.job_id, req.key, req.name))

    def _op_libraries(self, conn: Connection, req: BlobLibrariesRequest) -> BlobLibrariesReply:
        libs = self.libraries()
        return BlobLibrariesReply(len(libs), libraries=libs)

    def close(self) -> None:
        """Stop the cleanup timer and delete the local store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # a running pass stops between blobs
        if self._timer.is_alive():
            self._timer.join()
        self.staging.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BlobServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
