"""The async phase: snapshots uploaded by a thread pool, acked to the coordinator, local snapshots
removed, failures reported; the task thread does not wait for uploads."""

from __future__ import annotations

import threading

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task import transfer
from sparksteward.checkpoint.task.uploader import SnapshotUploader
from sparksteward.errors import CheckpointError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range
from sparksteward.state.snapshot import LocalSnapshot

from tests.helpers import wait_until

M, P = 16, 4


def test_uploads_run_off_the_task_thread_and_ack(tmp_path, store_url, monkeypatch):
    storage = CheckpointStorage.open(store_url, "s")
    coord = CheckpointCoordinator(storage, P, M)
    begun = coord.begin(0)
    gate = threading.Event()
    real = transfer.upload_snapshot

    def slow_upload(*a, **kw):
        gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(transfer, "upload_snapshot", slow_upload)
    acked = []
    with SnapshotUploader(threads=2) as up:
        snaps = []
        for i in range(P):
            with RocksDBStateBackend(tmp_path / f"w{i}", key_group_range(M, P, i), M) as b:
                keys = [k for k in (f"k{j}" for j in range(2000)) if key_group(k, M) in b.key_groups]
                b.value("v").put_many(keys, [1] * len(keys))
                snap = b.snapshot(tmp_path / f"snap-{i}")
            snaps.append(snap)
            up.submit(storage, 0, i, snap, begun.known,
                      on_done=lambda cid, r: (coord.ack(cid, r), acked.append(r.handle.subtask)))
        assert up.pending() == P and acked == []  # the "tasks" are done; nothing has been uploaded yet
        gate.set()
        wait_until(lambda: len(acked) == P, timeout=60, what="all acks")
    assert all(not s.path.exists() for s in snaps)  # local snapshots are removed after upload
    meta = coord.complete(0)
    assert [s.subtask for s in meta.subtasks] == list(range(P))
    with pytest.raises(CheckpointError, match="closed"):
        up.submit(storage, 1, 0, snaps[0])
    up.close()  # idempotent


def test_a_failed_upload_is_reported(tmp_path, store_url, monkeypatch):
    storage = CheckpointStorage.open(store_url, "s")
    with RocksDBStateBackend(tmp_path / "w", key_group_range(M, 1, 0), M) as b:
        b.value("v").update("k", 1)
        snap = b.snapshot(tmp_path / "snap")
    errors = []

    def broken(*a, **kw):
        raise OSError("disk gone")

    monkeypatch.setattr(transfer, "upload_snapshot", broken)
    with SnapshotUploader() as up:
        fut = up.submit(storage, 3, 0, snap, on_error=lambda cid, i, exc: errors.append((cid, i, str(exc))))
        with pytest.raises(OSError, match="disk gone"):
            fut.result(30)
    assert errors == [(3, 0, "disk gone")] and not snap.path.exists()


def test_an_upload_that_ends_before_submit_returns_does_not_hang_the_caller(tmp_path, store_url, monkeypatch):
    """An upload can end on a pool thread before ``submit`` registers its done-callback (a new pool
    thread starts and runs it while the caller waits for that thread to start); the callback then
    runs in the caller's thread, which must not be holding the uploader's lock."""
    import sys

    storage = CheckpointStorage.open(store_url, "s")

    def broken(*a, **kw):
        raise OSError("disk gone")

    monkeypatch.setattr(transfer, "upload_snapshot", broken)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # the new pool thread keeps the GIL until its upload has failed

    def submit_many() -> None:
        for i in range(50):
            (tmp_path / f"snap-{i}").mkdir()
            up = SnapshotUploader(threads=1)
            up.submit(storage, i, 0, LocalSnapshot(tmp_path / f"snap-{i}", key_group_range(M, 1, 0), 0.0))
            up.close()

    try:
        t = threading.Thread(target=submit_many, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "submit deadlocked on its own lock"
    finally:
        sys.setswitchinterval(interval)
