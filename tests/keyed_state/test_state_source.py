"""Issue 39, first slice: ``spark.read.format("steward-state")`` and ``"steward-state-metadata"`` over a
checkpoint dir, on the shared local[2] session (on moto's S3: tests/keyed_state/test_restore_s3.py): every variable of a declared state read
at two checkpoints matches what the stream's function saw, one partition per subtask, nothing written
into the source, and bad paths, states, checkpoint ids and variables named."""

from __future__ import annotations

import collections
import json

import pandas as pd
import pytest
from sparksteward import Steward, list_state, map_state, value_state

from tests.helpers.keyed import declared_count_events

pytestmark = pytest.mark.slow

OUT = "k string, n long, events long, distinct long"


def _batches():
    import random

    rnd = random.Random(39)
    return [pd.DataFrame({"k": [f"u{rnd.randrange(30)}" for _ in range(200)], "v": [rnd.randrange(20) for _ in range(200)]})
            for _ in range(2)]


def _expected(batches):
    count: dict[str, int] = collections.Counter()
    events: dict[str, list[int]] = collections.defaultdict(list)
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for b in batches:
        for k, v in zip(b["k"], b["v"]):
            count[k] += 1
            events[k].append(int(v))
            seen[k][int(v)] += 1
    return dict(count), {k: sorted(v) for k, v in events.items()}, {k: dict(c) for k, c in seen.items()}


def _frozen(src, dst):
    """A copy of the checkpoint dir ``src`` that no writer touches: the state's application keeps renewing
    its lease and may seal merged files after a commit returns, so "nothing written into the source" is
    checked on a copy only the reads open."""
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _files(root):
    import os

    return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.compat   # the Python data source API of every pyspark 4.x we test
def test_every_variable_reads_back_at_two_checkpoints_and_the_source_is_untouched(spark, tmp_path):
    st = Steward.get(spark)
    chk = str(tmp_path / "chk")
    ks = st.keyed_state("src", key="k", parallelism=3, max_parallelism=16, checkpoint_dir=chk, num_retained=2,
                        states=[value_state("count", "bigint"), list_state("events", "bigint"),
                                map_state("seen", "bigint", "bigint")])
    batches = _batches()
    for i, b in enumerate(batches):
        ks.apply(spark.createDataFrame(b), declared_count_events, OUT, checkpoint_id=i).collect()
        ks.commit(i, wait=60)
    chk = _frozen(chk, tmp_path / "frozen")
    before = _files(chk)

    def read(variable, checkpoint_id=None):
        reader = spark.read.format("steward-state").option("state", "src").option("variable", variable)
        if checkpoint_id is not None:
            reader = reader.option("checkpoint_id", checkpoint_id)
        return reader.load(chk)

    for cid in (0, 1):
        count, events, seen = _expected(batches[:cid + 1])
        df = read("count", cid)
        assert df.rdd.getNumPartitions() == 2   # local[2]: the 3 subtasks in 2 tasks
        one_each = spark.read.format("steward-state").option("state", "src").option("variable", "count").option(
            "checkpoint_id", cid).option("partitions", 5).load(chk)
        assert one_each.rdd.getNumPartitions() == 3   # at most one per subtask
        assert sorted(one_each.collect()) == sorted(df.collect())
        assert {r.key: r.value for r in df.collect()} == count
        got_events = collections.defaultdict(list)
        for r in read("events", cid).collect():
            got_events[r.key].append(r.value)
        assert {k: sorted(v) for k, v in got_events.items()} == events
        got_seen: dict = collections.defaultdict(dict)
        for r in read("seen", cid).collect():
            got_seen[r.key][r.map_key] = r.value
        assert dict(got_seen) == seen
    assert {r.key: r.value for r in read("count").collect()} == _expected(batches)[0]   # default: the latest

    # the change feed from checkpoint 0 to 1: exactly the updates batch 1 made, as upserts of checkpoint 1
    (count0, events0, seen0), (count1, events1, seen1) = _expected(batches[:1]), _expected(batches)
    def changes(variable):
        rows = spark.read.format("steward-state").option("state", "src").option(
            "variable", variable).option("checkpoint_id", 1).option("changes_from", 0).load(chk).collect()
        assert {(r.change_type, r.checkpoint_id) for r in rows} == {("upsert", 1)}
        return rows
    assert {r.key: r.value for r in changes("count")} == {k: n for k, n in count1.items() if count0.get(k) != n}
    added = collections.Counter((r.key, r.value) for r in changes("events"))
    assert added == collections.Counter((k, v) for k, vs in events1.items() for v in vs) - \
        collections.Counter((k, v) for k, vs in events0.items() for v in vs)
    assert {(r.key, r.map_key): r.value for r in changes("seen")} == {
        (k, v): n for k, m in seen1.items() for v, n in m.items() if seen0.get(k, {}).get(v) != n}

    meta = spark.read.format("steward-state-metadata").option("state", "src").load(chk).collect()
    assert [(m.checkpoint_id, m.parallelism, m.max_parallelism, m.key_type) for m in meta] == \
        [(0, 3, 16, "string"), (1, 3, 16, "string")]
    assert json.loads(meta[1].variables) == {"count": "value", "events": "list", "seen": "map"}
    assert meta[1].size_bytes > 0 and meta[1].files > 0 and meta[1].processing_ms > 0
    assert _files(chk) == before   # nothing written into the source


