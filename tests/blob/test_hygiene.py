"""Leftovers, permissions, pinning and bounded bookkeeping (issue 7 items 13, 14 and 16)."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sparksteward.agents.driver import _server_dir
from sparksteward.blob.cache import BlobCache
from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.payload import write_payload
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import FileSystemBlobStore, VoidBlobStore
from sparksteward.errors import BlobNotFoundError, InvalidIdError
from sparksteward.hashing import hash_file
from sparksteward.owner import OwnerRecord, process_start_time
from sparksteward.rendezvous import Rendezvous
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import AgentServer

from tests.helpers import wait_until
from tests.helpers.blob import BlobRig


@pytest.fixture()
def rig(tmp_path):
    r = BlobRig(tmp_path, FileSystemBlobStore(str(tmp_path / "ha"), "c1"))
    yield r
    r.close()


@pytest.fixture()
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- item 14: permissions and the rendezvous file --------------------------------------------------
def test_rendezvous_file_never_follows_a_planted_symlink_and_is_0600(tmp_path, umask0):
    rdv = Rendezvous(tmp_path)
    rdv.dir.mkdir(mode=0o755)
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.write_bytes(b"precious")
    victim2.write_bytes(b"precious too")
    os.symlink(victim, rdv.path)  # at the final name
    os.symlink(victim2, rdv.dir / f".executor-agent.{os.getpid()}.tmp")  # at the old staged name
    rdv.publish("127.0.0.1:1", "s" * 64, "1")
    assert victim.read_bytes() == b"precious" and victim2.read_bytes() == b"precious too"
    assert stat.S_ISREG(os.lstat(rdv.path).st_mode) and _mode(rdv.path) == 0o600
    assert _mode(rdv.dir) == 0o700, ".sparksteward/ is private even if it existed before"
    assert rdv.read(wait=0)["secret"] == "s" * 64


def test_rendezvous_refuses_a_symlinked_directory(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "root").mkdir()
    os.symlink(elsewhere, tmp_path / "root" / ".sparksteward")
    with pytest.raises(OSError, match="symlink|not a directory"):
        Rendezvous(tmp_path / "root").publish("127.0.0.1:1", "s" * 64, "1")
    assert not list(elsewhere.iterdir())


def test_cache_and_server_dirs_are_0700(tmp_path, umask0):
    cache = BlobCache(tmp_path / "r" / ".sparksteward" / "cache-1", VoidBlobStore(), None, "s")
    assert _mode(cache.dir) == 0o700
    cache.close()
    store = Path(_server_dir(str(tmp_path / "state")))
    assert _mode(store) == 0o700 and _mode(store.parent) == 0o700


# --- item 14: sweeping dead owners' dirs -----------------------------------------------------------
def _owned(parent: Path, name: str, owner: OwnerRecord | None) -> Path:
    d = parent / name
    (d / "job").mkdir(parents=True)
    (d / "job" / "blob").write_bytes(b"x")
    if owner is not None:
        owner.write(d)
    return d


def test_driver_startup_sweep_deletes_only_stores_proven_dead_on_this_host(tmp_path):
    root = tmp_path / "state" / "blob-local"
    root.mkdir(parents=True)
    me, host = OwnerRecord.current(), socket.gethostname()
    dead = _dead_pid()
    swept = [
        _owned(root, f"server-{dead}-a", OwnerRecord(host, me.boot_id, dead, 1.0, me.pid_ns)),
        _owned(root, f"server-{os.getpid()}-b",
               OwnerRecord(host, me.boot_id, os.getpid(), me.start_time + 1, me.pid_ns)),
        _owned(root, "server-7-c", OwnerRecord(host, "another-boot", os.getpid(), me.start_time)),
    ]
    kept = [
        _owned(root, f"server-{dead}-d", OwnerRecord("another-host", "other-boot", dead, 1.0)),
        _owned(root, f"server-{dead}-e", None),  # no owner file: not proven dead
        _owned(root, f"server-{dead}-g", OwnerRecord(host, me.boot_id, dead, 1.0, "pid:[1]")),  # other container
        _owned(root, f"server-{os.getpid()}-f", me),  # alive
    ]
    fresh = Path(_server_dir(str(tmp_path / "state")))
    assert [d.name for d in swept if d.exists()] == []
    assert [d.name for d in kept if not d.exists()] == []
    assert OwnerRecord.read(fresh).pid == os.getpid()


_NO_PROC = r"""
import os, sys
assert not os.path.exists("/proc/self"), "this child should see no /proc"
from sparksteward.agents.driver import _server_dir
print(_server_dir(sys.argv[1]))
"""


def test_startup_sweep_without_proc_keeps_live_stores(tmp_path):
    """As on macOS: no /proc at all. A live owner's store stays; a dead one (kill semantics) goes."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs none /proc"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot hide /proc in a mount namespace here: {probe.stderr.decode().strip()}")
    root = tmp_path / "state" / "blob-local"
    root.mkdir(parents=True)
    me, dead = OwnerRecord.current(), _dead_pid()
    # as recorded where there is no /proc: no boot id, no pid namespace, no start time
    live = _owned(root, f"server-{os.getpid()}-live", OwnerRecord(me.hostname, "", os.getpid(), None))
    gone = _owned(root, f"server-{dead}-gone", OwnerRecord(me.hostname, "", dead, 1.0))
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs none /proc && exec "$0" -c "$1" "$2"', sys.executable, _NO_PROC,
                          str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert live.exists(), "a live agent's store was deleted because /proc/<pid> is missing"
    assert not gone.exists()


