"""Cleanup retried with backoff on real targets that fail and then recover; the JobService lifecycle.

Targets are made unavailable for real: a local directory is made undeletable (``chattr +i`` as root,
read-only permissions otherwise), and moto's S3 server is stopped and restarted on the same port.
Backoff runs on a FakeClock, whose ``sleeps`` show the sequence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sparksteward.config import StewardConfig
from sparksteward.errors import InvalidRecordError, JobAlreadyCompleted, JobStoreError
from sparksteward.jobs.cleanup import CleanupOutcome, CleanupRunner
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.pathguard import delete_path
from sparksteward.jobs.result import JobResult, JobStatus, StepState
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import BlobJobDirCleanup, CleanupStep, StepRegistry
from sparksteward.jobs.store import InMemoryJobResultStore
from sparksteward.testing.clock import FakeClock
from sparksteward.testing.s3 import local_s3

from tests.helpers import wait_until


@pytest.fixture(scope="module")
def s3():
    """A server of this module's own, not the session's: two tests stop and restart the endpoint (every bucket on it would be unreachable meanwhile)."""
    with local_s3() as server:
        yield server


@pytest.fixture(autouse=True)
def _fast_s3_failures(monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a stopped endpoint fails at once instead of after retries


class ObservingClock(FakeClock):
    """A FakeClock that calls ``on_sleep(n)`` after its n-th sleep (1-based)."""

    def __init__(self, on_sleep: Callable[[int], object] = lambda n: None) -> None:
        super().__init__()
        self.on_sleep = on_sleep

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.on_sleep(len(self.sleeps))


@contextlib.contextmanager
def undeletable(path: Path) -> Iterator[Callable[[], None]]:
    """Make ``path`` (a directory) impossible to delete; yields a function that restores it."""
    root = os.geteuid() == 0
    if root and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    if not root:
        os.chmod(path, 0o555)

    def restore() -> None:
        if path.exists():
            if root:
                subprocess.run(["chattr", "-i", str(path)], check=True)
            else:
                os.chmod(path, 0o755)

    try:
        yield restore
    finally:
        restore()


def make_target(root: Path, name: str = "target") -> Path:
    target = root / name
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "part-0").write_text("x")
    return target


def dirty_result(job_id: str, *targets: str, kind: str = "delete_path") -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id="app", status=JobStatus.SUCCEEDED,
                     start_time=1.0, end_time=2.0, cleanup=tuple(StepState(kind, t) for t in targets))


def service(tmp_path: Path, clock=None, **kw) -> JobService:
    kw.setdefault("registry", StepRegistry())
    return JobService(FileSystemJobResultStore(str(tmp_path / "jrs")), clock=clock or FakeClock(), **kw)


# --- a target that fails twice, then recovers ---------------------------------------------------
def test_file_target_fails_twice_then_commits(tmp_path):
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    target = make_target(tmp_path)
    seen: dict[int, StepState] = {}

    def on_sleep(n: int) -> None:
        seen[n] = store.get("job-r").result.cleanup[0]  # what a later driver would resume from
        if n == 2:
            restore()

    clock = ObservingClock(on_sleep)
    t0 = clock.now()
    with undeletable(target) as restore:
        entry = store.create_dirty(dirty_result("job-r", str(target)))
        outcome = CleanupRunner(store, StepRegistry(), RetryPolicy(), clock).run(entry)
    assert outcome is CleanupOutcome.COMMITTED
    assert clock.sleeps == [1.0, 2.0], "exponential backoff: 1 s, then 2 s"
    assert seen[1].state == "failed" and seen[1].attempts == 1 and seen[1].next_attempt_at == t0 + 1
    assert seen[2].state == "failed" and seen[2].attempts == 2 and seen[2].next_attempt_at == t0 + 3
    assert "Permission" in seen[1].last_error or "not permitted" in seen[1].last_error, seen[1].last_error
    final = store.get("job-r")
    assert final.clean and final.source.endswith("job-r.json")
    assert final.result.cleanup == (StepState("delete_path", str(target), "done", 3),)
    assert not target.exists()


def _step(svc: JobService, job_id: str) -> tuple[str, int]:
    s = svc.get(job_id).result.cleanup[0]
    return s.state, s.attempts


def test_s3_target_fails_twice_then_the_service_commits(tmp_path, s3):
    fs = s3.filesystem()
    target = s3.url("tmp", "job-s3")
    fs.pipe({f"{target}/part-{i}": b"x" for i in range(3)})
    states: list[tuple[str, int]] = []
    clock = ObservingClock(lambda n: (states.append(_step(svc, "job-s3")), n == 2 and s3.restart()))
    svc = service(tmp_path, clock)
    svc.begin("job-s3")
    svc.add_cleanup_step("job-s3", CleanupStep("delete_path", target))
    s3.stop()  # the endpoint is gone: every S3 call fails
    entry = svc.finish("job-s3", JobStatus.SUCCEEDED, wait=30)
    assert entry.clean, entry
    assert clock.sleeps == [1.0, 2.0]
    assert states == [("failed", 1), ("failed", 2)]
    assert entry.result.cleanup[0].state == "done" and entry.result.cleanup[0].attempts == 3
    assert svc.get("job-s3").clean and not fs.exists(f"{target}/part-0")
    svc.close()


def test_store_and_target_on_s3_both_down_then_restored(s3):
    fs = s3.filesystem()
    target = s3.url("tmp", "both")
    fs.pipe({f"{target}/f": b"x"})
    store = FileSystemJobResultStore(s3.url("jrs-both"))
    entry = store.create_dirty(dirty_result("both", target))
    clock = ObservingClock(lambda n: n == 2 and s3.restart())
    s3.stop()  # progress cannot be recorded either; the runner keeps it in memory
    outcome = CleanupRunner(store, StepRegistry(), RetryPolicy(), clock).run(entry)
    assert outcome is CleanupOutcome.COMMITTED and clock.sleeps == [1.0, 2.0]
    final = store.get("both")
    assert final.clean and final.result.cleanup[0].attempts == 3 and final.result.cleanup[0].state == "done"
    assert not fs.exists(f"{target}/f")


def test_backoff_is_capped_and_attempts_run_out(tmp_path):
    store = InMemoryJobResultStore()
    target = make_target(tmp_path)
    clock = FakeClock()
    with undeletable(target):
        entry = store.create_dirty(dirty_result("capped", str(target)))
        outcome = CleanupRunner(store, StepRegistry(), RetryPolicy(1.0, 4.0, attempts=6), clock).run(entry)
    assert outcome is CleanupOutcome.GAVE_UP and clock.sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    step = store.get("capped").result.cleanup[0]
    assert store.get("capped").dirty and step.attempts == 6 and step.next_attempt_at is None and step.last_error

    clock = FakeClock()
    with undeletable(target):
        outcome = CleanupRunner(store, StepRegistry(), RetryPolicy.fixed(5.0, attempts=3), clock).run(store.get("capped"))
    assert outcome is CleanupOutcome.GAVE_UP and clock.sleeps == [5.0, 5.0]
    assert store.get("capped").result.cleanup[0].attempts == 9, "attempts add up across runs"
    assert CleanupRunner(store, StepRegistry(), clock=FakeClock()).run(store.get("capped")) is CleanupOutcome.COMMITTED


def test_steps_fail_and_retry_independently(tmp_path):
    store = InMemoryJobResultStore()
    stuck, easy = make_target(tmp_path, "stuck"), make_target(tmp_path, "easy")
    clock = ObservingClock(lambda n: n == 1 and restore())
    with undeletable(stuck) as restore:
        entry = store.create_dirty(dirty_result("two", str(stuck), str(easy)))
        assert CleanupRunner(store, StepRegistry(), clock=clock).run(entry) is CleanupOutcome.COMMITTED
    steps = store.get("two").result.cleanup
    assert [(s.state, s.attempts) for s in steps] == [("done", 2), ("done", 1)]
    assert clock.sleeps == [1.0] and not stuck.exists() and not easy.exists()


def test_retry_policy():
    p = RetryPolicy()
    assert [p.delay(n) for n in range(1, 6)] == [1, 2, 4, 8, 16] and p.delay(100) == 3600 and p.delay(10**6) == 3600
    assert not p.exhausted(10**9)
    assert RetryPolicy.fixed(60).delay(7) == 60 and RetryPolicy(attempts=3).exhausted(3)
    cfg = StewardConfig.from_conf({"spark.steward.cleanup.initial-backoff": "250ms",
                                   "spark.steward.cleanup.max-backoff": "10s", "spark.steward.cleanup.max-attempts": "4"})
    assert RetryPolicy.from_config(cfg) == RetryPolicy(0.25, 10.0, 4)
    for bad in (dict(initial=0), dict(initial=2, maximum=1), dict(attempts=-1), dict(strategy="random")):
        with pytest.raises(InvalidRecordError):
            RetryPolicy(**bad)


# --- steps ------------------------------------------------------------------------------------
def test_steps_are_idempotent(tmp_path, s3):
    local, ckpt = make_target(tmp_path), make_target(tmp_path, "ckpt")
    for _ in range(3):  # present, then already gone
        delete_path(str(local))
        StepRegistry().run(CleanupStep("spark_checkpoint_dir", "file:" + str(ckpt)))  # how Spark names it
    assert not local.exists() and not ckpt.exists() and tmp_path.exists()
    fs = s3.filesystem()
    remote = s3.url("idem", "dir")
    fs.pipe({f"{remote}/a/b": b"x", f"{remote}/c": b"y", s3.url("idem", "dir-sibling"): b"keep"})
    for _ in range(2):
        delete_path(remote)
    assert not fs.exists(f"{remote}/c") and fs.exists(s3.url("idem", "dir-sibling"))

    store = InMemoryJobResultStore()
    entry = store.create_dirty(dirty_result("twice", str(tmp_path / "never-existed")))
    runner = CleanupRunner(store, StepRegistry(), clock=FakeClock())
    assert runner.run(entry) is CleanupOutcome.COMMITTED
    assert runner.run(entry) is CleanupOutcome.COMMITTED, "a second run finds it committed"


def test_default_blob_job_dir_deletes_the_ha_directory(tmp_path, s3):
    from sparksteward.blob.key import BlobKey, BlobType
    from sparksteward.blob.store import FileSystemBlobStore
    from sparksteward.hashing import hash_file

    src = tmp_path / "lib.whl"
    src.write_bytes(b"wheel" * 100)
    key = BlobKey(BlobType.PERMANENT, hash_file(src))
    for ha in (str(tmp_path / "ha"), s3.url("ha")):
        blobs = FileSystemBlobStore(ha, "default")  # the layout the blob service writes
        for job in ("my job-1", "other", None):
            blobs.put(job, key, src)
        registry = StepRegistry(ha, "default")
        for _ in range(2):
            registry.run(CleanupStep("blob_job_dir", "my job-1"))
        assert sorted(blobs.jobs(), key=str) == sorted([None, "other"], key=str)
    BlobJobDirCleanup(None)("anything")  # no HA storage: nothing to do


def test_step_records_and_the_registry(tmp_path):
    step = CleanupStep("delete_path", "s3://bkt/tmp/x")
    assert CleanupStep.from_json(step.to_json()) == step and str(step) == "delete_path s3://bkt/tmp/x"
    assert step.state() == StepState("delete_path", "s3://bkt/tmp/x")
    for kind, target in (("Delete", "/x"), ("", "/x"), ("delete_path", ""), ("delete_path", "a\nb"), (3, "/x")):
        with pytest.raises(InvalidRecordError):
            CleanupStep(kind, target)
    with pytest.raises(InvalidRecordError, match="not valid JSON"):
        CleanupStep.from_json(b"{", "request")

    registry = StepRegistry()
    touched = []
    registry.register("touch_marker", lambda target: touched.append(target))
    registry.run(CleanupStep("touch_marker", "m"))
    assert touched == ["m"] and "touch_marker" in registry.kinds()
    with pytest.raises(InvalidRecordError, match="relative"):
        registry.validate(CleanupStep("delete_path", "tmp/x"))
    for root in ("/", "file:///"):
        with pytest.raises(InvalidRecordError, match="root"):
            delete_path(root)
    with pytest.raises(InvalidRecordError, match="unknown cleanup step kind 'nope'"):
        registry.validate(CleanupStep("nope", "x"))


def test_a_step_that_can_never_run_fails_once_and_stays_dirty(tmp_path):
    store = InMemoryJobResultStore()
    done = make_target(tmp_path)
    entry = store.create_dirty(JobResult(
        job_id="odd", cluster_id="default", application_id=None, status="FAILED", start_time=1, end_time=2,
        cleanup=(StepState("not_registered_here", "x"), StepState("delete_path", str(done)))))
    clock = FakeClock()
    assert CleanupRunner(store, StepRegistry(), clock=clock).run(entry) is CleanupOutcome.GAVE_UP
    assert clock.sleeps == [], "no retries for a step that cannot succeed in this process"
    first, second = store.get("odd").result.cleanup
    assert first.state == "failed" and "unknown cleanup step kind" in first.last_error and first.next_attempt_at is None
    assert second.state == "done" and not done.exists(), "the other steps still run"
    assert store.get("odd").dirty


# --- JobService ---------------------------------------------------------------------------------
def test_begin_finish_and_already_completed(tmp_path, caplog):
    svc = service(tmp_path)
    svc.begin("a", application_id="app-1")
    with pytest.raises(JobStoreError, match="already running"):
        svc.begin("a")
    svc.record_spark_job_start("a", 7)
    svc.record_spark_job_start("a", 8)
    svc.record_spark_job_end("a", 7, "succeeded")
    svc.record_spark_job_end("a", 8, "failed", "stage 3 failed")
    svc.record_spark_job_end("not-running", 9, "failed")  # late events for unknown jobs are ignored
    entry = svc.finish("a", "SUCCEEDED", payload=[1, 2])
    assert entry.clean and entry.result.application_id == "app-1" and entry.payload == [1, 2]
    assert [(j.spark_job_id, j.outcome, j.reason) for j in entry.result.spark_jobs] == [
        (7, "succeeded", None), (8, "failed", "stage 3 failed")]
    with pytest.raises(JobStoreError, match="not running"):
        svc.finish("a", "SUCCEEDED")

    with pytest.raises(JobAlreadyCompleted) as info:
        svc.begin("a")
    message = str(info.value)
    assert "'a'" in message and "SUCCEEDED" in message and "clean" in message and "st.job('a', force=True)" in message
    assert info.value.entry.payload == [1, 2] and not svc.is_running("a")
    with pytest.raises(JobAlreadyCompleted, match=r"spark\.steward\.job\.force-rerun=true"):
        svc.begin("a", kind="application")

    with caplog.at_level(logging.WARNING, logger="sparksteward.jobs.service"):
        svc.begin("a", force=True)
    assert "forced re-run" in caplog.text
    entry = svc.finish("a", JobStatus.FAILED, failure={"type": "ValueError", "message": "bad", "where": "x.py:1"})
    assert entry.status is JobStatus.FAILED and entry.result.failure.where == "x.py:1"
    with pytest.raises(JobStoreError, match="kind"):
        svc.begin("b", kind="batch")
    svc.close()


def test_force_carries_over_unfinished_cleanup(tmp_path):
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    leftover = make_target(tmp_path, "leftover")
    store.create_dirty(dirty_result("again", str(leftover)))  # a previous run's cleanup never finished
    with JobService(store, registry=StepRegistry(), clock=FakeClock()) as svc:
        with pytest.raises(JobAlreadyCompleted, match="has not finished"):
            svc.begin("again")
        svc.begin("again", force=True)
        entry = svc.finish("again", "SUCCEEDED", wait=10)
    assert entry.clean and [s.target for s in entry.result.cleanup] == [str(leftover)] and not leftover.exists()


def test_a_bad_finish_keeps_the_job_running(tmp_path):
    with service(tmp_path) as svc:
        svc.begin("p")
        with pytest.raises(InvalidRecordError, match="JSON value"):
            svc.finish("p", "SUCCEEDED", payload={"when": object()})
        with pytest.raises(InvalidRecordError):
            svc.finish("p", "DONE")
        with pytest.raises(InvalidRecordError, match="relative"):
            svc.add_cleanup_step("p", CleanupStep("delete_path", "relative/dir"))
        assert svc.is_running("p") and svc.get("p") is None
        assert svc.finish("p", "SUCCEEDED", payload={"when": "now"}).clean


def _blocking_registry() -> tuple[StepRegistry, threading.Event, threading.Event]:
    gate, entered = threading.Event(), threading.Event()

    def block(target: str) -> None:
        entered.set()
        if not gate.wait(20):
            raise TimeoutError("the test never opened the gate")

    registry = StepRegistry()
    registry.register("block", block)
    return registry, gate, entered


def test_the_result_is_readable_while_dirty(tmp_path):
    registry, gate, entered = _blocking_registry()
    with service(tmp_path, registry=registry) as svc:
        svc.begin("slow")
        svc.add_cleanup_step("slow", CleanupStep("block", "x"))
        entry = svc.finish("slow", "SUCCEEDED", payload={"n": 1}, wait=0)
        assert entry.dirty and entry.payload == {"n": 1}
        assert entered.wait(10)
        stored = FileSystemJobResultStore(str(tmp_path / "jrs")).get("slow")  # another reader, e.g. the CLI
        assert stored.dirty and stored.payload == {"n": 1} and stored.result.cleanup[0].state == "pending"
        gate.set()
        wait_until(lambda: svc.get("slow").clean, what="the commit")
        assert svc.wait_idle(5)


def test_close_waits_at_most_its_timeout_and_leaves_the_entry_dirty(tmp_path):
    registry, gate, entered = _blocking_registry()
    svc = service(tmp_path, registry=registry)
    try:
        svc.begin("stuck")
        svc.add_cleanup_step("stuck", CleanupStep("block", "x"))
        svc.finish("stuck", "SUCCEEDED", wait=0)
        assert entered.wait(10)
        t = time.monotonic()
        svc.close(timeout=0.3)
        elapsed = time.monotonic() - t
        assert 0.3 <= elapsed < 3.5, elapsed
        assert svc.get("stuck").dirty
        svc.close(timeout=0.3)  # idempotent
        with pytest.raises(JobStoreError, match="closed"):
            svc.begin("later")
    finally:
        gate.set()
    wait_until(lambda: not any(t.is_alive() for t in svc.scheduler._threads), what="the stopped threads to exit")
    wait_until(lambda: svc.get("stuck").result.cleanup[0].done, what="the finished step to be recorded")
    assert svc.get("stuck").dirty, "a stopped service does not commit"


def test_recover_finishes_what_a_previous_driver_left(tmp_path):
    target = make_target(tmp_path)
    with undeletable(target):
        first = service(tmp_path)
        first.begin("left")
        first.add_cleanup_step("left", CleanupStep("delete_path", str(target)))
        first.begin("done")
        assert first.finish("done", "SUCCEEDED").clean
        entry = first.finish("left", "CANCELLED", wait=0)
        assert entry.dirty
        wait_until(lambda: first.get("left").result.cleanup[0].attempts >= 2, what="a few failed attempts")
        first.close(timeout=0.1)
    attempts_before = first.get("left").result.cleanup[0].attempts
    assert first.get("left").dirty and target.exists()

    # a commit interrupted mid-rename on an object store: a clean file and a stale dirty copy
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    store.base.write_atomic(store.base.path("done_DIRTY.json"), store.get("done").result.to_json())

    second = service(tmp_path)
    with pytest.raises(JobAlreadyCompleted, match="CANCELLED, dirty"):
        second.begin("left")  # the job itself never runs again
    assert second.recover() == ["left"]
    assert second.wait_idle(10)
    final = second.get("left")
    assert final.clean and not target.exists()
    assert final.result.cleanup[0].attempts == attempts_before + 1
    assert store.list().stale == () and store.get("done").clean
    assert second.recover() == []
    second.close()


def test_recover_with_delete_on_commit(tmp_path):
    store = FileSystemJobResultStore(str(tmp_path / "jrs"), delete_on_commit=True)
    targets = [make_target(tmp_path, f"t{i}") for i in range(3)]
    for i, t in enumerate(targets):
        store.create_dirty(dirty_result(f"job-{i}", str(t)))
    with JobService(store, registry=StepRegistry(), clock=FakeClock()) as svc:
        assert sorted(svc.recover()) == ["job-0", "job-1", "job-2"]
        assert svc.wait_idle(10)
    assert store.list().entries == () and not any(t.exists() for t in targets)


def test_many_jobs_clean_up_in_parallel(tmp_path):
    targets = [make_target(tmp_path, f"t{i}") for i in range(40)]
    with service(tmp_path, workers=4) as svc:
        for i, t in enumerate(targets):
            svc.begin(f"job-{i}")
            svc.add_cleanup_step(f"job-{i}", CleanupStep("delete_path", str(t)))
            svc.finish(f"job-{i}", "SUCCEEDED", wait=0)
        assert svc.wait_idle(30)
        entries = svc.list().entries
    assert len(entries) == 40 and all(e.clean for e in entries) and not any(t.exists() for t in targets)


def test_prune_uses_the_retention(tmp_path):
    clock = FakeClock()
    with service(tmp_path, clock, retention=86400.0) as svc:
        svc.begin("old")
        svc.finish("old", "SUCCEEDED")
        clock.advance(2 * 86400)
        svc.begin("new")
        svc.finish("new", "SUCCEEDED")
        assert svc.prune() == ["old"]
        assert svc.get("old") is None and svc.get("new") is not None
        assert svc.prune(clock.now() + 2 * 86400) == ["new"]
    with service(tmp_path, clock, retention=0.0) as keep:
        keep.begin("kept")
        keep.finish("kept", "SUCCEEDED")
        clock.advance(10**9)
        assert keep.prune() == [], "a retention of 0 keeps results forever"


def test_from_config(tmp_path):
    cfg = StewardConfig.from_conf({"spark.steward.jrs.storage-path": "memory", "spark.steward.cluster-id": "c1",
                                   "spark.steward.cleanup.max-attempts": "2", "spark.steward.jrs.retention": "1d"})
    deleted = []
    with JobService.from_config(cfg, clock=FakeClock(), blob_job_dir=deleted.append) as svc:
        assert isinstance(svc.store, InMemoryJobResultStore) and svc.cluster_id == "c1" and svc.retention == 86400
        assert svc.runner.policy == RetryPolicy(1.0, 3600.0, 2)
        svc.begin("j")
        svc.add_cleanup_step("j", CleanupStep("blob_job_dir", "j"))
        assert svc.finish("j", "SUCCEEDED").clean
    assert deleted == ["j"]
    cfg = StewardConfig.from_conf({"spark.steward.state-dir": str(tmp_path), "spark.steward.jrs.delete-on-commit": "true"})
    with JobService.from_config(cfg) as svc:
        assert isinstance(svc.store, FileSystemJobResultStore) and svc.store.delete_on_commit
        assert svc.store.url.startswith(str(tmp_path / "job-results"))
        svc.begin("k")
        entry = svc.finish("k", "SUCCEEDED", wait=10)
        assert entry.clean and svc.get("k") is None
