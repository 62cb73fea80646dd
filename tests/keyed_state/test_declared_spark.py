"""Declared keyed states in Spark, on local-cluster[2,1,1024]: a value, a list and a map state in both
forms agree with pandas across batches on two executors; a batch applied twice and a retried task
leave the state as one run would; a TTL expires state between batches and the sweep removes it; a
declaration that changes is evolved or refused by name when the state is opened again."""

from __future__ import annotations

import time

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from sparksteward import Steward, list_state, map_state, value_state
from sparksteward.errors import StateSchemaError

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

OUT = "k string, n long, events long, distinct long"


def _specs(ttl=None):
    return [value_state("count", "bigint", ttl=ttl), list_state("events", "bigint", ttl=ttl),
            map_state("seen", "bigint", "bigint", ttl=ttl)]


def per_key(key, rows, state):
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if rows["v"].iloc[0] == -1 and ctx.attemptNumber() == 0:   # the marked batch's first attempt fails here
        raise RuntimeError("first attempt fails on purpose")
    count = state.value("count")
    n = (count.get() or 0) + len(rows)
    count.update(n)
    events = state.list("events")
    events.extend(int(v) for v in rows["v"])
    seen = state.map("seen")
    for v in rows["v"]:
        seen.put(int(v), (seen.get(int(v)) or 0) + 1)
    return pd.DataFrame({"k": [key], "n": [n], "events": [len(events.get())], "distinct": [len(seen.keys())]})


def vectorized(keys, rows, state):
    counts = rows.group_by("k").aggregate([("v", "count")])
    ks = counts["k"]
    n = pc.add(pc.fill_null(state.value("count").get_many(ks), 0), counts["v_count"])
    state.value("count").put_many(ks, n)
    state.list("events").append_many(rows["k"], rows["v"])
    state.map("seen").put_many(rows["k"], rows["v"], pa.array([1] * rows.num_rows, pa.int64()))
    events = state.list("events").get_many(ks)
    maps = state.map("seen").items_many(ks)
    return pa.table({"k": ks, "n": n, "events": pc.list_value_length(events).cast(pa.int64()),
                     "distinct": pa.array([len(m) for m in maps.to_pylist()], pa.int64())})


def _batches(count=3):
    import random

    rnd = random.Random(20)
    return [pd.DataFrame({"k": [f"u{rnd.randrange(12)}" for _ in range(200)],
                          "v": [rnd.randrange(30) for _ in range(200)]}) for _ in range(count)]


def _expected(batches):
    allrows = pd.concat(batches)
    last = set(batches[-1]["k"])
    return {k: (len(g), len(g), g["v"].nunique()) for k, g in allrows.groupby("k") if k in last}


@pytest.fixture(scope="module")
def spark(cluster_spark, tmp_path_factory):
    return cluster_spark, tmp_path_factory.mktemp("declared")


@pytest.mark.parametrize("form", ["pandas", "arrow"])
def test_value_list_and_map_state_in_both_forms_across_executors(spark, form):
    spark, tmp = spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"declared-{form}", key="k", parallelism=4, max_parallelism=32,
                        checkpoint_dir=str(tmp / "chk"), states=_specs())
    fn = per_key if form == "pandas" else vectorized
    batches = _batches()
    for i, b in enumerate(batches):
        out = ks.apply(spark.createDataFrame(b), fn, OUT, checkpoint_id=i) if form == "pandas" else \
            ks.apply_arrow(spark.createDataFrame(b), fn, OUT, checkpoint_id=i)
        rows = out.collect()
        if i == 1:   # a second action on the same batch: the same base, the same output
            assert sorted(out.collect()) == sorted(rows)
        ks.commit(i, wait=120)
    assert {r.k: (r.n, r.events, r.distinct) for r in rows} == _expected(batches)


