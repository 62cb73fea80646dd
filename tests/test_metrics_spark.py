"""The driver agent's keyed-state numbers in Spark's metrics system (issue 9, Visibility), on real Spark
local[2]: after committed checkpoints, the gauges a CsvSink writes (through the shim's metricRegistry)
and the driver agent's health equal ``ks.info()["space"]``. Run under the Spark lock."""

from __future__ import annotations

import os
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


def test_a_stream_reports_its_state_in_the_progress_a_listener_and_the_metrics_sink(spark, dirs, tmp_path):
    """A file stream of three batches through ``ks.process``: the input figures ``ks.observe`` adds are
    in each batch's progress (``observedMetrics``) and a listener's events, the checkpoint's report is
    ``ks.report(batchId)`` in that listener, and the CsvSink has the latest checkpoint's figures while
    the query still runs."""
    from pyspark.sql.streaming import StreamingQueryListener

    st = Steward.get(spark)
    ks = st.keyed_state("stream", key="k", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    source = tmp_path / "in"
    source.mkdir()
    batches = [pd.DataFrame({"k": [f"user-{(b * 5 + i) % (10 + 5 * b)}" for i in range(30 + 10 * b)]})
               for b in range(3)]
    for b, frame in enumerate(batches):
        frame.to_json(source / f"part-{b}.json", orient="records", lines=True)
        os.utime(source / f"part-{b}.json", (1_700_000_000 + b, 1_700_000_000 + b))   # the batches' order
    seen: list[tuple[int, dict, dict | None]] = []

    class Collect(StreamingQueryListener):
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            p = event.progress
            observed = {k: v.asDict() for k, v in (p.observedMetrics or {}).items()}
            seen.append((p.batchId, observed, ks.report(p.batchId)))

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    listener = Collect()
    spark.streams.addListener(listener)
    written: dict[int, int] = {}
    stream_df = ks.observe(spark.readStream.schema("k string").option("maxFilesPerTrigger", 1).json(str(source)))
    q = (stream_df.writeStream.foreachBatch(ks.process(count, SCHEMA, sink=lambda out, cid: written.setdefault(
        cid, out.count()))).option("checkpointLocation", str(tmp_path / "q")).trigger(processingTime="200 milliseconds").start())
    try:
        q.processAllAvailable()
        csv_dir = dirs / "csv"
        last = ks.report()
        assert last is not None and last["batch_id"] == 2, last
        # the metrics sink, during the stream: the latest checkpoint's figures
        wait_until(lambda: gauge_from_csv(csv_dir, "state.stream.checkpoint.batch_id") == 2.0, timeout=30,
                   what="the CsvSink to report checkpoint figures of batch 2")
        for figure in ("rows_in", "rows_out", "keys_touched", "state_bytes", "bytes_uploaded", "duration_ms"):
            assert gauge_from_csv(csv_dir, f"state.stream.checkpoint.{figure}") == float(last[figure]), figure
        wait_until(lambda: len({b for b, _, _ in seen}) >= 3, timeout=30, what="the listener to see 3 batches")
        progress = {p["batchId"]: p for p in q.recentProgress}
    finally:
        q.stop()
        spark.streams.removeListener(listener)
    assert q.exception() is None
    for b, frame in enumerate(batches):
        distinct = frame["k"].nunique()
        observed = progress[b]["observedMetrics"]["steward.stream"]
        assert observed["rows_in"] == len(frame), (b, observed)
        assert abs(observed["keys_approx"] - distinct) <= max(1, distinct // 10), (b, observed, distinct)
        report = ks.report(b)
        assert report["rows_in"] == len(frame) and report["rows_out"] == written[b] == distinct, (b, report)
        assert report["keys_touched"] == distinct and report["entries_estimate"] >= distinct, (b, report)
        assert report["state_bytes"] > 0 and report["state_bytes_local"] > 0 and report["bytes_uploaded"] > 0
        assert report["duration_ms"] >= report["commit_ms"] > 0 and report["objects_written"] >= 2
        assert report["query"] == str(q.id)
        events = [(obs, rep) for batch, obs, rep in seen if batch == b]
        assert events and events[0][0]["steward.stream"]["rows_in"] == len(frame)
        assert events[0][1] == report   # the listener read the batch's report: its checkpoint was committed
    last = ks.report(2)   # a subtask restores its base unless its worker kept its DB open (decision 0026)
    assert (last["restore_ms"] > 0 or last["kept_open"] == 2) and last["rescale_ms"] == 0, last
    assert ks.info()["report"] == ks.report()