@pytest.fixture(scope="module")
def named_live(spark, tmp_path_factory):
    """State ``named`` with checkpoints 0 and 1, open in this application; returns its checkpoint dir."""
    st = Steward.get(spark)
    live = tmp_path_factory.mktemp("named-live") / "chk"
    ks = st.keyed_state("named", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(live),
                        num_retained=2, states=[value_state("count", "bigint")])
    for i in range(2):
        ks.apply(spark.createDataFrame(_batches()[0]), _count_only, "k string, n long", checkpoint_id=i).collect()
        ks.commit(i, wait=60)
    return live


@pytest.fixture(scope="module")
def named(named_live, tmp_path_factory):
    """A dir holding ``chk``, a copy of ``named_live`` no writer touches."""
    root = tmp_path_factory.mktemp("named")
    _frozen(named_live, root / "chk")
    return root


@pytest.mark.parametrize("options, path, message", [
    ({"state": "nope"}, "chk", r"state 'nope' has no completed checkpoint in .*states of cluster id 'default' "
                               r"there: named"),
    ({"state": "named", "checkpoint_id": "7"}, "chk", r"no retained checkpoint 7; retained: 0, 1"),
    ({"state": "named", "checkpoint_id": "x"}, "chk", r"checkpoint_id='x' is not a checkpoint id"),
    ({"state": "named", "variable": "nope"}, "chk", r"has no declared variable 'nope'; declared: count \(value\)"),
    ({"state": "../named"}, "chk", r"state name"),
    ({"state": "named"}, "nowhere", r"state 'named' has no completed checkpoint in"),
    ({"state": "named", "storage_options": "{"}, "chk", r"storage_options is not a JSON object"),
    ({}, "chk", r"chk holds no _metadata, so it is not a checkpoint \(chk-<N>\) or savepoint"),
    ({"checkpoint_id": "0"}, "chk/default/named/chk-1", r"is checkpoint 1 of state 'named', not checkpoint 0"),
    ({"state": "named", "changes_from": "x"}, "chk", r"changes_from='x' is not a checkpoint id"),
    ({"state": "named", "changes_from": "1", "checkpoint_id": "0"}, "chk",
     r"changes_from=1 must name a checkpoint older than checkpoint 0"),
    ({"state": "named", "changes_from": "5"}, "chk", r"no retained checkpoint 5; retained: 0, 1"),
    ({"changes_from": "0"}, "chk/default/named/chk-1", r"changes_from needs the checkpoint dir and .option\('state'"),
    ({"state": "named", "partitions": "0"}, "chk", r"option partitions='0' is not a positive integer"),
])
def test_bad_input_is_named(spark, named, options, path, message):
    before = _files(named)
    reader = spark.read.format("steward-state")
    for k, v in options.items():
        reader = reader.option(k, v)
    with pytest.raises(Exception, match=message):
        reader.load(str(named / path)).collect()
    assert _files(named) == before


def _count_only(key, rows, state):
    count = state.value("count")
    count.update((count.get() or 0) + len(rows))
    return key, count.get()


def test_read_state_raises_our_error_in_the_callers_process_and_reads_like_the_source(spark, named):
    """``st.read_state``: the source's checks run in the caller first, so a bad id is our error (not
    Spark's wrapped one); a good read is the source's DataFrame, the metadata read too."""
    from sparksteward.errors import CheckpointNotFoundError, StateError

    st = Steward.get(spark)
    chk = str(named / "chk")
    with pytest.raises(CheckpointNotFoundError, match=r"no retained checkpoint 9; retained: 0, 1"):
        st.read_state("named", checkpoint_dir=chk, checkpoint_id=9)
    with pytest.raises(StateError, match=r"has no declared variable 'nope'"):
        st.read_state("named", checkpoint_dir=chk, variable="nope")
    rows = st.read_state("named", checkpoint_dir=chk, checkpoint_id=0, variable="count").collect()
    batch = _batches()[0]
    assert {r.key: r.value for r in rows} == batch["k"].value_counts().to_dict()
    assert [m.checkpoint_id for m in st.read_state("named", checkpoint_dir=chk, metadata=True).collect()] == [0, 1]


