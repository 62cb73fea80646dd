"""Issue 39, the savepoint writer (:mod:`sparksteward.state_writer`) on the shared local[2] session:
a savepoint bootstrapped from DataFrames (value with TTL, list, map, timers) reads back exactly,
restores at another parallelism and goes on with exact values; one derived from it with a variable
transformed and another max parallelism restores exactly; bad input is refused by name with nothing
written (cross-host, on S3: tests/keyed_state/test_state_offline_cluster.py)."""

from __future__ import annotations

import collections
import os

import pandas as pd
import pytest
from sparksteward import Steward, list_state, map_state, value_state
from sparksteward.errors import CheckpointError, StateError, StateSchemaError

from tests.helpers.keyed import declared_count_events

pytestmark = pytest.mark.slow

SPECS = [value_state("count", "bigint", ttl=3600.0), list_state("events", "bigint"),
         map_state("seen", "bigint", "bigint")]
OUT = "k string, n long, events long, distinct long"
N = 20_000


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture(scope="module")
def boot(spark, tmp_path_factory):
    """A savepoint of N keys written from DataFrames, and what it holds."""
    st = Steward.get(spark)
    root = tmp_path_factory.mktemp("writer")
    counts = spark.range(N).selectExpr("concat('u', id) AS key", "id % 7 AS value")
    events = spark.range(300).selectExpr("concat('u', id % 10) AS key", "id AS value")
    seen = spark.range(40).selectExpr("concat('u', id % 10) AS key", "id AS map_key", "id * 2 AS value")
    timers = spark.createDataFrame([("u1", "processing", 4_000_000_000_000)], "key string, time_domain string, "
                                   "timestamp_ms bigint")
    url = f"file://{root}/sp/boot-1"
    written = st.write_savepoint(url, state="boot", states=SPECS, parallelism=3, max_parallelism=16,
                                 data={"count": counts, "events": events, "seen": seen, "__timers__": timers})
    assert written == f"{root}/sp/boot-1/_metadata"
    return st, root, url


@pytest.mark.compat   # the writer routes rows by repartitionById on 4.1+, by the routing values on 4.0
def test_a_bootstrapped_savepoint_reads_back_exactly(spark, boot):
    st, _, url = boot
    count = st.read_state(url=url, variable="count", expiry=True)
    assert count.rdd.getNumPartitions() == 2   # 3 subtasks in local[2]'s 2 tasks
    rows = count.collect()
    assert {r.key: r.value for r in rows} == {f"u{i}": i % 7 for i in range(N)}
    assert len({r.expires_ms for r in rows}) == 1 and rows[0].expires_ms > 0   # the write's time plus the TTL
    events = collections.defaultdict(list)
    for r in st.read_state(url=url, variable="events").collect():
        events[r.key].append(r.value)
    assert dict(events) == {f"u{k}": list(range(k, 300, 10)) for k in range(10)}   # in the DataFrame's order
    assert {(r.key, r.map_key): r.value for r in st.read_state(url=url, variable="seen").collect()} == \
        {(f"u{i % 10}", i): i * 2 for i in range(40)}
    assert [tuple(r) for r in st.read_state(url=url, variable="__timers__").collect()] == \
        [("u1", "processing", 4_000_000_000_000)]
    meta = st.read_state(url=url, metadata=True).collect()
    assert [(m.checkpoint_id, m.parallelism, m.max_parallelism, m.key_type) for m in meta] == [(0, 3, 16, "string")]


def test_it_restores_at_another_parallelism_and_goes_on_exactly(spark, boot, tmp_path):
    st, _, url = boot
    ks = st.keyed_state("boot-on", key="k", parallelism=5, max_parallelism=16, checkpoint_dir=str(tmp_path / "chk"),
                        restore_from=url, states=SPECS)
    batch = pd.DataFrame({"k": ["u1", "u3", "u3", "new"], "v": [1, 2, 1, 5]})
    out = {r.k: r for r in ks.apply(spark.createDataFrame(batch), declared_count_events, OUT, checkpoint_id=0).collect()}
    ks.commit(0, wait=60)
    # count goes on from the bootstrapped value; the lists get the rows after the 30 written ones
    assert {k: (r.n, r.events) for k, r in out.items()} == {"u1": (1 % 7 + 1, 31), "u3": (3 % 7 + 2, 32), "new": (1, 1)}
    events = [r.value for r in ks.read("events").collect() if r.key == "u3"]
    assert events == [*range(3, 300, 10), 2, 1]
    assert {r.key: r.value for r in ks.read("count").collect()} == {
        **{f"u{i}": i % 7 for i in range(N)}, "u1": 2, "u3": 5, "new": 1}


