"""Cleanup retried with backoff on real targets that fail, then recover; JobService lifecycle."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sparksteward.errors import JobAlreadyCompleted
from sparksteward.jobs.cleanup import CleanupStep, RetryPolicy, StepRegistry
from sparksteward.jobs.result import JobStatus
from sparksteward.jobs.service import JobService
from sparksteward.jobs.store import FileSystemJobResultStore
from sparksteward.testing.clock import FakeClock


class RestoringClock(FakeClock):
    """A fake clock that runs ``restore`` once ``after`` seconds of sleep have passed."""

    def __init__(self, after: float, restore) -> None:
        super().__init__()
        self.after, self.restore, self.restored = after, restore, False

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if not self.restored and sum(self.sleeps) >= self.after:
            self.restored = True
            self.restore()


def _service(tmp_path: Path, clock, attempts: int = 0) -> JobService:
    return JobService(FileSystemJobResultStore(str(tmp_path / "jrs")), cluster_id="default",
                      registry=StepRegistry(), policy=RetryPolicy(1.0, 3600.0, attempts), clock=clock)


def _run_failing_twice(tmp_path, target_url, make_unavailable, restore):
    seen = {}

    def restore_and_record():
        seen["dirty"] = svc.store.get("job-r")  # the state a later driver would resume from
        restore()

    clock = RestoringClock(after=3.0, restore=restore_and_record)  # 1 s + 2 s of backoff
    svc = _service(tmp_path, clock)
    svc.begin("job-r")
    svc.add_cleanup_step("job-r", CleanupStep("delete_path", target_url))
    make_unavailable()
    entry = svc.finish("job-r", JobStatus.SUCCEEDED, wait=60)
    assert entry.clean, entry
    dirty = seen["dirty"]
    assert not dirty.clean and dirty.result.cleanup[0].state == "failed"
    assert dirty.result.cleanup[0].attempts == 2 and dirty.result.cleanup[0].last_error
    assert sum(clock.sleeps) == pytest.approx(3.0), "backoff 1 s then 2 s"
    assert entry.result.cleanup[0].state == "done" and entry.result.cleanup[0].attempts == 3
    svc.close()


def test_file_target_fails_twice_then_commits(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "part-0").write_text("x")
    _run_failing_twice(
        tmp_path, str(target),
        make_unavailable=lambda: subprocess.run(["chattr", "+i", str(target)], check=True),  # EPERM even for root
        restore=lambda: subprocess.run(["chattr", "-i", str(target)], check=True))
    assert not target.exists()


def test_s3_target_fails_twice_then_commits(tmp_path, monkeypatch):
    from sparksteward.testing.s3 import local_s3

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with local_s3() as s3:
        target = s3.url("tmp", "job-r")
        s3.filesystem().pipe(target + "/part-0", b"x")
        _run_failing_twice(tmp_path, target, make_unavailable=s3.stop, restore=s3.restart)
        assert not s3.filesystem().exists(target + "/part-0")


def test_steps_are_idempotent(tmp_path):
    target = tmp_path / "gone"
    reg = StepRegistry()
    reg.run("delete_path", str(target))  # already missing: success
    target.mkdir()
    reg.run("delete_path", str(target))
    reg.run("delete_path", str(target))
    assert not target.exists()


def test_begin_finish_and_duplicates(tmp_path):
    svc = _service(tmp_path, FakeClock())
    svc.begin("a")
    with pytest.raises(Exception, match="already running"):
        svc.begin("a")
    svc.record_spark_job("a", 7)
    svc.record_spark_job("a", 7, "succeeded")
    entry = svc.finish("a", "SUCCEEDED", payload=[1, 2])
    assert entry.clean and entry.result.spark_jobs[0].outcome == "succeeded"
    with pytest.raises(JobAlreadyCompleted) as info:
        svc.begin("a")
    assert info.value.entry.payload == [1, 2]
    svc.begin("a", force=True)
    assert svc.finish("a", "FAILED", failure={"type": "E", "message": "m"}).status is JobStatus.FAILED


def test_close_leaves_dirty_and_the_next_driver_recovers(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    subprocess.run(["chattr", "+i", str(target)], check=True)
    try:
        first = _service(tmp_path, FakeClock())
        first.begin("slow")
        first.add_cleanup_step("slow", CleanupStep("delete_path", str(target)))
        entry = first.finish("slow", "SUCCEEDED", wait=0)
        assert not entry.clean
        first.close(timeout=0.2)  # the shutdown timeout passes: leave it dirty
        assert not first.get("slow").clean
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    second = _service(tmp_path, FakeClock())
    assert second.recover() == ["slow"]
    assert second.wait_idle(30)
    assert second.get("slow").clean and not target.exists()
    second.close()


def test_gives_up_after_max_attempts_and_stays_dirty(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    subprocess.run(["chattr", "+i", str(target)], check=True)
    try:
        svc = _service(tmp_path, FakeClock(), attempts=3)
        svc.begin("x")
        svc.add_cleanup_step("x", CleanupStep("delete_path", str(target)))
        entry = svc.finish("x", "SUCCEEDED", wait=30)
        assert not entry.clean and entry.result.cleanup[0].attempts == 3
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


def test_prune_removes_only_old_clean_results(tmp_path):
    clock = FakeClock()
    svc = JobService(FileSystemJobResultStore(str(tmp_path / "jrs")), cluster_id="default",
                     retention=86400, clock=clock)
    svc.begin("old")
    svc.finish("old", "SUCCEEDED")
    clock.advance(2 * 86400)
    svc.begin("new")
    svc.finish("new", "SUCCEEDED")
    assert svc.prune() == ["old"]
    assert svc.get("old") is None and svc.get("new") is not None
