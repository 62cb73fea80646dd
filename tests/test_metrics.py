"""The driver agent's numbers for Spark's metrics system (issue 9, Visibility), without Spark: the
``metrics`` line the agent writes toward the shim, StateService.metrics() over real checkpoints, and a
real driver agent process that reports them on stdout and in ``health``."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
from sparksteward import shim_protocol
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.errors import ProtocolError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import AgentServer, Connection, new_secret

GOLDEN = Path(__file__).resolve().parents[1] / "jvm-shim" / "src" / "test" / "resources" / "golden"
P, M = 2, 8


# --- the line ---------------------------------------------------------------------------------
def test_metrics_line_is_the_golden_with_sorted_names_and_decodes():
    line = shim_protocol.encode_metrics({"state.counts.merged.physical_bytes": 4096,
                                         "state.counts.merged.amplification": 1.25})
    assert line == (GOLDEN / "metrics.json").read_bytes()
    # the shim recognizes metrics lines by this prefix (Messages.MetricsPrefix, checked by the Scala test)
    assert line.startswith(b'{"v":1,"type":"metrics","values":{')
    assert shim_protocol.decode(line)["values"] == {"state.counts.merged.amplification": 1.25,
                                                    "state.counts.merged.physical_bytes": 4096}


@pytest.mark.parametrize("values,match", [
    ({"a": True}, "'a'.*not a number"),
    ({"a": "1"}, "'a'.*not a number"),
    ({"a": math.nan}, "'a'.*not a finite number"),
    ({"a": math.inf}, "'a'.*not a finite number"),
    ({"": 1}, "empty"),
    ({"a\nb": 1}, "control character"),
])
def test_bad_metrics_are_refused_by_name(values, match):
    with pytest.raises(ProtocolError, match=match):
        shim_protocol.encode_metrics(values)


def test_metrics_line_with_a_non_object_is_refused():
    with pytest.raises(ProtocolError, match="'values' has the wrong type"):
        shim_protocol.decode(b'{"v":1,"type":"metrics","values":[1]}')


# --- StateService.metrics() -------------------------------------------------------------------
def _checkpoint(dconn, econn, cid: int, values: dict[str, int]) -> None:
    """One checkpoint: every subtask writes its keys of ``values`` and uploads; then commit."""
    rows: dict[int, dict[str, int]] = {}
    for k, v in values.items():
        rows.setdefault(subtask_for_key_group(M, P, key_group(k, M)), {})[k] = v
    dconn.request("state.begin", name="s", checkpoint_id=cid)
    for subtask in range(P):
        opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask)
        backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, subtask), M, "string", create=False)
        try:
            vs = backend.value("value")
            for k, v in rows.get(subtask, {}).items():
                vs.update(k, v)
            snap = backend.snapshot(opened["snapshot"])
        finally:
            backend.close()
        econn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms)
    dconn.request("state.commit", name="s", checkpoint_id=cid, wait=30)


def test_state_service_metrics_equal_info_space_per_state(tmp_path):
    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30, merging=MergingOptions(enabled=True))
    states.register_handlers(driver)
    executor = AgentServer("127.0.0.1", 0, secret, {})
    subtasks = SubtaskService(tmp_path / "exec", driver.endpoint, secret, upload_threads=2)
    subtasks.register_handlers(executor)
    try:
        assert states.metrics() == {}
        with Connection.connect(driver.endpoint, secret) as dconn, Connection.connect(executor.endpoint, secret) as econn:
            dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                          key_type="string", num_retained=2)
            assert states.metrics()["state.s.merged.physical_bytes"] == 0
            for cid in range(3):
                _checkpoint(dconn, econn, cid, {**{f"k{cid}-{i}": i for i in range(50)}, "x": cid})
            space = dconn.request("state.info", name="s")["space"]
            got = states.metrics()
        assert space["physical_bytes"] > 0 and space["logical_bytes"] > 0
        assert {k: v for k, v in got.items() if ".merged." in k} == {
            **{f"state.s.merged.{k}": v for k, v in space.items()}, "state.s.merged.no_reuse_files": 0}
        # FLIP-76: the latest checkpoint's deferral (this rig's tasks report no counters: nothing deferred)
        assert {k: v for k, v in got.items() if ".unaligned." in k} == {
            "state.s.unaligned.checkpoint_id": 2, "state.s.unaligned.rows_processed": 0,
            "state.s.unaligned.rows_deferred": 0, "state.s.unaligned.channel_bytes": 0,
            "state.s.unaligned.unaligned_subtasks": 0, "state.s.unaligned.backlog_rows": 0,
            "state.s.unaligned.backlog_bytes": 0, "state.s.unaligned.backlog_growth": 0}
        assert shim_protocol.decode(shim_protocol.encode_metrics(got))["values"] == got  # every value is encodable
    finally:
        subtasks.close()
        executor.close()
        driver.close()
        states.close()


def test_each_completed_checkpoint_has_a_report_in_commit_metrics_info_and_one_info_line(tmp_path, caplog):
    """The task's counters, the executor agent's measurements and the driver agent's timings reach the
    commit's reply, ``state.checkpoint.*`` gauges, ``state.info`` and one INFO line per checkpoint."""
    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30, merging=MergingOptions(enabled=False))
    states.register_handlers(driver)
    executor = AgentServer("127.0.0.1", 0, secret, {})
    subtasks = SubtaskService(tmp_path / "exec", driver.endpoint, secret, upload_threads=2)
    subtasks.register_handlers(executor)
    caplog.set_level("INFO", logger="sparksteward.checkpoint.coordination.report")
    try:
        with Connection.connect(driver.endpoint, secret) as dconn, Connection.connect(executor.endpoint, secret) as econn:
            dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                          key_type="string", num_retained=1)
            assert states.report("s") is None and dconn.request("state.info", name="s")["report"] is None
            replies = []
            for cid in range(2):
                dconn.request("state.begin", name="s", batch_id=cid)
                for subtask in range(P):
                    opened = econn.request("state.open", name="s", checkpoint_id=cid, subtask=subtask)
                    backend = RocksDBStateBackend(opened["workdir"], key_group_range(M, P, subtask), M, "string",
                                                  create=False)
                    try:
                        vs = backend.value("value")
                        mine = [k for k in (f"k{i}" for i in range(40))
                                if subtask_for_key_group(M, P, key_group(k, M)) == subtask]
                        for k in mine:
                            vs.update(k, cid)
                        snap = backend.snapshot(opened["snapshot"])
                    finally:
                        backend.close()
                    econn.request("state.upload", token=opened["token"], sync_ms=snap.sync_ms,
                                  counters={"rows_processed": 3 * len(mine), "rows_out": len(mine),
                                            "keys_touched": len(mine), "entries_estimate": len(mine)})
                replies.append(dconn.request("state.commit", name="s", checkpoint_id=cid, wait=30))
            info = dconn.request("state.info", name="s")
        report = replies[1]["report"]
        assert report["state"] == "s" and report["checkpoint_id"] == report["batch_id"] == 1
        assert (report["rows_in"], report["rows_out"], report["keys_touched"], report["entries_estimate"]) == \
            (120, 40, 40, 40)
        assert report["state_bytes"] == sum(f["length"] for s in info["latest"]["subtasks"]
                                            for f in s["files"] + s["channel_state"])
        assert report["state_bytes_local"] > 0 and report["bytes_uploaded"] > 0
        assert report["bytes_uploaded"] + report["bytes_reused"] == report["state_bytes"]
        assert replies[0]["report"]["bytes_reused"] == 0 and replies[0]["report"]["restore_ms"] == 0
        assert report["restore_ms"] > 0 and report["rescale_ms"] == 0   # batch 1 restored batch 0's state
        assert report["duration_ms"] >= report["commit_ms"] > 0 and report["async_ms"] > 0
        assert report["objects_written"] >= 2   # at least one file and _metadata
        assert info["report"] == report
        gauges = {k[len("state.s.checkpoint."):]: v for k, v in states.metrics().items()
                  if k.startswith("state.s.checkpoint.")}
        assert gauges == {k: v for k, v in report.items() if k not in ("state", "query")}
        lines = [r.getMessage() for r in caplog.records if r.name == "sparksteward.checkpoint.coordination.report"]
        assert len(lines) == 2, lines
        assert lines[1].startswith("keyed state s completed checkpoint 1 (batch 1, query -) in ")
        assert "120 rows in, 40 out, 40 keys touched" in lines[1]
    finally:
        subtasks.close()
        executor.close()
        driver.close()
        states.close()


