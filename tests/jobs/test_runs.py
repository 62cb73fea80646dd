"""Run identities in the JobResultStore (issue 7 item 3): compare-and-swap on the run id, commits that
never replace a clean file, stale dirty files pruned, and leases. Runs on memory, file:// and s3://
(moto), reusing the contract suite's fixtures.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import replace

import pytest
from sparksteward.errors import JobStoreError, RunConflictError
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import StepState

from tests.helpers.jobs import names, needs_files, result


def run(job_id: str = "job-1", run_id: str = "r1", **kw):
    return replace(result(job_id, **kw), run_id=run_id)


def test_updates_and_commits_of_another_run_are_refused(store):
    store.create_dirty(run(run_id="new"))
    late = run(run_id="old").with_cleanup([StepState("delete_path", "/tmp/x0", state="done", attempts=1)])
    with pytest.raises(RunConflictError, match="'old'.*'new'"):
        store.update_dirty(late)
    with pytest.raises(RunConflictError):
        store.mark_clean("job-1", "old")
    assert store.get("job-1").dirty and store.get("job-1").result.run_id == "new"
    store.update_dirty(run(run_id="new").with_cleanup(late.cleanup))
    committed = store.mark_clean("job-1", "new")
    assert committed.clean and committed.result.run_id == "new" and committed.result.steps_done == 1
    with pytest.raises(RunConflictError):  # a late commit of the older run finds the newer clean entry
        store.mark_clean("job-1", "old")
    assert store.mark_clean("job-1", "new").result.run_id == "new"  # idempotent for its own run


def test_a_commit_never_replaces_a_clean_file_and_prune_removes_stale_dirty_ones(stores, store):
    needs_files(stores)
    store.create_dirty(run(run_id="a"))
    store.mark_clean("job-1", "a")
    # a leftover dirty copy of the same run next to the clean file (an interrupted commit)
    store.base.write_atomic(store.base.path("job-1_DIRTY.json"), run(run_id="a", end=3000.0).to_json())
    assert store.list().stale == ("job-1",)
    assert store.mark_clean("job-1", "a").result.end_time == 2000.0  # the clean one stays
    assert names(store) == ["job-1.json"]
    store.base.write_atomic(store.base.path("job-1_DIRTY.json"), run(run_id="a", end=3000.0).to_json())
    assert store.prune(10**9, 0.0) == [] and names(store) == ["job-1.json"]  # stale dirty pruned, clean kept


def _try_lease(url: str, queue) -> None:
    try:
        FileSystemJobResultStore(url).lease("job-1", "other")
        queue.put("acquired")
    except JobStoreError as exc:
        queue.put(f"refused: {exc}")


def test_a_live_run_holds_its_lease_across_processes(stores, store):
    lease = store.lease("job-1", "r1")
    if stores.kind == "s3":  # object stores have no leases (the compare-and-swap still holds)
        assert not store.is_leased("job-1")
        return
    assert store.is_leased("job-1") and not store.is_leased("job-2")
    with pytest.raises(JobStoreError, match="running"):
        store.lease("job-1", "r2")
    if stores.kind == "file":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_try_lease, args=(stores.url, queue))
        proc.start()
        assert queue.get(timeout=60).startswith("refused")
        proc.join(60)
    lease.release()
    lease.release()  # idempotent
    assert not store.is_leased("job-1")
    store.lease("job-1", "r2").release()


def test_the_runner_of_a_superseded_run_stops_without_writing(store, caplog, tmp_path):
    from sparksteward.jobs.cleanup import CleanupOutcome, CleanupRunner
    from sparksteward.jobs.retry import RetryPolicy
    from sparksteward.testing.clock import FakeClock

    target = tmp_path / "old-out"
    target.mkdir()
    old = replace(run(run_id="old"), cleanup=(StepState("delete_path", str(target)),))
    store.create_dirty(old)
    task = CleanupRunner.task(store.get("job-1"))
    store.delete("job-1")  # a forced re-run replaced it...
    store.create_dirty(run(run_id="new"))  # ...and stored its own result
    runner = CleanupRunner(store, policy=RetryPolicy.fixed(1.0, attempts=3), clock=FakeClock())
    assert runner.run(task) is CleanupOutcome.SUPERSEDED
    assert "superseded by run 'new'" in caplog.text or "superseded by run new" in caplog.text
    entry = store.get("job-1")
    assert entry.dirty and entry.result.run_id == "new" and entry.result == run(run_id="new")
    assert not target.exists()  # its step ran (idempotent), but nothing of it was written
