"""Files in a store that are not regular files (issue 7 item 15).

A FIFO named like an entry must not hang the store (a blocking open of a FIFO waits for a writer
forever), a symlink loop or a dangling symlink must not block recovery, the listing reports each as
a per-file error, and ``quarantine`` moves each aside. Everything runs on real FIFOs and symlinks;
calls that could hang run in a thread with a deadline.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from sparksteward.errors import CorruptRecordError
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult, JobStatus
from sparksteward.jobs.service import JobService
from sparksteward.testing.clock import FakeClock

DEADLINE = 10.0

BAD = {
    "x.json": "fifo",  # a FIFO named like a committed entry
    "fifo_DIRTY.json": "fifo",
    "loop_DIRTY.json": "loop",  # a symlink to itself: ELOOP when followed
    "dangling.json": "dangling",  # a symlink to nothing
    "other_DIRTY.json": "symlink",  # a symlink to a readable, valid record elsewhere
}


def _bounded(fn, *args):
    """Run ``fn(*args)`` in a thread; fail (not hang) if it does not return within DEADLINE seconds."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)}{args} still blocked after {DEADLINE} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def _result(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED,
                     start_time=1.0, end_time=2.0, run_id="r1")


@pytest.fixture()
def store(tmp_path: Path) -> FileSystemJobResultStore:
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    store.create_dirty(_result("good"))
    d = tmp_path / "jrs" / "default"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(_result("other").to_json())
    for name, kind in BAD.items():
        path = d / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "loop":
            os.symlink(name, path)
        elif kind == "dangling":
            os.symlink(str(tmp_path / "nothing-here.json"), path)
        else:
            os.symlink(str(elsewhere), path)
    return store


def test_listing_reports_each_unreadable_file_and_never_hangs(store):
    listing = _bounded(store.list)
    assert [e.job_id for e in listing.entries] == ["good"]
    reasons = {os.path.basename(path): why for path, why in listing.corrupt}
    assert set(reasons) == set(BAD), listing.corrupt
    assert "FIFO" in reasons["x.json"] and "FIFO" in reasons["fifo_DIRTY.json"], reasons
    for name in ("loop_DIRTY.json", "dangling.json", "other_DIRTY.json"):
        assert "symbolic link" in reasons[name], reasons
    for job in ("x", "fifo", "loop", "other"):
        with pytest.raises(CorruptRecordError, match="not a regular file"):
            _bounded(store.get, job)


def test_recovery_proceeds_past_them(store):
    svc = JobService(store, clock=FakeClock())
    with svc:
        started = _bounded(svc.recover)
        assert started == ["good"]
        assert svc.wait_idle(DEADLINE)
    assert store.get("good").clean


def test_quarantine_moves_each_of_them(store, tmp_path):
    q = tmp_path / "jrs" / "default" / "quarantine"
    for name in BAD:
        moved = _bounded(store.quarantine, name)
        assert [os.path.basename(m) for m in moved] == [name]
        assert os.path.lexists(q / name) and not os.path.lexists(tmp_path / "jrs" / "default" / name)
    assert os.stat(q / "x.json", follow_symlinks=False).st_mode & 0o170000 == 0o010000  # still the FIFO
    assert os.readlink(q / "loop_DIRTY.json") == "loop_DIRTY.json"
    listing = _bounded(store.list)
    assert [e.job_id for e in listing.entries] == ["good"] and not listing.corrupt
