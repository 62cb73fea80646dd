"""The BlobServer, hosted by the driver agent (FLIP-19).

Local store ``<dir>/<job>/<key>`` (a fresh directory per agent, deleted on close), plus an HA store
on any fsspec URL laid out the same way. Uploads land in the local store and, for permanent blobs,
in the HA store before they are acknowledged. Downloads are served from the local store with
``sendfile``; a missing or corrupt local copy is refilled from HA. Content addressing makes a second
upload of the same content a no-op (counted in ``stats["dedup"]``).

Ref counts live per (job, key). A blob whose count reaches 0 enters staged cleanup: the first pass
after the release marks it, the next pass deletes its local copy, so it lives between one and two
``retention`` intervals (the HA copy of a permanent blob stays until its job is final). ``delete_job``
removes a job's directory from local and HA storage whatever the counts say.

Same-host uploads (``blob.put_path``) never cross a socket: the client writes into ``incoming/`` and
the server hard-links (or renames) the file into place. Paths outside ``incoming/`` are refused.
Same-host downloads (a caller with this kernel's boot id) get the file's path instead of a stream and
copy it in-kernel into their own, independently verified file; if that path is not visible to them
(another mount namespace) they ask again for a stream.

Thread-safety: one lock guards the bookkeeping; a lock per key serializes placing and refilling a blob.
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

from sparksteward.blob.key import BlobKey, BlobType, Hasher, hash_file
from sparksteward.blob.store import job_dir_name
from sparksteward.errors import BlobNotFoundError, ChecksumMismatchError, InvalidIdError, MessageTooLargeError
from sparksteward.ids import validate_job_id
from sparksteward.clock import SystemClock
from sparksteward.wire import AgentServer, Connection, Fields

__all__ = ["BlobServer"]

log = logging.getLogger("sparksteward.blob.server")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


#: Identifies this machine's running kernel: equal boot ids mean the same host.
BOOT_ID = _boot_id()

Ref = tuple["str | None", BlobKey]


def _key(f: Fields) -> BlobKey:
    return BlobKey.parse(f.text("key", max_len=64))


def _btype(f: Fields) -> BlobType:
    return BlobType(f.text("type", default="t", choices=("p", "t")))


def _job(value: object) -> str | None:
    return None if value is None else validate_job_id(value)


class BlobServer:
    """See the module docstring. A context manager; ``close`` is idempotent."""

    def __init__(self, local_dir: str | Path, ha: Any, *, retention: float = 1800.0, max_size: int = 16 << 30,
                 clock: Any = None, timer: bool = True) -> None:
        self.dir = Path(local_dir)
        self.incoming = self.dir / "@incoming"
        self.incoming.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.ha = ha
        self.retention = retention
        self.max_size = max_size
        self.clock = clock or SystemClock()
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._key_locks: dict[Ref, threading.Lock] = collections.defaultdict(threading.Lock)
        self._refs: collections.Counter[Ref] = collections.Counter()
        self._verified: set[Ref] = set()
        self._marked: set[Ref] = set()     # released, deleted at the next pass
        self._released: set[Ref] = set()  # released since the last pass
        self._libraries: list[dict[str, Any]] = []
        self._next_pass = self.clock.now() + retention
        self._stop = threading.Event()
        self._closed = False
        self._timer = threading.Thread(target=self._run_timer, name="steward-blob-cleanup", daemon=True)
        if timer:
            self._timer.start()

    # --- storage -----------------------------------------------------------------------------
    def local_path(self, job_id: str | None, key: BlobKey) -> Path:
        return self.dir / job_dir_name(job_id) / str(key)

    def put_file(self, src: Path, job_id: str | None, btype: BlobType, *, move: bool = False,
                 digest: bytes | None = None) -> tuple[BlobKey, int]:
        """Store the file ``src`` as a blob; with ``move`` the server takes ownership of ``src``."""
        job_id = _job(job_id)
        size = src.stat().st_size
        if size > self.max_size:
            raise MessageTooLargeError(f"blob of {size} bytes exceeds spark.steward.blob.max-size ({self.max_size})")
        key = BlobKey(btype, digest or hash_file(src))
        dest = self.local_path(job_id, key)
        with self._key_locks[(job_id, key)]:
            if dest.exists():
                self.stats["dedup"] += 1
                if move:
                    src.unlink(missing_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
                try:
                    if move:
                        os.replace(src, tmp) if src.stat().st_dev == dest.parent.stat().st_dev else shutil.move(src, tmp)
                    else:
                        try:
                            os.link(src, tmp)
                        except OSError:
                            shutil.copyfile(src, tmp)
                    os.replace(tmp, dest)
                finally:
                    tmp.unlink(missing_ok=True)
                self.stats["uploads"] += 1
            self._verified.add((job_id, key))
            if key.permanent and not self.ha.exists(job_id, key):
                try:
                    self.ha.put(job_id, key, dest)
                    self.stats["ha_uploads"] += 1
                except Exception:
                    dest.unlink(missing_ok=True)  # acknowledged only when both copies are durable
                    raise
        return key, size

    def receive(self, conn: Connection, job_id: str | None, btype: BlobType, size: int) -> tuple[BlobKey, int]:
        """Receive ``size`` raw bytes from ``conn`` into the store; a truncated upload leaves nothing."""
        if not isinstance(size, int) or size < 0 or size > self.max_size:
            raise MessageTooLargeError(f"announced blob size {size!r} is not between 0 and "
                                       f"spark.steward.blob.max-size ({self.max_size})")
        tmp = self.incoming / f"upload-{uuid.uuid4().hex}"
        h = Hasher()
        try:
            with open(tmp, "wb") as f:
                conn.recv_into_file(f, size, h.update)
            return self.put_file(tmp, job_id, btype, move=True, digest=h.digest())
        finally:
            tmp.unlink(missing_ok=True)

    def ensure_local(self, job_id: str | None, key: BlobKey) -> Path:
        """The verified local copy of a blob, refilled from HA if missing or corrupt."""
        job_id = _job(job_id)
        path = self.local_path(job_id, key)
        with self._key_locks[(job_id, key)]:
            if path.exists() and (job_id, key) not in self._verified:
                if hash_file(path) == key.digest:
                    self._verified.add((job_id, key))
                else:
                    log.warning("local copy of %s is corrupt; discarding it", key)
                    path.unlink()
            if not path.exists():
                if not key.permanent:
                    raise BlobNotFoundError(f"blob {key} of job {job_id!r} is not stored on this server")
                try:
                    self.ha.get(job_id, key, path)
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
        """One staged-cleanup pass: delete what the previous pass marked and is still unreferenced."""
        with self._lock:
            doomed = [r for r in self._marked if self._refs[r] == 0]
            self._marked, self._released = {r for r in self._released if self._refs[r] == 0}, set()
        for job_id, key in doomed:
            path = self.local_path(job_id, key)
            path.unlink(missing_ok=True)
            self._verified.discard((job_id, key))
            if not key.permanent:
                self.ha.delete(job_id, key)
            try:
                path.parent.rmdir()  # whole job directory, once empty
            except OSError:
                pass
        if doomed:
            log.info("staged cleanup deleted %d blob(s)", len(doomed))
        return doomed

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
        """Delete a job's blobs from local and HA storage, whatever their counts (idempotent)."""
        job_id = _job(job_id)
        with self._lock:
            for ref in [r for r in list(self._refs) + list(self._marked) + list(self._released) if r[0] == job_id]:
                self._refs.pop(ref, None)
                self._marked.discard(ref)
                self._released.discard(ref)
            self._verified = {r for r in self._verified if r[0] != job_id}
            self._libraries = [lib for lib in self._libraries if lib["job_id"] != job_id]
        shutil.rmtree(self.dir / job_dir_name(job_id), ignore_errors=True)
        self.ha.delete_job(job_id)
        log.info("deleted the blobs of job %s (local and HA)", job_id)

    def retain_jobs(self, live: set[str | None]) -> list[str | None]:
        """Put the HA blobs of every job not in ``live`` into staged cleanup (orphans)."""
        orphans = [j for j in self.ha.jobs() if j not in live]
        with self._lock:
            for job_id in orphans:
                for key, _ in self.ha.keys(job_id):
                    self._released.add((job_id, key))
        return orphans

    # --- libraries ---------------------------------------------------------------------------
    def add_library(self, job_id: str | None, key: BlobKey, name: str) -> int:
        with self._lock:
            lib = {"job_id": _job(job_id), "key": str(key), "name": os.path.basename(name)}
            if lib not in self._libraries:
                self._libraries.append(lib)
            return len(self._libraries)

    def libraries(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._libraries)

    # --- socket ------------------------------------------------------------------------------
    def register_handlers(self, server: AgentServer) -> None:
        ops = {"blob.info": self._op_info, "blob.put": self._op_put, "blob.put_path": self._op_put_path,
               "blob.get": self._op_get, "blob.acquire": self._op_acquire, "blob.release": self._op_release,
               "blob.delete_job": self._op_delete_job, "blob.list": self._op_list, "blob.stats": self._op_stats,
               "blob.add_library": self._op_add_library, "blob.libraries": self._op_libraries}
        for op, fn in ops.items():
            server.add_handler(op, fn)

    def _op_info(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        return {"incoming": str(self.incoming), "pid": os.getpid()}

    def _op_put(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        conn.expect_body()  # a refused header closes the connection: its body is never parsed as requests
        f = Fields(req)
        job_id, btype, size = f.job_id(nullable=True), _btype(f), f.integer("size", lo=0)
        key, size = self.receive(conn, job_id, btype, size)
        return {"key": str(key), "size": size}

    def _op_put_path(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        path, job_id, btype, move = f.text("path"), f.job_id(nullable=True), _btype(f), f.flag("move", default=False)
        src = Path(os.path.realpath(path))
        if src.parent != self.incoming.resolve() or not src.is_file():
            raise InvalidIdError(f"blob.put_path takes a file directly in {self.incoming} (ask blob.info), "
                                 f"not {path!r}")
        key, size = self.put_file(src, job_id, btype, move=move)
        return {"key": str(key), "size": size}

    def _op_get(self, conn: Connection, req: dict[str, Any]) -> None:
        fields = Fields(req)
        key, job_id, boot_id = _key(fields), fields.job_id(nullable=True), fields.text("boot_id", default=None)
        path = self.ensure_local(job_id, key)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if boot_id and boot_id == BOOT_ID:
                # same kernel: the caller copies the file in-kernel (copy_file_range); no socket copy
                conn.send({"ok": True, "size": size, "path": str(path)})
                self.stats["served"] += 1
                self.stats["served_local"] += 1
                return None
            conn.send({"ok": True, "size": size})
            conn.send_file(f, size)
        self.stats["served"] += 1
        self.stats["bytes_served"] += size
        return None

    def _op_acquire(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        return {"refs": self.acquire(f.job_id(nullable=True), _key(f))}

    def _op_release(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        return {"refs": self.release(f.job_id(nullable=True), _key(f))}

    def _op_delete_job(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        self.delete_job(Fields(req).job_id(nullable=True))
        return {}

    def _op_list(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        out = []
        for job_dir in sorted(p for p in self.dir.iterdir() if p.is_dir() and p != self.incoming):
            for f in sorted(job_dir.iterdir()):
                if not f.name.startswith("."):
                    out.append({"job_dir": job_dir.name, "key": f.name, "size": f.stat().st_size})
        with self._lock:
            refs = {f"{job_dir_name(j)}/{k}": n for (j, k), n in self._refs.items()}
        for b in out:
            b["refs"] = refs.get(f"{b['job_dir']}/{b['key']}", 0)
        return {"blobs": out}

    def _op_stats(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        return {"stats": dict(self.stats)}

    def _op_add_library(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        key, job_id, name = _key(f), f.job_id(nullable=True), f.text("name", max_len=255)
        self.ensure_local(job_id, key)
        return {"version": self.add_library(job_id, key, name)}

    def _op_libraries(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        libs = self.libraries()
        return {"version": len(libs), "libraries": libs}

    def close(self) -> None:
        """Stop the cleanup timer and delete the local store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._timer.is_alive():
            self._timer.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BlobServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