# --- a real driver agent: stdout toward the shim, and health --------------------------------------
def _next_line(agent: AgentProcess, timeout: float) -> bytes | None:
    """The agent's next stdout line, or None if none comes within ``timeout`` (the reader thread
    then ends at the agent's exit, when stdout closes)."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(agent.proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else None


def test_driver_agent_reports_state_metrics_on_stdout_when_they_change_and_in_health(tmp_path):
    conf = {"spark.steward.state-dir": str(tmp_path / "state"), "spark.steward.metrics.interval": "200ms",
            "spark.steward.checkpoint.dir": str(tmp_path / "chk")}
    with AgentProcess("driver", conf) as agent:
        assert agent.ready, agent.first
        with agent.connect() as conn:
            assert conn.request("health")["metrics"] == {}
            conn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                         key_type="string", num_retained=1)
            line = _next_line(agent, 10.0)  # no state, no line: the first one comes after register
            assert line is not None, "no metrics line within 10 s"
            msg = shim_protocol.decode(line)
            assert msg["type"] == "metrics"
            assert msg["values"]["state.s.merged.logical_bytes"] == 0
            assert msg["values"] == conn.request("health")["metrics"]
            # unchanged numbers are not sent again: nothing new on stdout for five intervals
            assert _next_line(agent, 1.0) is None, "an unchanged metrics line was sent again"
        assert agent.stop() == 0


def test_metrics_interval_zero_sends_nothing(tmp_path):
    conf = {"spark.steward.state-dir": str(tmp_path / "state"), "spark.steward.metrics.interval": "0",
            "spark.steward.checkpoint.dir": str(tmp_path / "chk")}
    with AgentProcess("driver", conf) as agent:
        with agent.connect() as conn:
            conn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                         key_type="string", num_retained=1)
            assert conn.request("health")["metrics"]["state.s.merged.physical_files"] == 0  # health still has them
            assert _next_line(agent, 1.0) is None
        assert agent.stop() == 0
