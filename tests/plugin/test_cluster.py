"""The plugin on local-cluster[2,1,1024]: one executor agent per executor JVM, each seeing its own
tasks; SIGKILL of an executor JVM ends its agent."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from sparksteward import Steward

from tests.helpers import agent_processes, spark_session, wait_until
from tests.helpers.plugin import log_level_probe, task_probe

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


# its own session: a test SIGKILLs an executor JVM
@pytest.fixture(scope="module")
def spark():
    with spark_session("local-cluster[2,1,1024]", **{"spark.executor.memory": "1g",
                                                     "spark.executor.syncLogLevel.enabled": "true"}) as session:
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
        wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")  # + driver
        yield session
    wait_until(lambda: not agent_processes(), timeout=20, what="agents to exit after spark.stop()")


def _executors(spark):
    def probe(_):
        import os

        import psutil
        from pyspark import SparkFiles
        from sparksteward.worker import executor_connection

        health = executor_connection().request("health")
        jvm = psutil.Process(os.getpid()).parent().parent()  # worker -> pyspark daemon -> executor JVM
        cache = os.path.join(os.path.abspath(SparkFiles.getRootDirectory()), ".sparksteward", f"cache-{health['pid']}")
        return [(health["executor_id"], health["pid"], jvm.pid, cache)]

    rows = spark.sparkContext.parallelize(range(8), 8).mapPartitions(probe).collect()
    return {executor: (agent, jvm, cache) for executor, agent, jvm, cache in rows}


def test_driver_agent_sees_both_executors_and_the_app(spark):
    st = Steward.get(spark)
    assert st.events("app_start")[0]["app_id"] == spark.sparkContext.applicationId
    added = wait_until(lambda: len({e["executor_id"] for e in st.events("executor_added")}) >= 2 and
                       st.events("executor_added"), timeout=90, what="two executor_added events")
    assert {e["executor_id"] for e in added} >= {"0", "1"}


def test_each_executor_agent_receives_the_task_events_of_its_executor(spark):
    rows = spark.sparkContext.parallelize(range(8), 8).mapPartitions(task_probe).collect()
    assert all(seen for *_, seen in rows), rows
    by_exec: dict[str, set[int]] = {}
    for tid, executor, _, _ in rows:
        by_exec.setdefault(executor, set()).add(tid)
    assert len(by_exec) == 2, f"tasks ran on {sorted(by_exec)}"

    def agent_view(_):
        from sparksteward.worker import executor_connection

        conn = executor_connection()
        ids = {e["task_attempt_id"] for e in conn.request("events", type="task_succeeded")["events"]}
        return [(conn.request("health")["executor_id"], sorted(ids))]

    views = {}
    for executor, ids in spark.sparkContext.parallelize(range(8), 8).mapPartitions(agent_view).collect():
        views.setdefault(executor, set()).update(ids)
    for executor, tids in by_exec.items():
        other = set().union(*(t for e, t in by_exec.items() if e != executor))
        assert tids <= views[executor], f"executor {executor} agent missed its own tasks"
        assert not (other & views[executor]), f"executor {executor} agent saw another executor's tasks"


def test_broadcast_reaches_both_executors_once_each(spark):
    import numpy as np

    st = Steward.get(spark)
    arr = np.arange(2_000_000, dtype=np.int64)
    h = st.broadcast(arr)

    def use(_):
        from sparksteward.worker import executor_connection

        conn = executor_connection()
        total = int(h.value.sum())
        return [(conn.request("health")["executor_id"], total, conn.request("blob.cache_stats")["stats"])]

    rows = spark.sparkContext.parallelize(range(8), 8).mapPartitions(use).collect()
    assert {total for _, total, _ in rows} == {int(arr.sum())}
    per_exec = {}
    for executor, _, stats in rows:
        per_exec[executor] = stats
    assert len(per_exec) >= 2
    assert all(s.get("transfers", 0) == 1 for s in per_exec.values()), per_exec  # once per executor, 4 tasks each


def test_executor_agents_follow_sc_setLogLevel_when_spark_syncs_it_to_the_executors(spark):
    """Issue 40, on executor JVMs of their own: with ``spark.executor.syncLogLevel.enabled`` Spark sets
    each executor's log4j level on ``sc.setLogLevel``, and the executor's shim passes it to its agent. (Before
    the SIGKILL test: an executor that Spark starts in place of a killed one kept INFO in its JVM here.)"""
    sc = spark.sparkContext
    jvm_level = sc._jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel().name()
    try:
        sc.setLogLevel("ERROR")

        def levels():   # Spark tells the registered executors in the background: ask until both agents have it
            found = dict(sc.parallelize(range(8), 8).mapPartitions(log_level_probe).collect())
            return found if len(found) == 2 and set(found.values()) == {"ERROR"} else None
        wait_until(levels, timeout=60, what="both executor agents at ERROR")
    finally:
        sc.setLogLevel(jvm_level)


def test_sigkill_of_an_executor_jvm_ends_its_agent_within_5s(spark):
    executors = _executors(spark)
    assert len(executors) == 2
    victim, (agent_pid, jvm_pid, cache_dir) = sorted(executors.items())[0]
    assert os.path.isdir(cache_dir)
    agent = psutil.Process(agent_pid)
    os.kill(jvm_pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        agent.wait(timeout=5)
    except psutil.TimeoutExpired:
        pytest.fail(f"agent {agent_pid} of SIGKILLed executor {victim} still alive after 5 s")
    assert time.monotonic() - start < 5
    assert not os.path.exists(cache_dir), "the agent deleted its cache although its JVM died"
    # the application carries on with the remaining / replacement executor
    assert spark.sparkContext.parallelize(range(4), 4).count() == 4