def test_owner_liveness_uses_kill_semantics_not_proc(tmp_path):
    me = OwnerRecord.current()
    assert me.start_time == process_start_time(os.getpid()) and not me.is_dead()
    assert OwnerRecord(me.hostname, me.boot_id, _dead_pid(), None, me.pid_ns).is_dead()
    assert not OwnerRecord(me.hostname, me.boot_id, os.getpid(), None, me.pid_ns).is_dead(), \
        "unknown start time: alive"
    assert not OwnerRecord(me.hostname, me.boot_id, _dead_pid(), None, "pid:[1]").is_dead(), \
        "another pid namespace: not ours to judge"


def test_killed_executor_agents_cache_is_swept_by_the_next_agent(tmp_path):
    conf = {"spark.steward.state-dir": str(tmp_path / "state")}
    root = tmp_path / "userFiles"
    first = AgentProcess("executor", conf, rendezvous_dir=str(root))
    assert first.ready, first.first
    old_cache = root / ".sparksteward" / f"cache-{first.proc.pid}"
    assert old_cache.is_dir() and OwnerRecord.read(old_cache).pid == first.proc.pid
    (old_cache / "job").mkdir()
    (old_cache / "job" / ("t-" + "0" * 32)).write_bytes(b"x")
    foreign = _owned(root / ".sparksteward", "cache-999999", OwnerRecord("another-host", "b", 999999, None))
    first.kill()
    first.proc.stdout.close()
    with AgentProcess("executor", conf, rendezvous_dir=str(root)) as second:
        assert second.ready, second.first
        assert not old_cache.exists(), "the killed agent's cache dir was swept"
        assert foreign.exists(), "another host's cache dir is never touched"
        assert (root / ".sparksteward" / f"cache-{second.proc.pid}").is_dir()


# --- item 13: eviction -----------------------------------------------------------------------------
def test_eviction_never_deletes_a_library_workers_imported(rig):
    lib = rig.client.put_bytes(b"# a library\nX = 1\n" * 5000, "job-l", permanent=True)
    rig.server.add_library("job-l", lib, "mylib.zip")
    cache = rig.cache(max_size=100_000)
    [path] = cache.library_paths(rig.server.libraries())
    for i in range(5):
        cache.open("job-l", rig.client.put_bytes(bytes([i]) * 60_000, "job-l"))
    assert Path(path).exists() and hash_file(path) == lib.digest, "the imported library was evicted"


def test_concurrent_open_and_eviction_under_a_tight_limit(rig):
    keys = [rig.client.put_bytes(os.urandom(20_000 + i), "job-x") for i in range(12)]
    cache = rig.cache(max_size=50_000)
    errors: list[str] = []
    tids = iter(range(10**6))
    tid_lock = threading.Lock()

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(400):
            with tid_lock:
                tid = next(tids)
            key = rnd.choice(keys)
            try:
                path = cache.open("job-x", key, task_attempt_id=tid)
                if not path.exists() or hash_file(path) != key.digest:
                    errors.append(f"open returned {path}, which is gone or wrong")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                cache.release_task(tid)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors[:5]
    assert cache.stats["evictions"] > 0


# --- item 16 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../evil.py", "a/b.whl", "..", "x" * 300 + ".zip", "lib.so", ".hidden.py"])
def test_server_refuses_bad_library_names(rig, name):
    key = rig.client.put_bytes(b"X = 1\n", "job-n", permanent=True)
    with pytest.raises(InvalidIdError, match="library name"):
        rig._conn.request("blob.add_library", job_id="job-n", key=str(key), name=name)
    assert rig.server.libraries() == []


