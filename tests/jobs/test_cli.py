"""`steward jobs list|show|cleanup|prune|quarantine` on a real file:// store: tables, errors, exit codes.

The parser is built here from :func:`sparksteward.jobs.cli.add_subcommands`, the same way the
top-level ``steward`` command does; one test runs the installed command end to end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import orjson
import pytest
from sparksteward.errors import StewardError
from sparksteward.jobs.cli import add_subcommands
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import Failure, JobResult
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import CleanupStep, StepRegistry
from sparksteward.testing.clock import FakeClock


def steward(*argv: str) -> int:
    """What ``steward`` does with our subcommands: parse, run, one line and status 2 on errors."""
    parser = argparse.ArgumentParser(prog="steward")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    try:
        return args.func(args)
    except StewardError as exc:
        print(f"steward: error: {exc}", file=sys.stderr)
        return 2


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = steward(*argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def store_path(tmp_path):
    """A store with a clean result, a dirty one stuck on a step kind only its own driver knew, and a
    dirty one whose target is deletable now (its driver stopped before cleaning up)."""
    path = str(tmp_path / "jrs")
    registry = StepRegistry()
    registry.register("driver_only", lambda target: None)
    svc = JobService(FileSystemJobResultStore(path), clock=FakeClock(), registry=registry,
                     policy=RetryPolicy(1, 1, 1))
    svc.begin("ingest 2026", application_id="app-1")
    svc.record_spark_job_end("ingest 2026", 0, "succeeded")
    svc.finish("ingest 2026", "SUCCEEDED", payload={"rows": 5})
    svc.close(5)
    store = FileSystemJobResultStore(path)
    for job_id, kind, target, status in (("broken", "driver_only", "x", "FAILED"),
                                         ("pending", "delete_path", str(tmp_path / "scratch"), "CANCELLED")):
        store.create_dirty(JobResult(
            job_id=job_id, cluster_id="default", application_id="app-2", status=status, start_time=1.7e9,
            end_time=1.7e9 + 5, cleanup=(CleanupStep(kind, target).state(),),
            failure=Failure("ValueError", "bad row", "etl.py:3") if status == "FAILED" else None))
    (tmp_path / "scratch").mkdir()
    return path


def test_list_prints_an_aligned_table(store_path, capsys):
    code, out, err = run(capsys, "jobs", "list", "--path", store_path)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("3 job result(s) in ") and lines[0].endswith("/jrs/default")
    assert lines[1].split() == ["JOB", "STATUS", "STATE", "ENDED", "CLEANUP", "APPLICATION"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    rows = {line.split("  ")[0].strip(): line for line in lines[3:]}
    assert list(rows) == ["broken", "ingest 2026", "pending"]
    assert "FAILED" in rows["broken"] and "dirty" in rows["broken"] and "0/1" in rows["broken"]
    assert "SUCCEEDED" in rows["ingest 2026"] and "clean" in rows["ingest 2026"] and "0/0" in rows["ingest 2026"]
    starts = {line.index(word) for line, word in ((lines[1], "STATE"), *((r, r.split()[-5]) for r in lines[3:]))}
    assert len(starts) == 1, "the STATE column is aligned"

    code, out, _ = run(capsys, "jobs", "list", "--path", store_path, "--state", "dirty", "--status", "failed")
    assert code == 0 and "1 job result(s)" in out and "broken" in out and "pending" not in out


def test_an_empty_or_missing_store_lists_nothing(tmp_path, capsys):
    code, out, _ = run(capsys, "jobs", "list", "--path", str(tmp_path / "nothing-here"))
    assert code == 0 and out.startswith("0 job result(s) in ")
    assert not (tmp_path / "nothing-here").exists(), "listing creates nothing"


def test_show_prints_the_full_record(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "show", "broken", "--path", store_path)
    assert code == 0
    assert "status:       FAILED (dirty)" in out and "failure:      ValueError: bad row" in out and "etl.py:3" in out
    assert "driver_only" in out and "STEP" in out and "pending" in out
    code, out, _ = run(capsys, "jobs", "show", "ingest 2026", "--path", store_path)
    assert "payload:      {\"rows\":5}" in out and "SPARK JOB" in out and "succeeded" in out
    code, out, _ = run(capsys, "jobs", "show", "ingest 2026", "--path", store_path, "--json")
    doc = orjson.loads(out)
    assert code == 0 and doc["state"] == "clean" and doc["result"]["payload"] == {"rows": 5}


def test_errors_are_one_line_with_status_2(store_path, capsys):
    code, out, err = run(capsys, "jobs", "show", "nope", "--path", store_path)
    assert code == 2 and out == "" and err == "steward: error: no result for job 'nope'\n"
    code, _, err = run(capsys, "jobs", "show", "../etc", "--path", store_path)
    assert code == 2 and "not valid" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "jobs", "list", "--path", store_path, "--cluster-id", "no/slash")
    assert code == 2 and "cluster" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "jobs", "list", "--path", "memory")
    assert code == 2 and "in-memory" in err
    code, _, err = run(capsys, "jobs", "list", "--path", "nosuchproto://x")
    assert code == 2 and "nosuchproto" in err and len(err.splitlines()) == 1


def test_cleanup_finishes_what_it_can_and_reports_the_rest(store_path, tmp_path, capsys):
    code, out, _ = run(capsys, "jobs", "cleanup", "--path", store_path, "--timeout", "10")
    assert code == 1, out
    assert "cleaning up 2 dirty job result(s)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("broken", "pending"))}
    assert "still dirty" in lines["broken"] and "unknown cleanup step kind 'driver_only'" in lines["broken"]
    assert "clean" in lines["pending"] and "1/1" in lines["pending"]
    assert not (tmp_path / "scratch").exists()
    assert "1 result(s) still dirty" in out
    code, out, _ = run(capsys, "jobs", "cleanup", "--path", store_path, "--timeout", "5", "pending")
    assert code == 0 and "no dirty job results among pending" in out


def test_prune(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "1s", "--dry-run")
    assert code == 0 and "would prune 1" in out and "ingest 2026" in out
    code, out, _ = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "36500d")
    assert code == 0 and "pruned 0" in out
    code, out, _ = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "1s")
    assert code == 0 and "pruned 1 clean job result(s)" in out
    assert "ingest 2026" not in run(capsys, "jobs", "list", "--path", store_path)[1]
    code, _, err = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "soon")
    assert code == 2 and "--older-than 'soon'" in err


def test_quarantine_an_unreadable_file(store_path, capsys):
    store = FileSystemJobResultStore(store_path)
    store.base.write_atomic(store.base.path("x_DIRTY.json"), b"{oops")
    code, out, _ = run(capsys, "jobs", "list", "--path", store_path)
    assert code == 0 and "3 job result(s)" in out
    assert "unreadable:" in out and "x_DIRTY.json" in out and "steward jobs quarantine" in out
    code, out, err = run(capsys, "jobs", "show", "x", "--path", store_path)
    assert code == 2 and "x_DIRTY.json" in err and "quarantine" in err
    code, out, _ = run(capsys, "jobs", "quarantine", "x_DIRTY.json", "--path", store_path)
    assert code == 0 and "moved to" in out and "/quarantine/x_DIRTY.json" in out
    assert "unreadable:" not in run(capsys, "jobs", "list", "--path", store_path)[1]
    code, _, err = run(capsys, "jobs", "quarantine", "x_DIRTY.json", "--path", store_path)
    assert code == 2 and "no file or job" in err


def test_the_installed_command_has_no_tracebacks(store_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    ok = subprocess.run([sys.executable, "-m", "sparksteward", "jobs", "list", "--path", store_path],
                        capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and "ingest 2026" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "sparksteward", "jobs", "show", "nope", "--path", store_path],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "steward: error: no result for job 'nope'"


def test_cleanup_stores_the_results_spooled_on_this_host_for_that_store(capsys, tmp_path, monkeypatch):
    from sparksteward.jobs.result import JobStatus
    from sparksteward.jobs.spool import SPOOL_DIR, ResultSpool

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    state = tmp_path / "xdg" / "spark-steward"
    path = str(tmp_path / "jrs")
    spooled = JobResult(job_id="spooled", cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED,
                        start_time=1.0, end_time=2.0, run_id="r1")
    ResultSpool(str(state / SPOOL_DIR), "default", FileSystemJobResultStore(path).url).put(spooled)
    ResultSpool(str(state / SPOOL_DIR), "default", "file:///another/store").put(spooled)
    code, out, _ = run(capsys, "jobs", "cleanup", "--path", path, "--timeout", "10")
    assert code == 0, out
    assert FileSystemJobResultStore(path).get("spooled").clean
    left = [p for p in (state / SPOOL_DIR).rglob("*.json")]
    assert len(left) == 1  # the other store's result stays for its own store


def test_show_of_a_stream_with_a_thousand_spark_jobs_summarizes(tmp_path, capsys):
    from sparksteward.jobs.result import MAX_SPARK_JOBS, JobStatus, SparkJobOutcome

    assert MAX_SPARK_JOBS == 1000   # what a result keeps of a stream's thousands
    path = str(tmp_path / "jrs")
    outcomes = ["failed" if i in (7, 500, 995) else "running" if i == 999 else "succeeded" for i in range(1000)]
    FileSystemJobResultStore(path).create_dirty(JobResult(
        job_id="stream", cluster_id="default", application_id="app-1", status=JobStatus.SUCCEEDED, start_time=1.7e9,
        end_time=1.7e9 + 60, spark_jobs=tuple(SparkJobOutcome(i, o, "boom\nat x" if o == "failed" else None)
                                              for i, o in enumerate(outcomes))))
    code, out, _ = run(capsys, "jobs", "show", "stream", "--path", path)
    lines = out.splitlines()
    assert code == 0 and len(lines) < 40
    assert "spark jobs:   1000 (3 failed, 1 running, 996 succeeded); a result keeps the first 1000" in lines
    assert "the last 20 of 1000 Spark jobs; failed among the others: 7, 500 (--limit 0 prints all" in out
    rows = [line.split() for line in lines[lines.index(next(x for x in lines if x.startswith("SPARK JOB"))) + 2:]]
    assert [int(r[0]) for r in rows] == list(range(980, 1000))
    assert rows[15][1:] == ["failed", "boom"] and rows[19][1] == "running"

    code, out, _ = run(capsys, "jobs", "show", "stream", "--path", path, "--limit", "4")
    assert code == 0 and "the last 4 of 1000" in out and "failed among the others: 7, 500, 995 (" in out
    code, out, _ = run(capsys, "jobs", "show", "stream", "--path", path, "--limit", "0")
    assert code == 0 and "the last" not in out and len(out.splitlines()) > 1000
    code, _, err = run(capsys, "jobs", "show", "stream", "--path", path, "--limit", "-1")
    assert code == 2 and "--limit -1" in err
    code, out, _ = run(capsys, "jobs", "show", "stream", "--path", path, "--json")
    assert len(orjson.loads(out)["result"]["spark_jobs"]) == 1000