def test_a_derived_savepoint_changes_max_parallelism_and_transforms_a_variable(spark, boot, tmp_path):
    st, root, url = boot
    before = _files(root / "sp" / "boot-1")
    derived = f"file://{tmp_path}/sp/boot-2"
    st.derive_savepoint(derived, source=url, max_parallelism=64, parallelism=2, drop=["seen"],
                        transform={"count": lambda df: df.withColumn("value", df.value * 10)})
    assert _files(root / "sp" / "boot-1") == before   # the source is only read
    assert [tuple(r) for r in st.read_state(url=derived, variable="__timers__").collect()] == \
        [("u1", "processing", 4_000_000_000_000)]   # the timers go with their key, to its new key group
    meta = st.read_state(url=derived, metadata=True).collect()[0]
    assert (meta.parallelism, meta.max_parallelism) == (2, 64) and "seen" not in meta.variables
    assert {r.key: r.value for r in st.read_state(url=derived, variable="count").collect()} == \
        {f"u{i}": (i % 7) * 10 for i in range(N)}
    ks = st.keyed_state("boot-64", key="k", parallelism=4, max_parallelism=64, checkpoint_dir=str(tmp_path / "chk"),
                        restore_from=derived, states=SPECS[:2] + [map_state("seen", "bigint", "bigint")])
    got = ks.apply(spark.createDataFrame(pd.DataFrame({"k": ["u9"], "v": [7]})), declared_count_events, OUT,
                   checkpoint_id=0).collect()
    assert [(r.n, r.events, r.distinct) for r in got] == [(9 % 7 * 10 + 1, 31, 1)]
    ks.commit(0, wait=60)
    # the transformed TTL kept each entry's expiry
    assert {r.expires_ms for r in st.read_state(url=derived, variable="count", expiry=True).collect()} == \
        {r.expires_ms for r in st.read_state(url=url, variable="count", expiry=True).collect()}


def test_bad_input_is_refused_by_name_and_nothing_is_written(spark, boot, tmp_path):
    st, root, url = boot
    target = tmp_path / "sp" / "bad"
    good = spark.range(10).selectExpr("concat('u', id) AS key", "id AS value")

    def refused(error, match, **kw):
        args = {"state": "bad", "states": SPECS, "parallelism": 2, "max_parallelism": 16, "data": {"count": good}, **kw}
        with pytest.raises(error, match=match):
            st.write_savepoint(kw.pop("url", f"file://{target}"), **{k: v for k, v in args.items() if k != "url"})
        assert not target.exists() or _files(target) == []

    refused(StateSchemaError, r"data for variable 'nope', which is not declared", data={"nope": good})
    refused(StateSchemaError, r"'count' \(value\) has columns \['key', 'v'\]; it needs \['key', 'value'\]",
            data={"count": good.withColumnRenamed("value", "v")})
    refused(StateSchemaError, r"column 'value' is string but must be bigint .*cast\('bigint'\)",
            data={"count": good.selectExpr("key", "cast(value AS string) AS value")})
    refused(StateSchemaError, r"has expires_ms, but 'events' is declared without a TTL",
            data={"events": good.selectExpr("key", "value", "1L AS expires_ms")})
    refused(StateError, r"variable 'count' has key 'u3' twice in the data",
            data={"count": good.union(good.filter("key = 'u3'"))})
    refused(CheckpointError, r"lies inside .*boot-1, which holds a _metadata", url=f"file://{root}/sp/boot-1/inner")
    st.keyed_state("bad-live", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(tmp_path / "live")).apply(
        spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1]})), declared_count_events, OUT, checkpoint_id=0)
    refused(CheckpointError, r"lies inside .*bad-live, which holds a _lease",
            url=f"file://{tmp_path}/live/default/bad-live/sp")
    refused(CheckpointError, r"is not empty", url=f"file://{root}/sp")
    with pytest.raises(CheckpointError, match="overlaps"):
        st.derive_savepoint(url, source=url)
    # a source whose default value state is undeclared (JSON): not silently left out
    js = st.keyed_state("bad-json", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(tmp_path / "js"))

    def plain(key, rows, state):
        state.update((state.get() or 0) + len(rows))
        return key, len(rows)

    js.apply(spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1]})), plain, "k string, n long",
             checkpoint_id=0).collect()
    js.commit(0, wait=60)
    jsp = js.savepoint(str(tmp_path / "jsp" / "bad-json-1"))
    with pytest.raises(StateSchemaError, match=r"undeclared default value state .* drop=\['value'\]"):
        st.derive_savepoint(f"file://{tmp_path}/sp/from-json", source=jsp)
    assert not (tmp_path / "sp" / "from-json").exists()


