"""Timers in Spark (issue 38 slice 2, decision 0028), on local-cluster[2,1,1024]: event-time timers registered
by 40 keys fire once each, after the input, for keys with and without input, across rescales
(8 -> 3 -> 5) between registration and firing; a deleted timer never fires; a re-delivered batch, a
re-run after the commit and a retried task emit a timer's output as one run would."""

from __future__ import annotations

import datetime as dt
import uuid

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward import Steward

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

T = 1_800_000_000_000
OUT = "k string, what string, at long"


def arm(key, rows, state):
    if (rows["v"] == -1).any():   # cancel: delete every timer of the key
        for t in state.timers.list():
            state.timers.delete(t.at, t.time)
        return pd.DataFrame({"k": [key], "what": ["cancelled"], "at": [len(state.timers.list())]})
    at = int(rows["ts"].max().timestamp() * 1000) + 10_000
    state.timers.register(at, time="event")
    return None


def fired(key, timers, state):
    from pyspark import TaskContext

    if key == "k30" and TaskContext.get().attemptNumber() == 0:
        raise RuntimeError("the first attempt of k30's timer fails on purpose")
    return pd.DataFrame({"k": [key] * len(timers), "what": ["fired"] * len(timers), "at": [t.at for t in timers]})


def _df(spark, rows):
    return spark.createDataFrame(
        [(k, dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc), v) for k, ms, v in rows],
        "k string, ts timestamp, v long")


def test_event_timers_fire_once_across_rescales_redeliveries_reruns_and_retries(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    name = f"tm{uuid.uuid4().hex[:6]}"

    def opened(p):
        return st.keyed_state(name, key="k", parallelism=p, max_parallelism=32, event_time="ts")

    def run(ks, cid, rows, commit=True):
        out = sorted((r.k, r.what, r.at) for r in ks.apply(_df(spark, rows), arm, OUT, cid, on_timer=fired).collect())
        if commit:
            ks.commit(cid, wait=60)
        return out

    emitted = []
    ks = opened(8)
    assert run(ks, 0, [(f"k{i}", T + 1000 * i, 1) for i in range(40)]) == []   # timers at T + 10 s + i s
    assert ks.report(checkpoint_id=0)["timers_fired"] == 0

    ks = opened(3)   # rescaled; this batch runs at watermark T + 39 s: k0..k29 due, k0..k4 cancel first
    cancel = [(f"k{i}", T + 40_000, -1) for i in range(5)]
    first = run(ks, 1, cancel, commit=False)
    ks.abort(1)      # the sink failed: the batch is delivered again
    assert run(ks, 1, cancel) == first
    expected = sorted([(f"k{i}", "cancelled", 0) for i in range(5)] +
                      [(f"k{i}", "fired", T + 10_000 + 1000 * i) for i in range(5, 30)])
    assert first == expected
    assert run(ks, 1, cancel) == first   # a re-run after the commit: the same rows, the first result kept
    assert ks.report(checkpoint_id=1)["timers_fired"] == 25
    emitted += first

    ks = opened(5)   # rescaled again; at T + 40 s k30's timer is due: its first attempt fails, the retry fires it
    emitted += run(ks, 2, [("z", T + 100_000, 1)])
    emitted += run(ks, 3, [])   # no input at all: at T + 100 s, k31..k39 fire
    emitted += run(ks, 4, [])   # at T + 100 s again: nothing left but z's (T + 110 s)
    fired_keys = [k for k, what, _ in emitted if what == "fired"]
    assert sorted(fired_keys) == sorted(f"k{i}" for i in range(5, 40)), "every timer fires exactly once"
    assert ks.report(checkpoint_id=3)["timers_fired"] == 9 and ks.report(checkpoint_id=4)["timers_fired"] == 0


def test_the_arrow_form_fires_processing_timers_for_keys_without_input(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tma{uuid.uuid4().hex[:6]}", key="k", parallelism=4, max_parallelism=16)

    def arm_all(keys, rows, state):
        state.timers.register(keys, state.processing_time_ms)   # due at once: fires in this batch

    def fired_all(keys, expired, state):
        return pa.table({"k": expired.column("key"), "n": pa.array([len(keys)] * expired.num_rows, pa.int64())})

    df = spark.createDataFrame([(f"u{i}",) for i in range(30)], "k string")
    out = ks.apply_arrow(df, arm_all, "k string, n long", 0, on_timer=fired_all).collect()
    ks.commit(0, wait=60)
    assert sorted(r.k for r in out) == sorted(f"u{i}" for i in range(30))
    assert sum(1 for r in out if r.n > 0) == 30
    empty = spark.createDataFrame([], "k string")
    assert ks.apply_arrow(empty, arm_all, "k string, n long", 1, on_timer=fired_all).collect() == []
    ks.commit(1, wait=60)
