"""Recovery and live runs (issue 7 item 3): recovery never touches a job whose lease a live run holds,
but does not lose it either: it waits for the lease, then finishes whatever entry is stored. A begin
that is refused (the job already has a result) never holds the lease, so a recovery running at the
same moment is not fooled into skipping the job. Real files, real flocks (a second store instance
is a second open file description, as another process would be).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sparksteward.errors import JobAlreadyCompleted
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult, JobStatus, StepState
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService


def _dirty(store, target: Path, run_id: str = "r1") -> None:
    target.mkdir()
    store.create_dirty(JobResult(job_id="j", cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED,
                                 start_time=1.0, end_time=2.0, cleanup=(StepState("delete_path", str(target)),),
                                 run_id=run_id))


def test_recovery_waits_for_a_live_runs_lease_then_finishes_the_job(tmp_path):
    url = str(tmp_path / "jrs")
    store = FileSystemJobResultStore(url)
    target = tmp_path / "out"
    _dirty(store, target)
    lease = FileSystemJobResultStore(url).lease("j", "r1")  # a live run elsewhere
    with JobService(store, policy=RetryPolicy.fixed(0.05)) as svc:
        assert svc.recover() == ["j"]
        assert not svc.wait_idle(0.5), "recovery must wait while the lease is held"
        assert target.exists() and store.get("j").dirty
        lease.release()  # the live run died (or ended) without finishing it
        assert svc.wait_idle(10)
    assert store.get("j").clean and not target.exists()


def test_a_cli_recovery_skips_leased_jobs(tmp_path):
    url = str(tmp_path / "jrs")
    store = FileSystemJobResultStore(url)
    _dirty(store, tmp_path / "out")
    with FileSystemJobResultStore(url).lease("j", "r1"), JobService(store, policy=RetryPolicy.fixed(0.05)) as svc:
        assert svc.recover(defer_leased=False) == []
        assert svc.wait_idle(1)
    assert store.get("j").dirty


class _Observed(FileSystemJobResultStore):
    """Records, at each ``get``, whether the job's lease is held at that moment."""

    seen: list[bool]

    def get(self, job_id):  # noqa: ANN001, ANN201
        self.seen.append(self.is_leased(job_id))
        return super().get(job_id)


@pytest.mark.parametrize("clean", [False, True])
def test_a_refused_begin_never_holds_the_lease(tmp_path, clean):
    store = _Observed(str(tmp_path / "jrs"))
    store.seen = []
    _dirty(store, tmp_path / "out")
    if clean:
        store.mark_clean("j", "r1")
    with JobService(store, policy=RetryPolicy.fixed(0.05)) as svc, pytest.raises(JobAlreadyCompleted):
        svc.begin("j")
    assert store.seen and not any(store.seen), store.seen
    assert not store.is_leased("j")


def test_close_does_not_wait_for_a_recovery_deferred_on_another_processs_lease(tmp_path):
    import time

    url = str(tmp_path / "jrs")
    store = FileSystemJobResultStore(url)
    _dirty(store, tmp_path / "out")
    with FileSystemJobResultStore(url).lease("j", "r1"):
        svc = JobService(store, policy=RetryPolicy.fixed(0.05), shutdown_timeout=30)
        assert svc.recover() == ["j"]
        started = time.monotonic()
        svc.close()
        assert time.monotonic() - started < 10
    assert store.get("j").dirty  # left for the run that holds it, or the next driver