def _held_at_gate(gate):
    """A mapInPandas function that passes its rows on once ``gate`` exists (at most 120 s)."""
    def wait(batches):
        import time as _time

        deadline = _time.monotonic() + 120
        while not os.path.exists(gate) and _time.monotonic() < deadline:
            _time.sleep(0.05)
        yield from batches
    return wait


def test_two_writes_into_one_target_one_is_refused_and_neither_touches_the_others_files(spark, tmp_path):
    """Two writers on one store: while a write_savepoint is under way (its tasks held at a gate), a second
    one into the same target is refused by name before it runs a task, and deletes nothing; the first
    completes and reads back exactly. A claim left by a writer that died refuses the same way."""
    import threading

    st = Steward.get(spark)
    url = f"file://{tmp_path}/sp/two"
    gate = str(tmp_path / "gate")
    first = spark.range(2_000).selectExpr("concat('u', id) AS key", "id AS value").mapInPandas(
        _held_at_gate(gate), "key string, value bigint")
    args = {"state": "two", "states": [value_state("count", "bigint")], "parallelism": 2, "max_parallelism": 16}
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(url=st.write_savepoint(url, data={"count": first}, **args)))
    t.start()
    try:
        claim = tmp_path / "sp" / "two" / "_writing"
        for _ in range(600):
            if claim.exists():
                break
            t.join(0.05)
        assert claim.exists(), "the first write never claimed its target"
        before = _files(tmp_path / "sp" / "two")
        second = spark.range(5).selectExpr("concat('v', id) AS key", "id AS value")
        with pytest.raises(CheckpointError, match=r"'.*/sp/two' is being written by .* pid \d+ since .*nothing was "
                                                  r"written. Wait for that write or pick another target"):
            st.write_savepoint(url, data={"count": second}, **args)
        assert _files(tmp_path / "sp" / "two") == before
    finally:
        open(gate, "w").close()
        t.join(180)
    assert done["url"].endswith("/sp/two/_metadata")
    assert not claim.exists()
    got = st.read_state(url=url, variable="count").toPandas()
    assert len(got) == 2_000 and set(got["key"]) == {f"u{i}" for i in range(2_000)}
    # a claim whose writer died: refused by name, nothing touched
    dead = tmp_path / "sp" / "dead"
    dead.mkdir()
    (dead / "_writing").write_bytes(b"not json")
    with pytest.raises(CheckpointError, match=r"is being written by another writer .*if that writer died, delete"):
        st.write_savepoint(f"file://{dead}", data={"count": second}, **args)
    assert _files(dead) == ["_writing"]


@pytest.mark.soak   # a million keys on local[2], about a minute: make soak
def test_a_million_keys_bootstrapped_restore_at_another_parallelism_and_go_on_exactly(spark, tmp_path):
    """Must-show 1 at its size: a savepoint of 1M keys from a DataFrame, restored at parallelism 5 (written
    at 8), a batch that touches some of them, and every value exact afterwards (sums and counts over the
    read, the touched keys by name)."""
    st = Steward.get(spark)
    n = 1_000_000
    url = f"file://{tmp_path}/sp/million"
    st.write_savepoint(url, state="million", states=[value_state("count", "bigint")], parallelism=8,
                       max_parallelism=128, data={"count": spark.range(n).selectExpr("concat('u', id) AS key",
                                                                                    "id % 1000 AS value")})
    ks = st.keyed_state("million-on", key="k", parallelism=5, max_parallelism=128, states=[value_state("count", "bigint")],
                        checkpoint_dir=str(tmp_path / "chk"), restore_from=url)

    def add(key, rows, state):
        c = state.value("count")
        c.update((c.get() or 0) + len(rows))
        return pd.DataFrame({"k": [key], "n": [c.get()]})

    touched = pd.DataFrame({"k": ["u0", "u999999", "u123456", "fresh"]})
    got = {r.k: r.n for r in ks.apply(spark.createDataFrame(touched), add, "k string, n long", checkpoint_id=0).collect()}
    ks.commit(0, wait=120)
    assert got == {"u0": 1, "u999999": 1000, "u123456": 457, "fresh": 1}
    totals = ks.read("count", distributed=True).selectExpr("count(*) AS c", "sum(value) AS s").collect()[0]
    assert (totals.c, totals.s) == (n + 1, sum(i % 1000 for i in range(n)) + 4)
