"""Issue 18 item 5 on a real cluster: an unaligned batch (FLIP-76) stays exactly-once when Spark runs a
speculative copy of its slow subtask on another host, and when a new driver re-runs the batch.

Spark never launches a speculative copy on the host of the running original, and every executor of
``local-cluster`` has the same host, so this runs on a standalone cluster of two Workers on two loopback
addresses (two "hosts"), each in its own mount namespace with its own boot id where the machine allows
(the executors then see neither the driver's files nor each other's; the checkpoints live on moto S3).

The slow attempt cuts its input late (a slow user function past the aligned-checkpoint timeout), acks,
and then dawdles after its state work, so Spark speculates; the copy starts past the timeout and would
cut early by its own clock, acks after the original, and then dawdles longer, so the *original's*
rows reach the result while the copy's ack arrives last. Every row emitted by the batch, by a new
application's re-run of it, and by the drain of its deferred rows is counted.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

import pytest
from sparksteward import Steward
from sparksteward.testing.standalone import isolation_unavailable, standalone_cluster

from tests.helpers import spark_session
from tests.helpers.keyed import make_batches

# a standalone cluster and a 30 s straggler (about 60 s): it runs in make soak, after the suite
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.soak, pytest.mark.timing]   # who finishes first matters

OUT = "k string, v long, a int"
_CALLS: dict[int, int] = {}   # in a Python worker: calls of _slow_cut per task attempt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hidden = [os.environ["XDG_STATE_HOME"]]
    with standalone_cluster(tmp_path_factory.mktemp("speculation"), workers=2, isolated=not isolation_unavailable(),
                            hide=hidden, worker_env={"PYTHONPATH": os.environ["PYTHONPATH"],
                                                     "PYSPARK_PYTHON": sys.executable}) as c:
        yield c


def _session(cluster, s3, ui_port: int, **conf):
    return spark_session(cluster.master_url, **{
        "spark.executor.cores": "1", "spark.cores.max": "2", "spark.executor.memory": "512m",
        "spark.pyspark.python": sys.executable, "spark.executorEnv.PYTHONPATH": os.environ["PYTHONPATH"],
        "spark.steward.agent.python": sys.executable, "spark.steward.storage.options": s3.storage_options(),
        "spark.sql.execution.arrow.maxRecordsPerBatch": "20", "spark.task.maxFailures": "4",
        "spark.ui.enabled": "true", "spark.ui.port": str(ui_port), **conf})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tasks(spark, ui_port: int) -> list[dict]:
    """Every task attempt of the application's completed stages, from Spark's REST API."""
    app = spark.sparkContext.applicationId
    base = f"http://127.0.0.1:{ui_port}/api/v1/applications/{app}"
    with urllib.request.urlopen(f"{base}/stages?details=true&withSummaries=false", timeout=10) as r:
        stages = json.loads(r.read())
    return [{**t, "stageId": s["stageId"]} for s in stages for t in (s.get("tasks") or {}).values()]


def _slow_cut(keys, rows, state):
    """The state stage's user function: echoes its rows with the task attempt that emitted them. The
    first attempt of subtask 0 sleeps in its second call, past the 1 s timeout: it cuts after two
    buffers (a copy started later would cut after one by its own clock)."""
    import time

    import pyarrow as pa
    from pyspark import TaskContext

    ctx = TaskContext.get()
    attempt = ctx.attemptNumber()
    calls = _CALLS[ctx.taskAttemptId()] = _CALLS.get(ctx.taskAttemptId(), 0) + 1   # a worker runs many tasks
    if ctx.partitionId() == 0 and attempt == 0 and calls == 2:
        time.sleep(1.5)
    return pa.table({"k": rows.column("k"), "v": rows.column("v"), "a": pa.array([attempt] * rows.num_rows, pa.int32())})


def _dawdle(batches):
    """After the state stage, in the same task: subtask 0's first attempt finishes 10 s after its state
    work (Spark speculates it after 8 s, long after its cut), a copy 30 s after (the original wins, the
    copy acked last)."""
    import time

    from pyspark import TaskContext

    yield from batches
    ctx = TaskContext.get()
    if ctx.partitionId() == 0:
        time.sleep(10 if ctx.attemptNumber() == 0 else 30)


def test_a_speculative_copy_and_a_new_drivers_rerun_emit_the_rows_of_the_first_cut(cluster, s3):
    rows = make_batches(37, count=1, rows=400, keys=80)[0]
    every = sorted(map(tuple, rows.itertuples(index=False)))
    chk = s3.url("speculation-chk")
    opts = dict(key="k", parallelism=2, max_parallelism=16, checkpoint_dir=chk)
    ui = _free_port()
    with _session(cluster, s3, ui, **{"spark.speculation": "true", "spark.speculation.interval": "100ms",
                                      "spark.speculation.quantile": "0.5", "spark.speculation.multiplier": "1.0",
                                      "spark.speculation.minTaskRuntime": "8s",
                                      "spark.speculation.efficiency.enabled": "false"}) as spark:
        ks = Steward.get(spark).keyed_state("spec", alignment="unaligned", aligned_checkpoint_timeout=1.0, **opts)
        df = spark.createDataFrame(rows, "k string, v long")
        out = ks.apply_arrow(df, _slow_cut, OUT, checkpoint_id=0).mapInArrow(_dawdle, OUT)
        first = sorted(tuple(r) for r in out.collect())
        ks.commit(0, wait=120)
        tasks = _tasks(spark, ui)
        copies = [t for t in tasks if t.get("speculative")]
        assert copies, f"Spark launched no speculative copy, so this test proves nothing: {tasks}"
        assert {t["host"] for t in tasks if t["index"] == 0 and t["stageId"] == copies[0]["stageId"]} == \
            {"127.0.0.1", "127.0.0.2"}, "the copy runs on the other host"
        winners = {a for _, _, a in first}
        info = ks.info()["checkpoints"][-1]
        deferred = info["rows_deferred"]
    emitted = [(k, v) for k, v, _ in first]
    assert winners == {0}, f"the original attempts' rows reach the result, got attempts {winners}"
    assert 0 < len(emitted) < len(rows) and deferred == len(rows) - len(emitted), \
        f"the copy's ack must keep the original's cut: {len(emitted)} emitted, {deferred} deferred of {len(rows)}"

    with _session(cluster, s3, _free_port()) as spark:   # a new driver re-runs batch 0, then drains
        st = Steward.get(spark)
        ks = st.keyed_state("spec", alignment="unaligned", aligned_checkpoint_timeout=1.0, **opts)
        rerun = ks.apply_arrow(spark.createDataFrame(rows, "k string, v long"), _slow_cut, OUT, checkpoint_id=0)
        again = sorted((k, v) for k, v, _ in rerun.collect())
        assert ks.commit(0, wait=120) == 0   # the re-run keeps the first result
        assert again == sorted(emitted), "a re-run follows the recorded cut, whatever its own clock says"
        ks = st.keyed_state("spec", alignment="aligned", **opts)
        drained = ks.apply_arrow(spark.createDataFrame(rows.iloc[:0], "k string, v long"), _slow_cut, OUT,
                                 checkpoint_id=1)
        rest = [(k, v) for k, v, _ in drained.collect()]
        ks.commit(1, wait=120)
    assert sorted(emitted + rest) == every, "every input row emitted exactly once across the batch and the drain"


def _count_into_value(keys, rows, state):
    """Count per key into a declared value with one bulk put, large enough to go in as an ingested SST
    (decision 0023); one output row per key with the new count."""
    import pyarrow as pa
    import pyarrow.compute as pc

    g = rows.group_by("k").aggregate([("v", "count")]).combine_chunks()
    n = state.value("n")
    old = n.get_many(g["k"])
    new = pc.add(pc.if_else(pc.is_valid(old), old, 0), g["v_count"]).combine_chunks()
    n.put_many(g["k"], new)
    return pa.table({"k": g["k"], "n": new})


def test_a_speculative_copy_of_a_batch_that_ingests_its_puts_counts_once(cluster, s3):
    """Both attempts of a speculated subtask write their batch as an ingested SST in their own work dir
    on their own host and ack; the checkpoint takes one of them. The state counts every row once, a
    second batch builds on it, and the output has one row per key."""
    import numpy as np
    import pandas as pd
    from sparksteward import value_state

    rng = np.random.default_rng(23)
    rows = pd.DataFrame({"k": [f"key-{k}" for k in rng.integers(0, 40_000, 40_000)], "v": 1})
    want = rows["k"].value_counts().to_dict()
    ui = _free_port()
    with _session(cluster, s3, ui, **{"spark.speculation": "true", "spark.speculation.interval": "100ms",
                                      "spark.speculation.quantile": "0.5", "spark.speculation.multiplier": "1.0",
                                      "spark.speculation.minTaskRuntime": "8s",
                                      "spark.speculation.efficiency.enabled": "false",
                                      "spark.sql.execution.arrow.maxRecordsPerBatch": "10000"}) as spark:
        ks = Steward.get(spark).keyed_state("spec-ingest", key="k", parallelism=2, max_parallelism=16,
                                            checkpoint_dir=s3.url("spec-ingest-chk"), states=[value_state("n", "bigint")])
        out = ks.apply_arrow(spark.createDataFrame(rows), _count_into_value, "k string, n long",
                             checkpoint_id=0).mapInArrow(_dawdle, "k string, n long")
        first = {r.k: r.n for r in out.collect()}
        ks.commit(0, wait=120)
        tasks = _tasks(spark, ui)
        copies = [t for t in tasks if t.get("speculative")]
        assert copies, f"Spark launched no speculative copy, so this test proves nothing: {tasks}"
        stats = next(c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == 0)
        assert all(n > 10_000 for n in stats["entries_ingested"]), stats
        assert first == want
        again = {r.k: r.n for r in ks.apply_arrow(spark.createDataFrame(rows), _count_into_value,
                                                   "k string, n long", checkpoint_id=1).collect()}
        ks.commit(1, wait=120)
        assert again == {k: 2 * n for k, n in want.items()}
        assert {r.key: r.value for r in ks.read("n", distributed=True).collect()} == again