def test_a_checkpoint_dir_and_a_savepoint_read_by_url_without_a_state(spark, named, named_live, tmp_path):
    """A ``chk-<N>`` directory and a savepoint (``ks.savepoint``) read by their URL alone, no state option."""
    st = Steward.get(spark)
    ks = st.keyed_state("named", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(named_live),
                        num_retained=2, states=[value_state("count", "bigint")])
    point = str(tmp_path / "savepoint")
    ks.savepoint(point)
    want = {k: 2 * n for k, n in _batches()[0]["k"].value_counts().items()}
    for url in (point, str(named / "chk" / "default" / "named" / "chk-1")):
        df = spark.read.format("steward-state").option("variable", "count").load(url)
        assert {r.key: r.value for r in df.collect()} == want, url
        assert {r.key: r.value for r in st.read_state(url=url, variable="count").collect()} == want
    meta = st.read_state(url=point, metadata=True).collect()
    assert [m.checkpoint_id for m in meta] == [1]
    from sparksteward.errors import StateError

    with pytest.raises(StateError, match=r"one of them"):
        st.read_state("named", url=point)


def _arm(key, rows, state):
    """Registers a processing-time timer per row value, far ahead so none fires."""
    for v in rows["v"]:
        state.timers.register(2_000_000_000_000 + int(v))
    return key, len(rows)


