"""``finish()`` survives store failures (issue 7 item 10, must-show 6 for ``finish``).

A transient failure is retried under the cleanup retry policy, bounded by the shutdown timeout; a
longer outage spools the result locally, and the next JobService stores it and runs its cleanup.
The store is real: moto's S3 server, stopped and restarted (``LocalS3.stop``/``restart``). The crash
test SIGKILLs a process that keeps finishing jobs, at random points, while the store is up or down.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sparksteward.errors import JobAlreadyCompleted
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import CleanupStep
from sparksteward.storage import open_location
from sparksteward.testing.s3 import local_s3

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHILD = str(Path(__file__).parents[1] / "helpers" / "jobrace_child.py")


@pytest.fixture(scope="module")
def s3():
    """A server of this module's own, not the session's: its tests stop and restart the endpoint."""
    with local_s3() as server:
        yield server


def _store(url: str) -> FileSystemJobResultStore:
    """A store on ``url`` whose client fails fast when the endpoint is down (no botocore backoff)."""
    fast = {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}
    return FileSystemJobResultStore(url, location=open_location(url, config_kwargs=fast))


def _spooled(spool: Path) -> list[Path]:
    return sorted(p for p in spool.rglob("*.json") if not p.name.startswith("."))


def test_a_transient_store_outage_in_finish_is_retried(s3, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "sparksteward.jobs.service")
    store = _store(s3.url("transient"))
    spool = tmp_path / "spool"
    target = tmp_path / "out"
    target.mkdir()
    svc = JobService(store, policy=RetryPolicy.fixed(0.2), shutdown_timeout=60, spool_dir=str(spool))
    with svc:
        svc.begin("t")
        svc.add_cleanup_step("t", CleanupStep("delete_path", str(target)))
        s3.stop()
        try:
            out: dict[str, object] = {}
            finisher = threading.Thread(target=lambda: out.update(entry=svc.finish("t", "SUCCEEDED", payload=1,
                                                                                      wait=30)))
            finisher.start()
            wait_until(lambda: any("could not store its result" in r.message for r in caplog.records), timeout=30,
                       what="finish() to retry the failing store")
            assert finisher.is_alive(), "finish() gave up on the first failure"
        finally:
            s3.restart()
        finisher.join(60)
        assert not finisher.is_alive()
    entry = out["entry"]
    assert entry.clean and entry.source.startswith("s3://"), entry  # stored, cleaned and committed
    assert store.get("t").clean and store.get("t").result.payload == 1
    assert not target.exists()
    assert not _spooled(spool)


def test_a_permanent_outage_spools_the_result_and_the_next_service_commits_it(s3, tmp_path):
    store = _store(s3.url("permanent"))
    spool = tmp_path / "spool"
    target = tmp_path / "out"
    target.mkdir()
    svc = JobService(store, policy=RetryPolicy.fixed(0.1), shutdown_timeout=1.0, spool_dir=str(spool))
    with svc:
        svc.begin("p")
        svc.add_cleanup_step("p", CleanupStep("delete_path", str(target)))
        s3.stop()
        try:
            started = time.monotonic()
            entry = svc.finish("p", "SUCCEEDED", payload={"rows": 42}, wait=5)
            took = time.monotonic() - started
        finally:
            s3.restart()
    assert entry.dirty and entry.source.startswith(str(spool)), entry
    files = _spooled(spool)
    assert [str(p) for p in files] == [entry.source]
    spooled = JobResult.from_json(files[0].read_bytes(), str(files[0]))
    assert spooled.payload == {"rows": 42} and spooled.run_id == entry.result.run_id
    assert took < 30, f"finish() took {took:.1f} s, beyond its shutdown timeout"
    assert store.get("p") is None and target.exists()

    other = FileSystemJobResultStore(str(tmp_path / "another-store"))  # same host, cluster id and spool dir
    with JobService(other, spool_dir=str(spool)) as svc_other:
        assert svc_other.recover() == [] and other.get("p") is None  # never flushed into the wrong store
    assert _spooled(spool) == files

    nxt = JobService(store, policy=RetryPolicy.fixed(0.1), spool_dir=str(spool))
    with nxt:
        with pytest.raises(JobAlreadyCompleted, match="spooled"):  # not run again while only spooled
            nxt.begin("p")
        assert nxt.recover() == ["p"]  # written to the store first, then recovered
        assert nxt.wait_idle(30)
    committed = store.get("p")
    assert committed.clean and committed.result.payload == {"rows": 42}
    assert committed.result.run_id == entry.result.run_id
    assert not target.exists() and not _spooled(spool)


@pytest.mark.slow
def test_sigkill_during_finish_loses_no_acknowledged_result(s3, tmp_path):
    rng = random.Random(10_2026_11_22)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")])
    env["HOME"] = str(tmp_path)
    fs = s3.filesystem()
    stats = {"acked": 0, "spooled_at_kill": 0, "outage_runs": 0}
    for run in range(12):
        url = s3.url(f"crash-{run}")
        spool = tmp_path / f"spool-{run}"
        outage = run % 2 == 1
        errlog = tmp_path / f"child-{run}.log"
        # run 1 surely spools: its jobs run 1.5 s and the endpoint stops inside one, after its begin(). A stop
        # that lands in begin() instead leaves the child retrying begin() (it cannot check for an earlier
        # result) and spools nothing, which a loaded machine made likely in the random schedule.
        body = "1.5" if run == 1 else "0.1"
        with open(errlog, "w") as errf:
            proc = subprocess.Popen([sys.executable, CHILD, "finishloop", url, str(spool), "0.3", body], env=env,
                                    stdout=subprocess.PIPE, stderr=errf, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda lines=lines, proc=proc: lines.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            wait_until(lambda lines=lines, proc=proc: any(x.startswith("ACK ") for x in lines) or proc.poll() is not None,
                       timeout=60, what="the child to finish its first job")
            if run == 1:
                wait_until(lambda lines=lines: lines[-1].startswith("BEGUN "), timeout=60, interval=0.01,
                           what="the child to begin its next job")
            elif outage:
                time.sleep(rng.uniform(0.0, 0.3))  # usually lands in a job's body: its finish() meets the outage
            if outage:
                s3.stop()
                stats["outage_runs"] += 1
            time.sleep(rng.uniform(0.2, 2.5) if outage else rng.uniform(0.05, 1.0))  # retries, then the spool
            if run == 1:
                wait_until(lambda spool=spool: _spooled(spool), timeout=60, interval=0.05, what="a spooled result")
        finally:
            proc.kill()  # SIGKILL, at a random point of a begin/finish (store write, retry or spool write)
            proc.wait(30)
            reader.join(30)
            if outage:
                s3.restart()
        err = errlog.read_text()
        acked = {line.split()[1]: line.split()[2] for line in lines if line.startswith("ACK ")}
        assert acked and proc.returncode == -signal.SIGKILL, err[-3000:]  # it ran until killed, never crashed
        stats["acked"] += len(acked)
        stats["spooled_at_kill"] += len(_spooled(spool))
        for p in spool.rglob("*"):  # nothing empty or half-written under a final name
            if p.is_file() and not p.name.startswith("."):
                JobResult.from_json(p.read_bytes(), str(p))

        store = FileSystemJobResultStore(url)
        with JobService(store, policy=RetryPolicy.fixed(0.05), spool_dir=str(spool)) as nxt:
            nxt.recover()
            assert nxt.wait_idle(30)
        listing = store.list()
        assert not listing.corrupt, listing.corrupt
        stored = {e.job_id: e for e in listing.entries}
        lost = sorted(set(acked) - set(stored))
        assert not lost, f"run {run}: acknowledged results lost after the crash: {lost}"
        for job_id, entry in stored.items():
            assert entry.clean and entry.result.payload == {"i": int(job_id[1:])}, entry
        for key in fs.find(url):
            assert fs.size(key) > 0, f"an empty object under a final name: {key}"
        assert not _spooled(spool)
    print(f"\n12 SIGKILLs during finish(): {stats}")
    assert stats["acked"] > 0 and stats["spooled_at_kill"] > 0, stats


def test_a_forced_rerun_over_a_spooled_result_carries_its_cleanup_over(tmp_path):
    """No store outage needed: a spooled file as a killed driver's finish() left it."""
    from sparksteward.jobs.result import JobStatus, StepState
    from sparksteward.jobs.spool import ResultSpool

    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    target = tmp_path / "old-out"
    target.mkdir()
    spool_dir = str(tmp_path / "spool")
    ResultSpool(spool_dir, "default", store.url).put(
        JobResult(job_id="s", cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED, start_time=1.0,
                  end_time=2.0, cleanup=(StepState("delete_path", str(target)),), run_id="old"))
    with JobService(store, policy=RetryPolicy.fixed(0.05), spool_dir=spool_dir) as svc:
        with pytest.raises(JobAlreadyCompleted, match="spooled"):
            svc.begin("s")
        svc.begin("s", force=True)
        entry = svc.finish("s", "SUCCEEDED", payload="new", wait=10)
    assert entry.clean and entry.result.payload == "new" and [s.target for s in entry.result.cleanup] == [str(target)]
    assert not target.exists() and not _spooled(tmp_path / "spool")
