"""The plugin in a real local[2] SparkSession: events reach the driver and executor agents."""

from __future__ import annotations

import pytest
import sparksteward
from sparksteward import Steward

from tests.helpers import agent_processes, wait_until
from tests.helpers.plugin import log_level_probe, task_probe

pytestmark = pytest.mark.compat


def test_driver_agent_sees_app_start_with_the_real_app_id(spark):
    st = Steward.get(spark)
    starts = wait_until(lambda: st.events("app_start"), what="app_start")
    assert starts[0]["app_id"] == spark.sparkContext.applicationId
    assert starts[0]["spark_version"] == spark.version
    health = st.health()
    assert health["state"] == "running" and health["app_id"] == spark.sparkContext.applicationId


def test_job_events_carry_tags_from_addJobTag_and_addTag(spark):
    st = Steward.get(spark)
    sc = spark.sparkContext
    sc.addJobTag("steward-etl")
    try:
        sc.parallelize(range(10), 2).count()
    finally:
        sc.removeJobTag("steward-etl")
    spark.addTag("nightly")
    try:
        spark.range(100).selectExpr("sum(id)").collect()
    finally:
        spark.removeTag("nightly")

    def tagged(suffix):
        return [e for e in st.events("job_start") if any(t.endswith(suffix) for t in e["job_tags"])]

    etl = wait_until(lambda: tagged("steward-etl"), what="job_start tagged by addJobTag")
    assert "steward-etl" in etl[0]["job_tags"], "SparkContext.addJobTag tags arrive verbatim"
    nightly = wait_until(lambda: tagged("-nightly"), what="job_start tagged by SparkSession.addTag")
    assert any(t.startswith("spark-session-") for t in nightly[0]["job_tags"])
    ends = wait_until(lambda: {e["job_id"]: e for e in st.events("job_end")}.get(etl[0]["job_id"]),
                      what="job_end")
    assert ends["result"] == "succeeded" and ends["reason"] is None


def test_failed_job_end_carries_the_reason(spark):
    st = Steward.get(spark)

    def boom(_):
        raise ValueError("steward-boom")

    with pytest.raises(Exception, match="steward-boom"):
        spark.sparkContext.parallelize([1], 1).map(boom).collect()
    failed = wait_until(lambda: [e for e in st.events("job_end") if e["result"] == "failed"], what="failed job_end")
    assert "steward-boom" in failed[-1]["reason"]


def test_executor_agent_receives_its_task_events(spark):
    rows = spark.sparkContext.parallelize(range(4), 4).mapPartitions(task_probe).collect()
    assert len(rows) == 4
    assert all(seen for *_, seen in rows), rows
    assert {executor for _, executor, _, _ in rows} == {"driver"}, "local mode has one executor, 'driver'"


def test_one_driver_and_one_executor_agent_run(spark):
    roles = sorted(p.cmdline()[-1].rsplit(".", 1)[-1] for p in agent_processes())
    assert roles == ["driver", "executor"]


def test_public_names_are_pinned():
    assert sorted(sparksteward.__all__) == sorted([
        "PLUGIN_CLASS", "AgentUnavailableError", "BlobNotFoundError", "ChecksumMismatchError",
        "ConfigError", "CorruptRecordError", "InvalidIdError", "JobAlreadyCompleted", "Steward",
        "StewardError", "__version__", "configure", "list_state", "map_state", "value_state",
    ])


def test_the_agents_follow_sc_setLogLevel(spark):
    """Issue 40: ``sc.setLogLevel`` reaches the driver agent and the executor agent (in local mode the
    executors' JVM is the driver's), through the shim's ``log_level`` line before the next event."""
    sc, st = spark.sparkContext, Steward.get(spark)
    jvm_level = sc._jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel().name()
    try:
        for level in ("ERROR", "INFO"):
            sc.setLogLevel(level)
            assert set(sc.parallelize([0, 1], 2).mapPartitions(log_level_probe).map(lambda t: t[1]).collect()) == {level}
            wait_until(lambda level=level: st.health()["log_level"] == level, what=f"the driver agent at {level}")
    finally:
        sc.setLogLevel(jvm_level)
        sc.parallelize([0], 1).count()   # the agents follow back
    wait_until(lambda: st.health()["log_level"] == jvm_level, what=f"the driver agent back at {jvm_level}")