def test_a_retried_task_leaves_the_state_as_one_run_would(spark):
    spark, tmp = spark
    st = Steward.get(spark)
    ks = st.keyed_state("declared-retry", key="k", parallelism=2, max_parallelism=32,
                        checkpoint_dir=str(tmp / "chk"), states=_specs())
    batches = _batches(2)
    batches[1].loc[batches[1].index[0], "v"] = -1   # the subtask of that key fails once, then Spark retries it
    for i, b in enumerate(batches):
        rows = ks.apply(spark.createDataFrame(b), per_key, OUT, checkpoint_id=i).collect()
        ks.commit(i, wait=120)
    expected = _expected(batches)
    assert {r.k: (r.n, r.events, r.distinct) for r in rows} == expected


def test_a_ttl_expires_state_between_batches_and_the_sweep_removes_it(spark):
    spark, tmp = spark
    st = Steward.get(spark)
    ks = st.keyed_state("declared-ttl", key="k", parallelism=2, max_parallelism=32,
                        checkpoint_dir=str(tmp / "chk"), states=_specs(ttl=1.5))
    first = pd.DataFrame({"k": ["a", "b", "c"], "v": [1, 2, 3]})
    ks.apply(spark.createDataFrame(first), per_key, OUT, checkpoint_id=0).collect()
    ks.commit(0, wait=120)
    time.sleep(2.0)
    second = pd.DataFrame({"k": ["a", "d"], "v": [4, 5]})
    rows = ks.apply(spark.createDataFrame(second), per_key, OUT, checkpoint_id=1).collect()
    ks.commit(1, wait=120)
    assert {r.k: (r.n, r.events, r.distinct) for r in rows} == {"a": (1, 1, 1), "d": (1, 1, 1)}
    removed = ks.info()["checkpoints"][-1]["ttl_expired_removed"]
    # batch 0's value, list element and map entry of b and c, and the element and entry of a (whose value
    # batch 1 wrote again before the sweep: its old index key is stale, the value lives on)
    assert removed == 8, ks.info()["checkpoints"][-1]


def test_a_changed_declaration_is_evolved_or_refused_by_name(spark):
    spark, tmp = spark
    st = Steward.get(spark)
    chk = str(tmp / "chk")
    old = st.keyed_state("declared-evolve", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk,
                         states=[value_state("last", "v int, note string")])

    def keep_last(key, rows, state):
        state.value("last").update({"v": int(rows["v"].iloc[-1]), "note": "x"})
        return pd.DataFrame({"k": [key], "v": [int(rows["v"].iloc[-1])]})

    old.apply(spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [7]})), keep_last, "k string, v long",
              checkpoint_id=0).collect()
    old.commit(0, wait=120)
    with pytest.raises(StateSchemaError, match=r"'last' cannot be read as declared: .* field 'v' changed from "
                                               r"int32 to string"):
        st.keyed_state("declared-evolve", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk,
                       states=[value_state("last", "v string")])
    new = st.keyed_state("declared-evolve", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk,
                         states=[value_state("last", "v bigint, w double")])   # widen v, drop note, add w

    def read_last(key, rows, state):
        last = state.value("last").get()
        return pd.DataFrame({"k": [key], "last": [str(last)]})

    rows = new.apply(spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1]})), read_last, "k string, last string",
                     checkpoint_id=1).collect()
    new.commit(1, wait=120)
    assert [r.last for r in rows] == [str({"v": 7, "w": None})]
    assert new.states["variables"]["last"]["current"] == 2


