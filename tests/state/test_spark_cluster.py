"""Keyed state on local-cluster[2,1,1024] (issue 8): the state continues across batches whose subtasks
run on different executors (each executor agent restores from the shared checkpoint dir)."""

from __future__ import annotations

import pandas as pd
import pytest

from sparksteward import Steward
from tests.helpers.keyed import make_batches, reference, state_of

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
