"""Scoped jobs, run_once and the application job, end to end on local[2]."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sparksteward import JobAlreadyCompleted, Steward
from sparksteward.jar import shim_jar
from sparksteward.jobs.result import JobStatus

from tests.helpers import spark_session, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def state(spark_state):
    return spark_state


def _target(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "part-0").write_text("x")
    return d


def _blob_dir(state: Path, job_id: str) -> Path:
    d = state / "ha" / "default" / "blob" / job_id
    d.mkdir(parents=True)
    (d / "t-0").write_text("payload")
    return d


def test_scoped_job_that_succeeds(spark, state, tmp_path):
    st = Steward.get(spark)
    target, blobs = _target(tmp_path, "tmp-ok"), _blob_dir(state, "ok-job")
    with st.job("ok-job") as job:
        job.cleanup_path(str(target))
        n = spark.range(100).count()
        job.set_result({"rows": n})
    assert job.entry.status is JobStatus.SUCCEEDED and job.entry.clean
    assert not target.exists() and not blobs.exists()
    entry = st.job_results.get("ok-job")
    assert entry.payload == {"rows": 100} and entry.result.application_id == spark.sparkContext.applicationId
    assert entry.result.spark_jobs and all(j.outcome == "succeeded" for j in entry.result.spark_jobs)
    assert {s.kind for s in entry.result.cleanup} == {"delete_path", "blob_job_dir"}


def test_scoped_job_that_fails(spark, state, tmp_path):
    st = Steward.get(spark)
    target, blobs = _target(tmp_path, "tmp-fail"), _blob_dir(state, "failing-job")

    def boom(_):
        raise RuntimeError("steward-task-boom")

    with pytest.raises(Exception, match="steward-task-boom"), st.job("failing-job") as job:
        job.cleanup_path(str(target))
        spark.sparkContext.parallelize([1], 1).map(boom).collect()
    entry = st.job_results.get("failing-job")
    assert entry.status is JobStatus.FAILED and entry.clean
    assert "steward-task-boom" in entry.result.failure.message and entry.result.failure.where
    assert any(j.outcome == "failed" for j in entry.result.spark_jobs)
    assert not target.exists() and not blobs.exists()


def test_scoped_job_that_is_cancelled(spark, tmp_path):
    st = Steward.get(spark)
    target = _target(tmp_path, "tmp-cancel")
    sc = spark.sparkContext

    def slow(x):
        import time

        time.sleep(30)
        return x

    with pytest.raises(Exception, match="(?i)cancel"), st.job("cancelled-job") as job:
        job.cleanup_path(str(target))
        threading.Timer(2.0, lambda: sc.cancelJobsWithTag(job.tag)).start()
        sc.parallelize(range(2), 2).map(slow).collect()
    entry = st.job_results.get("cancelled-job")
    assert entry.status is JobStatus.CANCELLED and entry.clean and not target.exists()


def test_a_job_with_a_result_is_never_rerun_silently(spark):
    st = Steward.get(spark)
    with st.job("once") as job:
        job.set_result(1)
    with pytest.raises(JobAlreadyCompleted) as info, st.job("once"):
        pytest.fail("the body must not run")
    assert info.value.entry.status is JobStatus.SUCCEEDED
    assert "'once'" in str(info.value) and "force=True" in str(info.value)


def test_run_once_returns_the_stored_payload_without_spark_work(spark):
    st = Steward.get(spark)
    calls = []

    def body():
        calls.append(1)
        return spark.range(42).count()

    assert st.run_once("count-42", body) == 42
    jobs_before = len(st.events("job_start"))
    assert st.run_once("count-42", body) == 42
    time.sleep(0.5)  # give any stray job event time to arrive before counting
    assert len(calls) == 1 and len(st.events("job_start")) == jobs_before


class _SlowOnJobEnd:
    """A py4j SparkListener that holds Spark's shared listener queue for ``seconds`` on each job end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def onJobEnd(self, event):  # noqa: N802 - Spark's name
        time.sleep(self.seconds)

    def __getattr__(self, name):   # every other callback of SparkListenerInterface: nothing
        return lambda *args: None

    class Java:
        implements = ["org.apache.spark.scheduler.SparkListenerInterface"]


def test_an_app_end_the_listener_bus_delivers_late_still_ends_the_app_job_clean(state):
    """SparkContext.stop posts app_end to the asynchronous listener bus and shuts the plugins down
    before it stops the bus. A listener still busy with an earlier event (here 4 s on the last job's
    end) delivered app_end after the driver agent had been told to shut down: the application's job
    never ended, no result was stored (a CI run showed it). The driver plugin now waits for app_end."""
    from pyspark.java_gateway import ensure_callback_server_started
    from sparksteward.jobs.fs_store import FileSystemJobResultStore

    with spark_session("local[1]", **{"spark.steward.state-dir": str(state)}) as spark:
        sc = spark.sparkContext
        ensure_callback_server_started(sc._gateway)
        sc._jsc.sc().addSparkListener(_SlowOnJobEnd(4.0))
        sc.parallelize(range(10), 2).count()   # its job end holds the queue while the session stops
        app_id = sc.applicationId
    store = FileSystemJobResultStore(str(state / "job-results"))
    entry = wait_until(lambda: (e := store.get(app_id)) and e.clean and e, timeout=20, what="clean app job result")
    assert entry.status is JobStatus.SUCCEEDED


def test_checkpoint_dir_and_app_job_are_cleaned_at_application_end(state, tmp_path):
    ckpt = tmp_path / "ckpt"
    with spark_session("local[1]", **{"spark.steward.state-dir": str(state)}) as spark:
        spark.sparkContext.setCheckpointDir(str(ckpt))
        rdd = spark.sparkContext.parallelize(range(10), 2)
        rdd.checkpoint()
        rdd.count()
        app_id = spark.sparkContext.applicationId
        assert any(ckpt.iterdir()), "Spark wrote checkpoint files"
    from sparksteward.jobs.fs_store import FileSystemJobResultStore

    store = FileSystemJobResultStore(str(state / "job-results"))
    entry = wait_until(lambda: (e := store.get(app_id)) and e.clean and e, timeout=10, what="clean app job result")
    assert entry.status is JobStatus.SUCCEEDED
    assert not any(ckpt.iterdir()), "the application's checkpoint directory was deleted"


def _submit(state: Path, runs: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    submit = Path(sys.executable).parent / "spark-submit"
    cmd = [str(submit), "--master", "local[1]", "--conf", "spark.plugins=sparksteward.shim.StewardPlugin",
           "--jars", str(shim_jar()), "--conf", f"spark.steward.state-dir={state}",
           "--conf", "spark.steward.job.id=nightly-2026-11-22", "--conf", "spark.ui.enabled=false", *extra,
           str(ROOT / "examples" / "nightly_job.py"), str(runs)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=os.environ)


@pytest.mark.slow
@pytest.mark.soak   # two spark-submits, a minute: make soak runs it, after the suite
def test_spark_submit_twice_with_the_same_job_id_runs_once(tmp_path):
    state, runs = tmp_path / "state", tmp_path / "runs.txt"
    first = _submit(state, runs)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _submit(state, runs)
    assert second.returncode != 0
    assert len(runs.read_text().splitlines()) == 1, "the job body ran once"
    err = second.stderr
    assert "nightly-2026-11-22" in err and "SUCCEEDED" in err and "spark.steward.job.force-rerun=true" in err
    third = _submit(state, runs, "--conf", "spark.steward.job.force-rerun=true")
    assert third.returncode == 0 and len(runs.read_text().splitlines()) == 2
