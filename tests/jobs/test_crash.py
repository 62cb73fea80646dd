"""The driver side is SIGKILLed at a random point during cleanup, with cleanup targets on S3 (moto).

A real driver agent process plays the driver side; after each kill a new agent on the same stores
must finish every dirty entry, leave no registered path or blob, and never run a job body twice.
"""

from __future__ import annotations

import random
import time

import pytest
from sparksteward.testing.agent import AgentProcess

from tests.helpers import wait_until

RUNS = 12


def _begin(conn, job_id):
    return conn.request("jobs.begin", job_id=job_id, force=False)


@pytest.mark.soak   # 31 s of real kills: it runs in make soak, after the suite (which must stay under 20 minutes)
def test_sigkill_during_cleanup_then_restart_finishes_everything(s3, tmp_path):
    rng = random.Random(20261122)
    fs = s3.filesystem()
    conf = {"spark.steward.state-dir": str(tmp_path / "state"),
            "spark.steward.blob.ha.storage-path": s3.url("ha"),
            "spark.steward.cleanup.initial-backoff": "100ms"}
    body_runs: dict[str, int] = {}
    killed_mid_cleanup = 0
    for run in range(RUNS):
        job = f"crash-job-{run}"
        targets = [s3.url("tmp", job, f"part-{p}") for p in range(4)]
        for t in targets:
            fs.pipe({f"{t}/f{i}": b"x" * 100 for i in range(10)})
        blob_dir = s3.url("ha", "default", "blob", job)
        fs.pipe({f"{blob_dir}/t-{i:032x}": b"blob" for i in range(5)})

        with AgentProcess("driver", conf) as agent:
            assert agent.ready, agent.first
            with agent.connect() as conn:
                assert _begin(conn, job)["started"]
                for t in targets:
                    conn.request("jobs.add_cleanup", job_id=job, step={"kind": "delete_path", "target": t})
                body_runs[job] = body_runs.get(job, 0) + 1  # the job body
                conn.request("jobs.finish", job_id=job, status="SUCCEEDED", payload={"run": run}, wait=0)
                time.sleep(rng.uniform(0.0, 0.25))
                entry = conn.request("jobs.get", job_id=job)["entry"]
            agent.kill()  # SIGKILL: no shutdown, no chance to finish
        killed_mid_cleanup += entry is not None and entry["state"] == "dirty"

        # the next driver for the same cluster id
        with AgentProcess("driver", conf) as agent:
            assert agent.ready, agent.first
            with agent.connect() as conn:
                reply = _begin(conn, job)  # a re-run attempt of the same job id
                assert not reply["started"], "a completed job must not run again"
                assert reply["entry"]["result"]["payload"] == {"run": run}
                wait_until(lambda job=job: conn.request("jobs.get", job_id=job)["entry"]["state"] == "clean",
                           timeout=30, what=f"{job} to be cleaned by the restarted agent")
        assert not any(fs.exists(t) for t in targets), f"{job}: a registered path survived"
        assert not fs.exists(blob_dir), f"{job}: its blob directory survived"

    assert all(n == 1 for n in body_runs.values()), body_runs
    assert killed_mid_cleanup >= 3, f"only {killed_mid_cleanup} of {RUNS} kills landed while cleanup was running"
    print(f"\n{killed_mid_cleanup}/{RUNS} SIGKILLs landed mid-cleanup; all entries clean after restart")
