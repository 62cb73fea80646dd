"""The driver agent's keyed-state numbers in Spark's metrics system (issue 9, Visibility), on real Spark
local[2]: after committed checkpoints, the gauges a CsvSink writes (through the shim's metricRegistry)
and the driver agent's health equal ``ks.info()["space"]``. Run under the Spark lock."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sparksteward import Steward
from tests.helpers import spark_session, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.compat]

SOURCE = "plugin.sparksteward.shim.StewardPlugin"
SCHEMA = "k string, n long"


def count(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    return pd.DataFrame({"k": [key], "n": [n]})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("metrics")


# its own session: a CsvSink and a short metrics interval
@pytest.fixture(scope="module")
def spark(dirs):
    (dirs / "csv").mkdir()
    conf = {"spark.steward.state-dir": str(dirs / "state"), "spark.steward.metrics.interval": "300ms",
            "spark.metrics.conf.driver.sink.csv.class": "org.apache.spark.metrics.sink.CsvSink",
            "spark.metrics.conf.driver.sink.csv.period": "1", "spark.metrics.conf.driver.sink.csv.unit": "seconds",
            "spark.metrics.conf.driver.sink.csv.directory": str(dirs / "csv")}
    with spark_session("local[2]", **conf) as session:
        yield session


def gauge_from_csv(csv_dir: Path, name: str) -> float | None:
    """The latest value the CsvSink wrote for gauge ``<app>.driver.<SOURCE>.<name>``, or None."""
    found = list(csv_dir.glob(f"*.driver.{SOURCE}.{name}.csv"))
    if not found:
        return None
    rows = [line.split(",") for line in found[0].read_text().splitlines()[1:] if line.strip()]
    return float(rows[-1][1]) if rows else None


def test_merged_space_reaches_spark_metrics_and_health(spark, dirs):
    st = Steward.get(spark)
    csv_dir = dirs / "csv"
    # the registry is in Spark's metrics system from the start: the shim's own gauge is reported
    wait_until(lambda: gauge_from_csv(csv_dir, "agent.metrics_lines") is not None, timeout=30,
               what="the shim's gauge in the CsvSink output")
    ks = st.keyed_state("counts", key="k", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    for cid in range(3):
        df = spark.createDataFrame(pd.DataFrame({"k": [f"user-{(cid * 7 + i) % 40}" for i in range(200)]}))
        ks.apply(df, count, SCHEMA, checkpoint_id=cid).count()
        assert ks.commit(cid, wait=60) == cid
    space = ks.info()["space"]
    assert space["physical_files"] > 0 and space["logical_bytes"] > 0, space

    expected = {f"state.counts.merged.{k}": float(v) for k, v in space.items()}
    expected["state.counts.merged.no_reuse_files"] = float(len(ks.info()["no_reuse"]))

    def reported():
        got = {name: gauge_from_csv(csv_dir, name) for name in expected}
        return got if got == expected else None

    try:
        wait_until(reported, timeout=30, what="the CsvSink to report the merged space of keyed state 'counts'")
    except AssertionError:
        raise AssertionError(f"CsvSink has {({n: gauge_from_csv(csv_dir, n) for n in expected})}, "
                             f"info()['space'] is {expected}") from None
    assert gauge_from_csv(csv_dir, "agent.metrics_lines") >= 1

    health = st.health()["metrics"]
    assert {k: float(v) for k, v in health.items() if k.startswith("state.counts.merged.")} == expected
    # FLIP-76: the latest checkpoint's rows processed and deferred (aligned: nothing deferred)
    assert health["state.counts.unaligned.checkpoint_id"] == 2
    assert health["state.counts.unaligned.rows_processed"] == 200
    assert health["state.counts.unaligned.rows_deferred"] == health["state.counts.unaligned.channel_bytes"] == 0
    wait_until(lambda: gauge_from_csv(csv_dir, "state.counts.unaligned.rows_processed") == 200.0, timeout=30,
               what="the CsvSink to report the latest checkpoint's rows processed")
