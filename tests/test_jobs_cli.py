"""`steward jobs ...` on a real file:// store: readable tables, clear errors, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sparksteward.cli import main
from sparksteward.jobs.cleanup import CleanupStep, RetryPolicy, StepRegistry
from sparksteward.jobs.service import JobService
from sparksteward.jobs.store import FileSystemJobResultStore
from sparksteward.testing.clock import FakeClock


@pytest.fixture()
def store_path(tmp_path):
    path = str(tmp_path / "jrs")
    svc = JobService(FileSystemJobResultStore(path), cluster_id="default", clock=FakeClock(),
                     registry=StepRegistry(), policy=RetryPolicy(1, 1, 1))
    svc.begin("ingest 2026")
    svc.finish("ingest 2026", "SUCCEEDED", payload={"rows": 5})
    svc.begin("broken")
    svc.add_cleanup_step("broken", CleanupStep("no_such_kind", "x"))  # stays dirty
    svc.finish("broken", "FAILED", failure={"type": "ValueError", "message": "bad row", "where": "etl.py:3"})
    svc.close(5)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_shows_a_table(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "list", "--path", store_path)
    assert code == 0 and "2 job result(s)" in out
    lines = out.splitlines()
    assert lines[1].split() == ["JOB", "STATUS", "STATE", "ENDED", "CLEANUP", "APPLICATION"]
    assert any("ingest 2026" in line and "SUCCEEDED" in line and "clean" in line for line in lines)
    assert any("broken" in line and "FAILED" in line and "dirty" in line and "0/1" in line for line in lines)
    code, out, _ = run(capsys, "jobs", "list", "--path", store_path, "--state", "dirty")
    assert "1 job result(s)" in out and "ingest" not in out


def test_show_prints_the_record(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "show", "broken", "--path", store_path)
    assert code == 0 and "FAILED (dirty)" in out and "ValueError: bad row" in out and "etl.py:3" in out
    assert "no_such_kind" in out and "unknown cleanup step kind" in out


def test_unknown_job_is_a_clear_error_not_a_traceback(store_path, capsys):
    code, out, err = run(capsys, "jobs", "show", "nope", "--path", store_path)
    assert code == 2 and err.strip() == "steward: error: no result for job 'nope'"
    code, _, err = run(capsys, "jobs", "show", "../etc", "--path", store_path)
    assert code == 2 and "not valid" in err and "Traceback" not in err


def test_cleanup_reports_what_is_still_dirty(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "cleanup", "--path", store_path, "--timeout", "3", "--attempts", "1")
    assert "broken: still dirty" in out


def test_prune_and_quarantine(store_path, capsys):
    code, out, _ = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "1s")
    assert code == 0 and "pruned 1" in out
    code, _, err = run(capsys, "jobs", "prune", "--path", store_path, "--older-than", "soon")
    assert code == 2 and "--older-than 'soon'" in err
    FileSystemJobResultStore(store_path).base.write_atomic(
        FileSystemJobResultStore(store_path).base.path("x_DIRTY.json"), b"{oops")
    code, out, _ = run(capsys, "jobs", "list", "--path", store_path)
    assert "unreadable:" in out and "x_DIRTY.json" in out
    code, out, _ = run(capsys, "jobs", "quarantine", "x_DIRTY.json", "--path", store_path)
    assert code == 0 and "quarantine" in out


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "sparksteward", "config", "--format", "conf"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "spark.steward.blob.retention.interval" in proc.stdout
