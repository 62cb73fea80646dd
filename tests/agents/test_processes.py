"""Agents as real processes, without Spark: start, health, auth, bad config, exit on EOF/SIGKILL."""

from __future__ import annotations

import os
import time

import pytest
from sparksteward.errors import AuthenticationError, MessageTooLargeError, ProtocolError
from sparksteward.rendezvous import Rendezvous
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import Connection


@pytest.fixture()
def state_conf(tmp_path):
    return {"spark.steward.state-dir": str(tmp_path / "state")}


def _wait_exit(proc, timeout: float) -> float:
    start = time.monotonic()
    proc.wait(timeout)
    return time.monotonic() - start


def test_driver_agent_ready_health_and_events(state_conf):
    with AgentProcess("driver", state_conf) as agent:
        assert agent.ready, agent.first
        assert agent.first["shutdown_grace_ms"] > 0
        agent.event("app_start", app_id="app-1", attempt_id=None, app_name="t", spark_version="4.3.0", user="u")
        with agent.connect() as conn:
            deadline = time.monotonic() + 10
            while conn.request("health")["events_seen"].get("app_start") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            health = conn.request("health")
            assert health["state"] == "running" and health["role"] == "driver"
            assert health["app_id"] == "app-1" and health["uptime_s"] > 0
            assert conn.request("events", type="app_start")["events"][0]["app_id"] == "app-1"
        assert agent.stop() == 0


def test_wrong_secret_is_refused_without_crashing_the_agent(state_conf):
    with AgentProcess("driver", state_conf) as agent:
        with pytest.raises(AuthenticationError, match="secret"):
            agent.connect(secret="0" * 64)
        with agent.connect() as conn:  # still serving
            assert conn.request("health")["auth_failures"] == 1


def test_oversized_and_malformed_requests_are_refused(state_conf):
    with AgentProcess("driver", state_conf) as agent:
        with agent.connect() as conn, pytest.raises(ProtocolError, match="unknown request op"):
            conn.request("no-such-op")
        with agent.connect() as conn:
            conn.sock.sendall((64 << 20).to_bytes(4, "big"))  # announce 64 MiB: over the 16 MiB bound
            with pytest.raises((ProtocolError, OSError)):
                conn.recv()
        with Connection.connect(agent.endpoint, agent.secret, max_message=1 << 10) as conn:
            with pytest.raises(MessageTooLargeError):
                conn.request("health", pad="x" * 4096)
        with agent.connect() as conn:
            assert conn.request("health")["state"] == "running"


@pytest.mark.parametrize("key,value", [
    ("spark.steward.blob.retention.interval", "-5s"),
    ("spark.steward.driver.port", "70000"),
    ("spark.steward.cluster-id", "../evil"),
])
def test_bad_config_value_gives_a_fatal_line_naming_the_key(state_conf, key, value):
    with AgentProcess("driver", {**state_conf, key: value}) as agent:
        assert agent.first["type"] == "fatal", agent.first
        assert agent.first["code"] == "CONFIG_INVALID"
        assert key in agent.first["message"] and value in agent.first["message"]
        assert agent.proc.wait(10) == 2


def test_agent_exits_on_stdin_eof(state_conf):
    agent = AgentProcess("driver", state_conf)
    assert agent.ready
    agent.close_stdin()  # what the agent sees when its JVM dies, SIGKILL included
    assert _wait_exit(agent.proc, 5) < 5
    assert agent.proc.returncode == 0


def test_executor_agent_publishes_and_withdraws_rendezvous(tmp_path, state_conf):
    root = tmp_path / "userFiles"
    with AgentProcess("executor", state_conf, rendezvous_dir=str(root)) as agent:
        assert agent.ready, agent.first
        rec = Rendezvous(root).read(wait=5)
        assert rec["endpoint"] == agent.endpoint and rec["pid"] == agent.proc.pid
        assert oct(os.stat(Rendezvous(root).path).st_mode & 0o777) == "0o600"
        with Connection.connect(str(rec["endpoint"]), str(rec["secret"])) as conn:
            assert conn.request("health")["executor_id"] == "1"
        agent.event("task_start", task_attempt_id=7, stage_id=0, stage_attempt_id=0, partition_id=0,
                    attempt_number=0)
    assert not Rendezvous(root).path.exists()


def test_an_application_id_seen_before_still_gets_an_application_job(state_conf):
    """local-cluster and a restarted standalone master number applications from 0 again, so two
    applications started in the same second share an id (app-<yyyyMMddHHmmss>-0000). The second one
    must still get an application job (its blobs are scoped to it and deleted at its end), not run
    without one because the JobResultStore already holds the first one's completed job."""
    jobs = []
    for _ in range(2):
        with AgentProcess("driver", state_conf) as agent:
            agent.event("app_start", app_id="app-20261122230229-0000", attempt_id=None, app_name="t",
                        spark_version="4.3.0", user="u")
            with agent.connect() as conn:
                deadline = time.monotonic() + 10
                while conn.request("health")["app_job_id"] is None:
                    assert time.monotonic() < deadline, "no application job"
                    time.sleep(0.02)
                jobs.append(conn.request("health")["app_job_id"])
            agent.event("app_end", exit_code=0, checkpoint_dir=None)
            with agent.connect() as conn:  # the first application's job completes (a result is stored)
                deadline = time.monotonic() + 10
                while conn.request("jobs.get", job_id=jobs[-1]).get("entry") is None:
                    assert time.monotonic() < deadline, "the application's job never completed"
                    time.sleep(0.05)
            assert agent.stop() == 0
    assert jobs[0] == "app-20261122230229-0000"
    assert jobs[1] and jobs[1] != jobs[0] and jobs[1].startswith("app-20261122230229-0000")