def test_per_key_lock_maps_shrink(rig):
    cache = BlobCache(rig.tmp / "c", VoidBlobStore(), None, "s", fetch_retries=0)
    for i in range(10_000):
        key = BlobKey(BlobType.TRANSIENT, i.to_bytes(16, "big"))
        with pytest.raises(BlobNotFoundError):
            rig.server.ensure_local("job-z", key)
        with pytest.raises(BlobNotFoundError):
            cache.open("job-z", key)
    assert len(rig.server._key_locks) == 0 and len(cache._key_locks) == 0


class SlowHA(FileSystemBlobStore):
    def delete(self, job_id, key):
        time.sleep(0.3)
        super().delete(job_id, key)


def test_close_joins_the_cleanup_thread_even_mid_pass(tmp_path):
    server = BlobServer(tmp_path / "s", SlowHA(str(tmp_path / "ha"), "c"), retention=0.05, timer=True)
    keys = [server.put_file(_file(tmp_path, i), "job-t", BlobType.TRANSIENT)[0] for i in range(30)]
    for k in keys:
        server.acquire("job-t", k)
        server.release("job-t", k)
    wait_until(lambda: len(list((server.dir / "job-t").glob("t-*"))) < 30, timeout=20, what="a pass in progress")
    server.close()
    assert not [t for t in threading.enumerate() if t.name == "steward-blob-cleanup"]


def _file(tmp_path: Path, i: int) -> Path:
    p = tmp_path / f"src-{i}"
    p.write_bytes(os.urandom(100) + bytes([i]))
    return p


_WORKER = r"""
import gc, os, sys
import numpy as np
from sparksteward.blob import broadcast
from sparksteward.worker import executor_connection
root, job, keys = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
executor_connection(root)
paths = []
for key in keys:
    v = broadcast._worker_value(key, job)
    assert float(v.sum()) >= 0
    paths.append(executor_connection().request("blob.open", key=key, job_id=job)["path"])
    del v
gc.collect()
print("READY", flush=True)
sys.stdin.readline()  # the test evicts the first files from the cache now
gc.collect()
maps = open("/proc/self/maps").read()
print("MAPPED", ",".join(p for p in paths if p in maps), flush=True)
"""


def test_worker_unmaps_old_broadcasts_so_evicted_files_free_their_blocks(rig):
    np = pytest.importorskip("numpy")
    keys = []
    for i in range(broadcast_limit() + 3):
        fd, staged = rig.client.staging_file()
        with os.fdopen(fd, "wb") as f:
            write_payload(np.full(100_000, i, dtype=np.float64), f)
        keys.append(rig.client.put_path(staged, "job-w"))
    cache = rig.cache(max_size=1 << 30)
    sock = AgentServer("127.0.0.1", 0, rig.secret, {})
    cache.register_handlers(sock)
    root = rig.tmp / "worker-root"
    Rendezvous(root).publish(sock.endpoint, rig.secret, "1")
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root), "job-w", ",".join(map(str, keys))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        first = [str(cache.path("job-w", k)) for k in keys[:3]]
        cache.max_size = 0
        cache._evict()  # nothing is referenced by a task: everything goes
        assert not any(os.path.exists(p) for p in first)
        proc.stdin.write("\n")
        proc.stdin.flush()
        mapped = proc.stdout.readline().strip().removeprefix("MAPPED ").split(",")
        assert not set(first) & set(mapped), f"the worker still maps evicted files: {mapped}"
    finally:
        proc.kill()
        proc.wait()
        sock.close()
        cache.close()


def broadcast_limit() -> int:
    from sparksteward.blob import broadcast

    return getattr(broadcast, "MAX_LOADED", 8)


def test_driver_agent_close_joins_its_recovery_thread(tmp_path, monkeypatch):
    """Recovery against an unreachable HA store takes a while; close() waits for it, never abandons it."""
    from sparksteward.agents.driver import DriverAgent
    from sparksteward.testing.s3 import _free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    hello = {"v": 1, "type": "hello", "role": "driver", "executor_id": "driver", "host": "127.0.0.1",
             "bind_host": "127.0.0.1", "port": 0, "driver_endpoint": None, "rendezvous_dir": None,
             "secret": "s" * 64, "conf": {"spark.steward.state-dir": str(tmp_path / "state"),
                                          "spark.steward.blob.ha.storage-path": "s3://nowhere/ha"}}
    agent = DriverAgent(hello)
    assert [t for t in threading.enumerate() if t.name == "steward-recovery"], "recovery is still trying"
    agent.close()
    assert not [t for t in threading.enumerate() if t.name == "steward-recovery"]
