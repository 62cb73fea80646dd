"""Keyed state on local-cluster[2,1,1024] (issue 8): the state continues across batches whose subtasks
run on different executors (each executor agent restores from the shared checkpoint dir)."""

from __future__ import annotations

import pandas as pd
import pytest
from sparksteward import Steward

from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def count_sum_where(key, rows, state):
    from sparksteward.worker import executor_connection

    cur = state.get() or {"n": 0, "s": 0}
    cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
    state.update(cur)
    from pyspark import TaskContext

    executor = executor_connection().request("health")["executor_id"]
    return pd.DataFrame({"k": [key], "n": [cur["n"]], "s": [cur["s"]], "subtask": [TaskContext.get().partitionId()],
                         "executor": [executor]})


@pytest.fixture(scope="module")
def spark(cluster_spark, tmp_path_factory):
    return cluster_spark, tmp_path_factory.mktemp("kstate-cluster")


def test_state_continues_across_executors(spark):
    spark, state = spark
    st = Steward.get(spark)
    ks = st.keyed_state("cluster", key="k", parallelism=4, max_parallelism=32,
                        checkpoint_dir=str(state / "chk"))
    batches = make_batches(7, count=3)
    placements: dict[int, set[str]] = {}
    applied = []
    for i in range(8):  # at least 3 batches; more until some subtask has run on both executors
        b = batches[i % 3].assign(v=batches[i % 3]["v"] + i)
        out = ks.apply(spark.createDataFrame(b), count_sum_where,
                       "k string, n long, s long, subtask int, executor string", checkpoint_id=i)
        for r in out.collect():
            placements.setdefault(r.subtask, set()).add(r.executor)
        ks.commit(i, wait=120)
        applied.append(b)
        if i >= 2 and any(len(e) > 1 for e in placements.values()):
            break
    assert any(len(e) > 1 for e in placements.values()), f"no subtask moved between executors: {placements}"
    assert state_of(ks) == reference(applied)


def test_round_trips_per_batch_at_p8_reuse_the_executor_agents_connections(spark):
    """The requests one keyed-state batch makes to the driver agent at P=8 on two executors, counted
    by the driver agent itself, and its handshakes: the executor agents reuse their connections."""
    spark, state = spark
    st = Steward.get(spark)
    ks = st.keyed_state("round-trips", key="k", parallelism=8, max_parallelism=64,
                        checkpoint_dir=str(state / "rt"))
    run = ks.process(count_sum, SCHEMA, lambda out, cid: out.write.mode("overwrite").parquet(str(state / "rt-out")))
    batches = make_batches(11, count=5)
    for i in range(2):   # warm up: sessions, Python workers, every executor agent's first connection
        run(spark.createDataFrame(batches[i]), i)
    before = st.health()
    n = 3
    for i in range(2, 2 + n):
        run(spark.createDataFrame(batches[i]), i)
    after = st.health()
    per_batch = {op: (count - before["requests"].get(op, 0)) / n for op, count in after["requests"].items()
                 if count > before["requests"].get(op, 0)}
    handshakes = (after["handshakes"] - before["handshakes"]) / n
    print(f"per batch at P=8 on 2 executors: {handshakes:.1f} handshakes, requests "
          + ", ".join(f"{op} {c:g}" for op, c in sorted(per_batch.items())))
    assert per_batch["state.begin"] == 1 and per_batch["state.commit"] == 1
    assert per_batch["state.base"] == 8 and per_batch["state.ack"] == 8   # one per subtask
    assert per_batch.get("state.sealed", 0) <= 2                         # one per executor agent at most
    # a handshake per message before (about 20 per batch); now an idle connection is reused
    assert handshakes <= 2, f"{handshakes} handshakes per batch"
    assert state_of(ks) == reference(batches[:2 + n])