def test_read_returns_every_declared_variable_locally_and_distributed(spark):
    spark, tmp = spark
    st = Steward.get(spark)
    chk = str(tmp / "chk")
    ks = st.keyed_state("declared-read", key="k", parallelism=3, max_parallelism=32, checkpoint_dir=chk,
                        states=_specs())
    batches = _batches(2)
    for i, b in enumerate(batches):
        ks.apply(spark.createDataFrame(b), per_key, OUT, checkpoint_id=i).collect()
        ks.commit(i, wait=120)
    allrows = pd.concat(batches)
    fresh = st.keyed_state("declared-read", key="k", parallelism=3, max_parallelism=32, checkpoint_dir=chk)
    for distributed in (False, True):     # a KeyedState never applied reads the latest checkpoint too
        counts = {r.key: r.value for r in fresh.read("count", distributed=distributed).collect()}
        assert counts == allrows.groupby("k").size().to_dict()
        events = fresh.read("events", distributed=distributed).collect()
        by_key: dict = {}
        for r in events:
            by_key.setdefault(r.key, []).append(r.value)
        for k, got in by_key.items():   # batch 0's elements, then batch 1's (within a batch, Spark's order)
            first = batches[0][batches[0]["k"] == k]["v"].tolist()
            second = batches[1][batches[1]["k"] == k]["v"].tolist()
            assert sorted(got[:len(first)]) == sorted(first) and sorted(got[len(first):]) == sorted(second)
        assert set(by_key) == set(allrows["k"])
        seen = {(r.key, r.map_key): r.value for r in fresh.read("seen", distributed=distributed).collect()}
        assert seen == {(k, v): n for (k, v), n in allrows.groupby(["k", "v"]).size().items()}
    assert fresh.read("events").schema.simpleString() == "struct<key:string,value:bigint>"
    with pytest.raises(Exception, match="no declared variable 'nope'; declared: count .value., events .list., "
                                        "seen .map."):
        fresh.read("nope")


def test_a_typed_default_across_executors_and_a_json_default_refusing_it(spark):
    """Decision 0027: value_state("value", ...) types the default value state from a state's first
    checkpoint (the Arrow form's get_many gives an Arrow struct array), kept when the state is opened
    again without declarations; a state whose checkpoints hold JSON defaults refuses it by name."""
    spark, tmp = spark
    st = Steward.get(spark)
    chk = str(tmp / "chk")

    def typed(keys, rows, state):
        g = rows.group_by("k").aggregate([("v", "count"), ("v", "sum")]).combine_chunks()
        old = state.get_many(g["k"])
        n = pc.add(pc.fill_null(pc.struct_field(old, "n"), 0), g["v_count"]).combine_chunks()
        s = pc.add(pc.fill_null(pc.struct_field(old, "s"), 0), g["v_sum"]).combine_chunks()
        state.put_many(g["k"], pa.StructArray.from_arrays([n, s], names=["n", "s"]))
        return pa.table({"k": g["k"], "n": n, "s": s})

    batches = _batches()
    for i, b in enumerate(batches):
        ks = st.keyed_state("typed-default", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=chk,
                            states=[value_state("value", "n bigint, s bigint")] if i == 0 else None)
        rows = ks.apply_arrow(spark.createDataFrame(b), typed, "k string, n long, s long", checkpoint_id=i).collect()
        ks.commit(i, wait=120)
    allrows = pd.concat(batches)
    assert {r.k: (r.n, r.s) for r in rows} == {k: (len(g), int(g["v"].sum())) for k, g in allrows.groupby("k")
                                               if k in set(batches[-1]["k"])}
    assert ks.states["variables"]["value"]["current"] == 1
    got = {r.key: (r.value.n, r.value.s) for r in ks.read("value").collect()}
    assert got == {k: (len(g), int(g["v"].sum())) for k, g in allrows.groupby("k")}

    untyped = st.keyed_state("json-default", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk)
    untyped.apply(spark.createDataFrame(batches[0]), lambda key, rows, state: state.update([len(rows)]),
                  "k string", checkpoint_id=0).collect()
    untyped.commit(0, wait=120)
    with pytest.raises(StateSchemaError, match=r"keyed state 'json-default': its default value state is untyped "
                                               r"\(JSON\) in the checkpoints it has"):
        st.keyed_state("json-default", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk,
                       states=[value_state("value", "bigint")])
