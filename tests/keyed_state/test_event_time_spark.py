"""Event time in Spark (issue 38 slice 1, decision 0028), on local-cluster[2,1,1024]: the function sees the
watermark the batches before chose, late rows are dropped and counted in the checkpoint's report (or
handed over flagged), a re-run and a re-delivery of a batch run with the same watermark however late
they come, and an input without the event-time column is refused before anything begins."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward import Steward, value_state
from sparksteward.errors import StateEncodingError, StateSchemaError

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

T = 1_800_000_000_000   # event times in epoch ms
OUT = "k string, n long, wm long"


def _count(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    return pd.DataFrame({"k": [key], "n": [n], "wm": [-1 if state.watermark_ms is None else state.watermark_ms]})


def _df(spark, rows):
    return spark.createDataFrame(
        [(k, dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc), 1) for k, ms in rows],
        "k string, ts timestamp, v long")


def _rows(out):
    return sorted((r.k, r.n, r.wm) for r in out.collect())


def test_late_rows_are_dropped_and_counted_and_every_delivery_sees_one_watermark(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"ev{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16,
                        event_time="ts", watermark_delay=dt.timedelta(seconds=10))
    first = _df(spark, [(k, T + 5000 * i) for i, k in enumerate("abcdefg")])   # up to T+30 s
    assert _rows(ks.apply(first, _count, OUT, checkpoint_id=0)) == [(k, 1, -1) for k in "abcdefg"]
    ks.commit(0, wait=60)
    report = ks.report(checkpoint_id=0)
    assert report["late_rows"] == 0 and report["max_event_ms"] == T + 30_000 and "watermark_ms" not in report

    # the watermark of batch 1 is T+30 s - 10 s: T+20 s and T+5 ms are late (at or below it)
    second = _df(spark, [("a", T + 20_000), ("b", T + 20_001), ("c", T + 5), ("h", T + 40_000)])
    expected = [("b", 2, T + 20_000), ("h", 1, T + 20_000)]
    assert _rows(ks.apply(second, _count, OUT, checkpoint_id=1)) == expected
    ks.abort(1)   # the sink failed: the batch is delivered again, later by the wall clock
    time.sleep(1.0)
    assert _rows(ks.apply(second, _count, OUT, checkpoint_id=1)) == expected
    ks.commit(1, wait=60)
    report = ks.report(checkpoint_id=1)
    assert (report["late_rows"], report["watermark_ms"], report["max_event_ms"]) == (2, T + 20_000, T + 40_000)
    meta = ks.info()["latest"]
    assert meta["properties"]["time"]["watermark_ms"] == T + 20_000
    assert meta["properties"]["event_time"] == {"column": "ts", "delay_ms": 10_000}
    # the driver died after the commit, before Spark recorded the batch: the re-run keeps it all
    assert _rows(ks.apply(second, _count, OUT, checkpoint_id=1)) == expected
    ks.commit(1, wait=60)

    # opened again with no delay: batch 2's watermark is batch 1's largest event time, T+40 s
    again = st.keyed_state(ks.name, key="k", parallelism=2, max_parallelism=16, event_time="ts", watermark_delay=0)
    third = _df(spark, [("a", T + 30_000), ("a", T + 40_001)])
    assert _rows(again.apply(third, _count, OUT, checkpoint_id=2)) == [("a", 2, T + 40_000)]
    again.commit(2, wait=60)
    assert again.report(checkpoint_id=2)["late_rows"] == 1
    # opened again with a minute's delay: T+40.001 s - 60 s is behind, and the watermark never goes back
    later = st.keyed_state(ks.name, key="k", parallelism=2, max_parallelism=16, event_time="ts", watermark_delay=60)
    fourth = _df(spark, [("a", T + 40_000), ("b", T + 50_000)])
    assert _rows(later.apply(fourth, _count, OUT, checkpoint_id=3)) == [("b", 3, T + 40_000)]
    later.commit(3, wait=60)


def test_late_rows_kept_reach_the_arrow_form_flagged_and_epoch_ms_columns_work(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"evk{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16,
                        event_time="at", watermark_delay=0, late="keep")

    def flagged(keys, rows, state):
        late = rows.column("__late")
        return pa.table({"k": rows.column("k"), "late": late,
                         "wm": pa.array([state.watermark_ms or -1] * rows.num_rows, pa.int64())})

    schema = "k string, late boolean, wm long"
    df0 = spark.createDataFrame([("a", T), ("b", T + 10)], "k string, at long")
    assert sorted(r.late for r in ks.apply_arrow(df0, flagged, schema, checkpoint_id=0).collect()) == [False, False]
    ks.commit(0, wait=60)
    df1 = spark.createDataFrame([("a", T + 10), ("b", T + 11), ("c", None)], "k string, at long")
    got = sorted((r.k, r.late, r.wm) for r in ks.apply_arrow(df1, flagged, schema, checkpoint_id=1).collect())
    assert got == [("a", True, T + 10), ("b", False, T + 10), ("c", False, T + 10)]   # a null is never late
    ks.commit(1, wait=60)
    assert ks.report(checkpoint_id=1)["late_rows"] == 1


def test_an_input_without_the_event_time_column_or_with_a_timeless_one_is_refused_first(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"eve{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16, event_time="ts")
    with pytest.raises(StateEncodingError, match=r"event-time column 'ts' of keyed state .* does not exist; "
                                                 r"the DataFrame has columns \['k', 'v'\]"):
        ks.apply(spark.createDataFrame([("a", 1)], "k string, v long"), _count, OUT, checkpoint_id=0)
    with pytest.raises(StateEncodingError, match=r"event-time column 'ts' .* is string: it must be a timestamp"):
        ks.apply(spark.createDataFrame([("a", "2027")], "k string, ts string"), _count, OUT, checkpoint_id=0)
    assert ks.info()["applied"] and ks.info()["pending"] == []   # nothing began
    with pytest.raises(StateSchemaError, match=r"state variables \['seen'\] of keyed state 'evx' expire by event "
                                               r"time, which needs a watermark: name the event-time column"):
        st.keyed_state("evx", key="k", parallelism=2, states=[value_state("seen", "bigint", ttl=9, ttl_time="event")])


def test_event_time_ttl_expires_old_events_by_the_watermark_across_a_rescale(cluster_spark):
    """A replay of old events (2017) at today's processing time: entries that expire by event time survive
    a rescale's restore (which leaves out only what expired on both clocks) and expire when the
    watermark passes them, swept in that batch."""
    spark = cluster_spark
    st = Steward.get(spark)
    old = 1_500_000_000_000
    name = f"evt{uuid.uuid4().hex[:6]}"
    specs = [value_state("last", "bigint", ttl=60, ttl_time="event")]

    def opened(p):
        return st.keyed_state(name, key="k", parallelism=p, max_parallelism=16, event_time="ts", states=specs)

    def seen(key, rows, state):
        had = state.value("last").get()
        state.value("last").update(int(rows["v"].max()))
        return pd.DataFrame({"k": [key], "had": [-1 if had is None else had]})

    def run(ks, cid, rows):
        out = sorted((r.k, r.had) for r in ks.apply(_df(spark, rows), seen, "k string, had long", cid).collect())
        ks.commit(cid, wait=60)
        return out

    keys = list("abcdefgh")
    ks = opened(2)
    run(ks, 0, [(k, old) for k in keys])                       # no watermark: stamped by the processing time
    assert run(ks, 1, [(k, old + 30_000) for k in keys]) == [(k, 1) for k in keys]   # at watermark old
    ks = opened(3)                                              # rescaled: entries expire at old + 60 s
    assert run(ks, 2, [("z", old + 40_000)]) == [("z", -1)]    # at watermark old + 30 s
    assert sorted(r.key for r in ks.read("last").collect()) == [*keys, "z"]
    assert run(ks, 3, [("z", old + 200_000)]) == [("z", 1)]    # at old + 40 s: all alive
    assert run(ks, 4, [("a", old + 201_000)]) == [("a", -1)]   # at old + 200 s: a..h and z (old + 100 s) expired
    assert ks.report(checkpoint_id=4)["ttl_expired_removed"] == 8   # a was written again in the batch
    assert [r.key for r in ks.read("last").collect()] == ["a"]