def test_registered_timers_read_as_rows(spark, tmp_path):
    """Issue 39 with issue 38: ``variable="__timers__"`` reads every registered timer of a checkpoint as
    (key, time_domain, timestamp_ms); a declared variable cannot take that name."""
    from sparksteward.errors import StateSchemaError

    st = Steward.get(spark)
    chk = str(tmp_path / "chk")
    ks = st.keyed_state("timed", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=chk)
    batch = _batches()[0]
    ks.apply(spark.createDataFrame(batch), _arm, "k string, n long", checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    got = sorted(map(tuple, st.read_state("timed", checkpoint_dir=chk, variable="__timers__").collect()))
    want = sorted({(k, "processing", 2_000_000_000_000 + int(v)) for k, v in zip(batch["k"], batch["v"])})
    assert got == want
    with pytest.raises(StateSchemaError, match=r"'__timers__' is reserved"):
        value_state("__timers__", "bigint")


def _count_ttl(key, rows, state):
    count = state.value("count")
    count.update((count.get() or 0) + len(rows))
    state.value("plain").update(len(rows))
    return key, count.get()


def test_the_ttl_expiry_reads_as_a_column(spark, tmp_path):
    """``expiry=True``: each entry's TTL expiry (the batch's processing time plus the TTL) in ``expires_ms``;
    a variable without a TTL has nulls there, and the undeclared default state has none to offer."""
    from sparksteward.errors import StateError

    st = Steward.get(spark)
    chk = str(tmp_path / "chk")
    ks = st.keyed_state("ttl", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=chk,
                        states=[value_state("count", "bigint", ttl=3600), value_state("plain", "bigint")])
    ks.apply(spark.createDataFrame(_batches()[0]), _count_ttl, "k string, n long", checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    processing = st.read_state("ttl", checkpoint_dir=chk, metadata=True).collect()[0].processing_ms
    rows = st.read_state("ttl", checkpoint_dir=chk, variable="count", expiry=True).collect()
    assert rows and {r.expires_ms for r in rows} == {processing + 3_600_000}
    df = spark.read.format("steward-state").option("state", "ttl").option("variable", "count") \
        .option("expiry", "true").load(chk)
    assert df.columns == ["key", "value", "expires_ms"] and df.count() == len(rows)
    with pytest.raises(StateError, match=r"the undeclared default value state of state 'ttl' have no TTL"):
        st.read_state("ttl", checkpoint_dir=chk, expiry=True)
    plain = st.read_state("ttl", checkpoint_dir=chk, variable="plain", expiry=True).collect()
    assert len(plain) == len(rows) and {r.expires_ms for r in plain} == {None}
    with pytest.raises(Exception, match=r"option expiry='maybe' must be true or false"):
        spark.read.format("steward-state").option("state", "ttl").option("variable", "count") \
            .option("expiry", "maybe").load(chk).collect()


def test_a_corrupt_record_or_a_truncated_file_is_named(spark, named, tmp_path):
    """A ``_metadata`` that is not a record is refused by ``read_state`` naming it; a data file cut short
    fails the read's task with our error naming the file and its checksum (nothing restored from it),
    in Spark's error of the action that read it."""
    import shutil

    from sparksteward.errors import CheckpointCorruptError

    st = Steward.get(spark)
    bad = tmp_path / "bad"
    shutil.copytree(named / "chk" / "default" / "named" / "chk-1", bad / "chk-1")
    (bad / "chk-1" / "_metadata").write_bytes(b'{"version": 1, "state": ')
    with pytest.raises(CheckpointCorruptError, match=r"chk-1/_metadata"):
        st.read_state(url=str(bad / "chk-1"))
    sp = tmp_path / "sp"
    shutil.copytree(named / "chk" / "default" / "named", tmp_path / "copy")
    from sparksteward.checkpoint.storage import open_checkpoint

    _, meta = open_checkpoint(str(tmp_path / "copy" / "chk-1"))
    sst = next(f for h in meta.subtasks for f in h.files if f.name.endswith(".sst"))
    target = tmp_path / "copy" / sst.path
    target.write_bytes(target.read_bytes()[: sst.length // 2])
    before = _files(tmp_path / "copy")
    with pytest.raises(Exception, match=rf"{sst.name} .* is corrupt: expected checksum .* nothing was restored"):
        st.read_state(url=str(tmp_path / "copy" / "chk-1"), variable="count").collect()
    assert _files(tmp_path / "copy") == before
    assert not sp.exists()


def _plus_one(keys, rows, state):
    """Every key of the batch: count += 1 (so a checkpoint after batch i holds i + 1 for every key)."""
    import pyarrow.compute as pc

    count = state.value("count")
    g = rows.group_by("k").aggregate([])
    count.put_many(g["k"], pc.add(pc.fill_null(count.get_many(g["k"]), 0), 1))


@pytest.mark.parametrize("merging", [False, True], ids=["own-files", "merged-files"])
def test_a_read_planned_before_its_checkpoint_is_subsumed_gives_that_checkpoint_or_names_the_subsumption(
        spark, tmp_path, merging):
    """An offline read beside the live writer: the read of checkpoint 0 is planned (its record resolved),
    then the writer commits two more and subsumes it (num_retained=1). The read then returns checkpoint
    0's values exactly (files it needs still there, as merged files shared with later checkpoints can be)
    or fails naming the subsumption and what to do; never another checkpoint's values or a mix."""
    import time

    st = Steward.get(spark)
    chk = tmp_path / "chk"
    name = f"sub-{int(merging)}"
    ks = st.keyed_state(name, key="k", parallelism=3, max_parallelism=16, checkpoint_dir=str(chk), num_retained=1,
                        file_merging=merging, states=[value_state("count", "bigint")])
    df = spark.createDataFrame(pd.DataFrame({"k": [f"u{i}" for i in range(50)], "v": [1] * 50}))

    def batch(i):
        ks.apply_arrow(df, _plus_one, "k string", checkpoint_id=i).write.format("noop").mode("overwrite").save()
        ks.commit(i, wait=60)

    batch(0)
    read = st.read_state(name, checkpoint_dir=str(chk), variable="count")
    read._jdf.queryExecution().executedPlan()   # planned now: checkpoint 0's record is the read's
    for i in (1, 2):
        batch(i)
    for _ in range(200):
        if not (chk / "default" / name / "chk-0").exists():
            break
        time.sleep(0.05)
    assert not (chk / "default" / name / "chk-0").exists()
    try:
        got = {r.key: r.value for r in read.collect()}
    except Exception as exc:  # noqa: BLE001 - Spark's error of the action, with ours in it
        assert f"checkpoint 0 of state '{name}' was subsumed by its live writer while this read ran" in str(exc)
        import re

        assert re.search(r"retained now: [\d, ]*2\)\. Read again .*num_retained", str(exc)), str(exc)
        assert "Restore an older checkpoint" not in str(exc)
        assert not merging or "merged" in str(exc), "merged files shared with checkpoint 2 should still be there"
    else:
        assert merging, "checkpoint 0's own files were deleted, yet the read returned rows"
        assert got == {f"u{i}": 1 for i in range(50)}
    assert {r.value for r in st.read_state(name, checkpoint_dir=str(chk), variable="count").collect()} == {3}
