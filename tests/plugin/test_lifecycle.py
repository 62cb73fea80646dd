"""Session start and stop with the plugin: bad config fails start clearly; stop leaves no agent."""

from __future__ import annotations

import pytest

from tests.helpers import agent_processes, spark_session, wait_until


def test_bad_config_value_fails_session_start_with_a_clear_message():
    with pytest.raises(Exception) as info:
        with spark_session("local[1]", **{"spark.steward.blob.retention.interval": "-5s"}):
            pass
    text = str(info.value)
    assert "spark.steward.blob.retention.interval" in text and "-5s" in text
    assert "duration >= 0" in text
    wait_until(lambda: not agent_processes(), timeout=15, what="agents of the failed session to exit")


def test_stop_leaves_no_agent_process():
    with spark_session("local[2]") as spark:
        spark.sparkContext.parallelize(range(4), 2).count()
        assert len(agent_processes()) == 2
    wait_until(lambda: not agent_processes(), timeout=15, what="agents to exit after spark.stop()")


def test_shim_restarts_a_driver_agent_that_died():
    import os
    import signal

    from sparksteward import Steward
    from sparksteward.errors import StewardError

    with spark_session("local[1]") as spark:
        st = Steward.get(spark)
        first = st.health()["pid"]
        os.kill(first, signal.SIGKILL)

        def restarted():
            try:
                h = st.health()
            except (StewardError, OSError):
                return None
            return h if h["pid"] != first and h["app_id"] else None  # the replayed app_start handled

        health = wait_until(restarted, timeout=20, what="the shim to restart the driver agent")
        assert health["app_id"] == spark.sparkContext.applicationId, "app_start is replayed to the new agent"
        assert spark.sparkContext.parallelize(range(4), 2).count() == 4
    wait_until(lambda: not agent_processes(), timeout=15, what="agents to exit after spark.stop()")
