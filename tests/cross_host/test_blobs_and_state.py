"""Blobs and keyed state across hosts (issue 7 item 1, must-show 1; issues 8 and 9), with a real Spark
standalone cluster.

The worker runs in its own mount namespace (:mod:`sparksteward.testing.standalone`): a private tmpfs
over ``/tmp`` and the state dir, and another ``boot_id``. Its executor sees neither the driver's files
nor its boot id, so the BlobServer must stream every blob to it. Broadcasts, a library and a scoped
job's cleanup must all work there.
"""

from __future__ import annotations

import os
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest
from sparksteward import Steward
from sparksteward.blob.server import BOOT_ID
from sparksteward.blob.store import job_dir_name
from sparksteward.storage import PROBE_PREFIX

from tests.helpers import wait_until
from tests.helpers.cross_host import executor_cache_stats, on_executor

pytestmark = pytest.mark.slow


def test_the_executor_sees_neither_the_drivers_files_nor_its_boot_id(spark, tmp_path):
    marker = Path("/tmp") / f"steward-driver-only-{uuid.uuid4().hex}"
    marker.write_text("driver")
    try:
        def probe():
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            return boot, os.path.exists(str(marker)), os.path.exists(os.environ.get("XDG_STATE_HOME", "/nonexistent"))

        boot, sees_marker, sees_state = on_executor(spark, probe)
    finally:
        marker.unlink()
    assert BOOT_ID and boot and boot != BOOT_ID, "the executor must run under another boot id"
    assert not sees_marker, "the executor must not see the driver's /tmp"
    assert not sees_state, "the executor must not see the driver's state dir"


def test_a_large_numpy_broadcast_is_streamed_to_the_executor(spark):
    st = Steward.get(spark)
    arr = np.arange(1_000_000, dtype=np.float64)  # 8 MB: really streamed, several frames
    h = st.broadcast(arr)
    before = on_executor(spark, executor_cache_stats)
    got = spark.sparkContext.parallelize(range(3), 1).map(lambda i: float(h.value[i * 1000])).collect()
    assert got == [0.0, 1000.0, 2000.0]
    after = on_executor(spark, executor_cache_stats)
    assert after.get("transfers", 0) - before.get("transfers", 0) == 1
    assert after.get("local_copies", 0) == 0, "no shared file system: nothing may be copied by path"


def test_a_library_is_importable_on_the_executor(spark, tmp_path):
    st = Steward.get(spark)
    whl = tmp_path / "xhostlib-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("xhostlib/__init__.py", "VALUE = 'shipped across hosts'\n")
    st.add_library(whl)

    def use(_):
        import xhostlib

        return xhostlib.VALUE

    assert spark.sparkContext.parallelize([0], 1).map(use).collect() == ["shipped across hosts"]


def test_a_jobs_blob_directory_leaves_the_executor_and_the_driver_after_the_job(spark):
    st = Steward.get(spark)
    job_dir = job_dir_name("xhost-job")

    def cached_job_dirs():
        from pyspark import SparkFiles

        root = Path(SparkFiles.getRootDirectory()) / ".sparksteward"
        return sorted(str(p.relative_to(root)) for p in root.glob(f"cache-*/{job_dir}") if p.is_dir())

    with st.job("xhost-job") as job:
        h = st.broadcast(np.full(300_000, 3, dtype=np.int64))  # 2.4 MB
        assert spark.sparkContext.parallelize([0], 1).map(lambda _: int(h.value.sum())).collect() == [900_000]
        local = Path(st.blobs.incoming).parent / job_dir
        assert local.is_dir(), "the driver holds the job's blobs while the job runs"
        assert on_executor(spark, cached_job_dirs), "the executor cached the job's blob"
    assert job.entry.clean
    wait_until(lambda: not local.exists(), timeout=5, what="the job's blob dir to leave the driver's local store")
    wait_until(lambda: not on_executor(spark, cached_job_dirs), timeout=10, interval=0.5,
               what="the job's blob dir to leave the executor's cache")


def test_keyed_state_with_merged_checkpoints_on_s3_across_hosts(spark, s3):
    """Keyed state whose executor sees neither the driver's files nor its boot id: every checkpoint
    goes through S3, its small files merged into one object per executor (FLIP-306), and each batch
    restores what the previous one committed."""
    from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

    st = Steward.get(spark)
    ks = st.keyed_state("xhost", key="k", parallelism=4, max_parallelism=16, checkpoint_dir=s3.url("xhost-chk"))
    batches = make_batches(17, count=3)
    for i, batch in enumerate(batches):
        mark = s3.mark()
        ks.apply(spark.createDataFrame(batch), count_sum, SCHEMA, checkpoint_id=i).collect()
        ks.commit(i, wait=120)
        stats = next(c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == i)
        written = {q.key for q in s3.requests_since(mark) if q.op == "PutObject"
                   and not q.key.endswith(("/_lease", "/_begun")) and PROBE_PREFIX not in q.key}
        # the lease and the begun record are records of the state, rewritten in place (one PUT of _begun per
        # batch), not checkpoint objects; the store's conditional-write probe runs once, at the first batch
        assert stats["merged_files_written"] == 1, stats  # one executor: one physical file per checkpoint
        assert len(written) == stats["objects_written"] <= 1 + 2, written
    assert state_of(ks) == reference(batches)
    merged = s3.filesystem().ls(s3.url("xhost-chk", "default", "xhost", "merged"))
    assert merged and ks.info()["space"]["physical_files"] == len(merged)


def test_declared_states_with_ttl_on_s3_across_hosts(spark, s3):
    """Declared value, list and map states (typed, with a TTL) on an executor that sees neither the
    driver's files nor its boot id: each batch restores them from S3, and a distributed read decodes
    every variable there with the declarations the checkpoint recorded."""
    import pandas as pd
    from sparksteward import list_state, map_state, value_state

    from tests.helpers.keyed import declared_count_events, make_batches

    st = Steward.get(spark)
    specs = [value_state("count", "bigint", ttl=3600), list_state("events", "bigint", ttl=3600),
             map_state("seen", "bigint", "bigint", ttl=3600)]
    ks = st.keyed_state("xdeclared", key="k", parallelism=2, max_parallelism=16,
                        checkpoint_dir=s3.url("xdeclared-chk"), states=specs)
    batches = make_batches(19, count=3, rows=200, keys=10)
    for i, batch in enumerate(batches):
        rows = ks.apply(spark.createDataFrame(batch), declared_count_events, "k string, n long, events long, "
                        "distinct long", checkpoint_id=i).collect()
        ks.commit(i, wait=120)
    allrows = pd.concat(batches)
    assert {r.k: r.n for r in rows} == allrows[allrows["k"].isin(batches[-1]["k"])].groupby("k").size().to_dict()
    assert {r.key: r.value for r in ks.read("count", distributed=True).collect()} == \
        allrows.groupby("k").size().to_dict()
    assert ks.read("events", distributed=True).count() == len(allrows)
    seen = {(r.key, r.map_key): r.value for r in ks.read("seen", distributed=True).collect()}
    assert seen == {kv: n for kv, n in allrows.groupby(["k", "v"]).size().items()}


def test_the_arrow_form_gets_one_call_and_flushes_in_its_task_on_the_other_host(spark, s3):
    """On an executor that sees neither the driver's files nor its boot id, a subtask whose rows arrive
    in many Arrow buffers (maxRecordsPerBatch 2,000) gets one call of the Arrow form with all of them,
    so one output row per key; its puts without a TTL go in as an SST of their own (decision 0023), and
    its writes with one, past ``task-flush-size`` of WAL, flush in its task (decision 0022), before the
    agent there uploads both to S3. Its count is the default value state declared typed (decision 0027),
    read back typed on executors."""
    import pandas as pd
    import pyarrow as pa
    from sparksteward import value_state

    def fn(keys, rows, state):
        import pyarrow.compute as pc

        g = rows.group_by("k").aggregate([("v", "count")]).combine_chunks()
        old = state.get_many(g["k"])   # the default value state, declared typed (decision 0027)
        new = pc.add(pc.if_else(pc.is_valid(old), old, 0), g["v_count"]).combine_chunks()
        state.put_many(g["k"], new)
        state.value("seen").put_many(g["k"], g["v_count"])
        return pa.table({"k": g["k"], "n": new, "rows": pa.array([rows.num_rows] * len(g), pa.int64())})

    ks = Steward.get(spark).keyed_state("xonecall", key="k", parallelism=2, max_parallelism=16,
                                        checkpoint_dir=s3.url("xonecall-chk"),
                                        states=[value_state("value", "bigint"), value_state("seen", "bigint", ttl=3600)])
    rng = np.random.default_rng(11)
    batches = [pd.DataFrame({"k": [f"key-{k}" for k in rng.integers(0, 80_000, 80_000)], "v": 1}) for _ in range(2)]
    before = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "2000")
    try:
        for i, b in enumerate(batches):
            out = ks.apply_arrow(spark.createDataFrame(b), fn, "k string, n long, rows long", checkpoint_id=i).collect()
            ks.commit(i, wait=120)
            assert len(out) == b["k"].nunique() == len({r.k for r in out})   # one row per key: one call
            assert len({r.rows for r in out}) <= 2 and min(r.rows for r in out) > 10 * 2000   # many buffers a call
            stats = next(c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == i)
            assert len(stats["flush_ms"]) == 2 and all(ms > 0 for ms in stats["flush_ms"]), stats
            assert all(n > 10_000 for n in stats["entries_ingested"]), stats
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", before)
    want = pd.concat(batches)["k"].value_counts().to_dict()
    assert {r.key: r.value for r in ks.read(distributed=True).collect()} == want   # typed: ints, not JSON text
    assert {r.key: r.value for r in ks.read("seen", distributed=True).collect()} == \
        {**batches[0]["k"].value_counts().to_dict(), **batches[1]["k"].value_counts().to_dict()}


def test_expired_state_is_compacted_away_by_the_agent_on_the_other_host(spark, s3):
    """The executor agent on a host that sees neither the driver's files nor its boot id compacts a
    snapshot whose SSTs carry the TTL sweep's deletions (decision 0019) before it uploads it to S3: the
    first batch's SSTs leave the checkpoint, which shrinks, and a restore reads only the live keys. The
    checkpoint's report carries what that agent and its tasks measured."""
    import pandas as pd
    from sparksteward import value_state

    def count(key, rows, state):
        n = state.value("n")
        n.update((n.get() or 0) + len(rows))
        return pd.DataFrame({"k": [key], "n": [n.get()]})

    ks = Steward.get(spark).keyed_state("xcompact", key="k", parallelism=2, max_parallelism=16,
                                        checkpoint_dir=s3.url("xcompact-chk"),
                                        states=[value_state("n", "bigint", ttl=1.5)])

    def batch(i: int, keys: range) -> None:
        df = spark.createDataFrame(pd.DataFrame({"k": [f"key-{k:05d}" for k in keys], "v": 1}))
        ks.apply(df, count, "k string, n long", checkpoint_id=i).write.format("noop").mode("overwrite").save()
        ks.commit(i, wait=120)

    def ssts() -> dict[int, set[str]]:
        return {s["subtask"]: {f["checksum"] for f in s["files"] if f["name"].endswith(".sst")}
                for s in ks.info()["latest"]["subtasks"]}

    def size() -> int:   # the data: SSTs and WAL (OPTIONS, MANIFEST and CURRENT are a fixed 8 KB a subtask)
        return sum(f["length"] for s in ks.info()["latest"]["subtasks"] for f in s["files"]
                   if f["name"].endswith((".sst", ".log")))

    batch(0, range(2000))
    first, first_size = ssts(), size()
    assert all(first.values()), first   # the WAL of each subtask was folded into an SST
    time.sleep(2.0)   # every key of batch 0 expires
    for i in (1, 2):   # the sweep deletes them; the agent compacts the tombstones and what they cover
        batch(i, range(5000 + 10 * i, 5010 + 10 * i))
    last = ssts()
    report = ks.report(checkpoint_id=2)   # the figures the executor agent on the other host measured
    assert report["rows_in"] == report["keys_touched"] == 10 and report["state_bytes_local"] > 0, report
    assert report["bytes_uploaded"] > 0 and report["async_ms"] > 0 and report["restore_ms"] >= 0, report
    assert all(not (last[s] & first[s]) for s in first), (first, last)
    assert size() < first_size / 5, (first_size, size())
    assert {r.key for r in ks.read("n", distributed=True).collect()} <= {f"key-{k:05d}" for k in range(5010, 5030)}


def test_unaligned_channel_state_across_hosts(spark, s3):
    """Channel state (FLIP-76) deferred on an executor that sees neither the driver's files nor its
    boot id goes to S3 inside the merged file, and the next batches replay it there."""
    from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

    st = Steward.get(spark)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "20")
    try:
        kw = {"key": "k", "parallelism": 2, "max_parallelism": 16, "checkpoint_dir": s3.url("xhost-unaligned")}
        ks = st.keyed_state("xunaligned", alignment="unaligned", aligned_checkpoint_timeout=0, **kw)
        batches = make_batches(18, count=2, rows=300)
        for i, batch in enumerate(batches):
            ks.apply(spark.createDataFrame(batch), count_sum, SCHEMA, checkpoint_id=i).collect()
            ks.commit(i, wait=120)
        latest = ks.info()
        assert latest["checkpoints"][-1]["rows_deferred"] > 0
        assert all(f["path"].startswith("merged/") for s in latest["latest"]["subtasks"] for f in s["channel_state"])
        ks = st.keyed_state("xunaligned", alignment="aligned", **kw)  # drain what is deferred
        ks.apply(spark.createDataFrame(batches[0].iloc[:0], "k string, v long"), count_sum, SCHEMA,
                 checkpoint_id=2).collect()
        ks.commit(2, wait=120)
        assert state_of(ks) == reference(batches)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")


def test_a_cut_inside_a_key_with_chunks_across_hosts(spark, s3):
    """``form="chunks"`` (5-row chunks, timeout 0) on an executor that sees neither the driver's files nor
    its boot id: the cut falls inside a key group (``cut_rows`` in the record on S3), the rest replays there
    first, and the drained state counts every row once."""
    from tests.helpers.keyed import SCHEMA, count_sum_chunks, make_batches, reference, state_of

    st = Steward.get(spark)
    spark.conf.set("spark.steward.state.chunk-rows", "5")
    try:
        kw = {"key": "k", "parallelism": 2, "max_parallelism": 16, "checkpoint_dir": s3.url("xhost-chunks")}
        ks = st.keyed_state("xchunks", alignment="unaligned", aligned_checkpoint_timeout=0, **kw)
        batches = make_batches(19, count=2, rows=300, keys=6)   # few keys: each key group holds many rows
        rows_cut = []
        for i, batch in enumerate(batches):
            ks.apply(spark.createDataFrame(batch), count_sum_chunks, SCHEMA, checkpoint_id=i, chunks=True).collect()
            ks.commit(i, wait=120)
            rows_cut.append(ks.info()["latest"]["properties"].get("cut_rows"))
        assert all(rows_cut) and ks.info()["checkpoints"][-1]["rows_deferred"] > 0, rows_cut
        ks = st.keyed_state("xchunks", alignment="aligned", **kw)
        ks.apply(spark.createDataFrame(batches[0].iloc[:0], "k string, v long"), count_sum_chunks, SCHEMA,
                 checkpoint_id=2, chunks=True).collect()
        ks.commit(2, wait=120)
        assert state_of(ks) == reference(batches)
        # issue 39: the offline reader's tasks restore each subtask on the other host, from S3
        import orjson

        rows = st.read_state("xchunks", checkpoint_dir=s3.url("xhost-chunks")).collect()
        assert {r.key: tuple(orjson.loads(r.value).values()) for r in rows} == reference(batches)
    finally:
        spark.conf.unset("spark.steward.state.chunk-rows")


def test_process_defaults_on_the_other_host_one_run_a_batch_then_persisted_and_a_partial_sink_commits(spark, s3):
    """``process()`` with its defaults (issue 37 item 4) where the executor sees neither the driver's
    files nor its boot id: one state-stage run a batch for a one-write sink, two for a sink taking two
    actions and persisted from the next batch on, and a sink that computes one partition (``take``)
    still commits with every subtask run; the state equals the reference, and so does every row the
    function returned (as tuples: the per-key form's row output, converted on that host)."""
    from tests.helpers.keyed import SCHEMA, count_sum_row, make_batches, reference, state_of

    st = Steward.get(spark)
    ks = st.keyed_state("xprocess", key="k", parallelism=2, max_parallelism=16,
                        checkpoint_dir=s3.url(f"xprocess-{uuid.uuid4().hex[:8]}"))
    batches = make_batches(23, count=4)
    actions, cached, emitted = {"n": 1}, {}, {}

    def sink(out, cid):
        cached[cid] = out.is_cached
        if actions["n"] == 0:
            out.take(1)
        for _ in range(actions["n"]):
            emitted[cid] = {r.k: (r.n, r.s) for r in out.collect()}

    run = ks.process(count_sum_row, SCHEMA, sink=sink, wait=120)
    run(spark.createDataFrame(batches[0]), 0)
    assert not cached[0] and ks.report(checkpoint_id=0)["stage_runs"] == 1
    actions["n"] = 2
    run(spark.createDataFrame(batches[1]), 1)
    assert not cached[1] and ks.report(checkpoint_id=1)["stage_runs"] == 2
    run(spark.createDataFrame(batches[2]), 2)
    assert cached[2] and ks.report(checkpoint_id=2)["stage_runs"] == 1
    actions["n"] = 0
    ks.process(count_sum_row, SCHEMA, sink=sink, wait=120)(spark.createDataFrame(batches[3]), 3)
    assert not cached[3] and ks.info()["last_completed"] == 3
    assert state_of(ks) == reference(batches)
    for cid in (0, 1, 2):
        want = reference(batches[:cid + 1])
        assert emitted[cid] == {k: want[k] for k in set(batches[cid]["k"])}


def test_event_time_timers_and_event_ttl_on_s3_across_hosts(spark, s3):
    """Issue 38 on an executor that sees neither the driver's files nor its boot id, state on S3: late
    rows dropped and counted, event-time timers fire once each for keys without input across a rescale
    between registration and firing, and an event-time TTL expires by the watermark, not the clock."""
    import datetime as dt

    import pandas as pd
    from sparksteward import value_state

    t0 = 1_500_000_000_000   # old events (2017) at today's processing time

    def arm(key, rows, state):
        state.value("last").update(int(rows["v"].max()))
        state.timers.register(int(rows["ts"].max().timestamp() * 1000) + 10_000, time="event")

    def fired(key, timers, state):
        return pd.DataFrame({"k": [key], "at": [timers[0].at], "last": [state.value("last").get() or -1]})

    def df(rows):
        return spark.createDataFrame([(k, dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc), 1)
                                      for k, ms in rows], "k string, ts timestamp, v long")

    st = Steward.get(spark)
    specs = [value_state("last", "bigint", ttl=15, ttl_time="event")]
    out = []
    for cid, (p, rows) in enumerate([(2, [(f"k{i}", t0 + 1000 * i) for i in range(10)]),   # timers t0+10..19 s
                                     (3, [("k0", t0 + 100), ("late", t0 + 9_000)]),        # at watermark t0+9 s
                                     (3, [])]):                                            # at t0+9 s again
        ks = st.keyed_state("xtimers", key="k", parallelism=p, max_parallelism=16, event_time="ts",
                            checkpoint_dir=s3.url("xtimers-chk"), states=specs)
        out += [(r.k, r.at, r.last) for r in ks.apply(df(rows), arm, "k string, at long, last long", cid,
                                                      on_timer=fired).collect()]
        ks.commit(cid, wait=120)
        if cid == 1:
            assert ks.report(checkpoint_id=1)["late_rows"] == 2
    assert out == []   # the watermark stayed at t0 + 9 s: nothing due yet
    ks.apply(df([("z", t0 + 60_000)]), arm, "k string, at long, last long", 3, on_timer=fired).collect()
    ks.commit(3, wait=120)   # ran at t0 + 9 s; the next runs at t0 + 60 s
    got = sorted((r.k, r.at, r.last) for r in
                 ks.apply(df([]), arm, "k string, at long, last long", 4, on_timer=fired).collect())
    ks.commit(4, wait=120)
    # every k fires once; 'last' was written at watermark t0 (TTL 15 s: expires at t0 + 15 s) or stamped
    # by the processing time in the first batch (no watermark yet): alive only for the latter
    assert [k for k, _, _ in got] == sorted(f"k{i}" for i in range(10))
    assert all(last == 1 for _, _, last in got)
    assert ks.report(checkpoint_id=4)["timers_fired"] == 10


def test_offline_read_diff_and_savepoint_writer_on_s3_across_hosts(spark, s3, capsys):
    """Issue 39 on an executor that sees neither the driver's files nor its boot id, state on S3: the
    state source and the change feed read there; a savepoint bootstrapped from a DataFrame (its SSTs
    written and uploaded there), derived with another max parallelism, restored at another parallelism,
    goes on with exact values; ``steward state diff`` on the driver prints the same changes."""
    import json

    import pandas as pd
    from sparksteward import list_state, map_state, value_state
    from sparksteward.cli import main

    from tests.helpers.keyed import declared_count_events

    st = Steward.get(spark)
    specs = [value_state("count", "bigint"), list_state("events", "bigint"), map_state("seen", "bigint", "bigint")]
    out = "k string, n long, events long, distinct long"
    ks = st.keyed_state("xoffline", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=s3.url("xoff-chk"),
                        num_retained=2, states=specs)
    batches = [pd.DataFrame({"k": ["a", "b", "c"], "v": [1, 2, 3]}), pd.DataFrame({"k": ["a", "d"], "v": [4, 5]})]
    for i, b in enumerate(batches):
        ks.apply(spark.createDataFrame(b), declared_count_events, out, checkpoint_id=i).collect()
        ks.commit(i, wait=120)
    chk = s3.url("xoff-chk")
    read = st.read_state("xoffline", checkpoint_dir=chk, variable="count")
    assert {r.key: r.value for r in read.collect()} == {"a": 2, "b": 1, "c": 1, "d": 1}
    feed = st.read_state("xoffline", checkpoint_dir=chk, variable="events", changes_from=0).collect()
    assert sorted((r.key, r.value, r.change_type, r.checkpoint_id) for r in feed) == [("a", 4, "upsert", 1),
                                                                                       ("d", 5, "upsert", 1)]
    assert main(["state", "diff", chk, "--state", "xoffline", "--from", "0", "--variable", "count", "--json",
                 "--conf", f"spark.steward.storage.options={s3.storage_options()}"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((r["key"], r["value"]) for r in printed) == [("a", 2), ("d", 1)]

    sp = s3.url("xoff-sp/boot-1")
    st.write_savepoint(sp, state="xboot", states=specs, parallelism=3, max_parallelism=16, data={
        "count": spark.range(5000).selectExpr("concat('u', id) AS key", "id AS value"),
        "events": spark.range(6).selectExpr("concat('u', id % 2) AS key", "id AS value")})
    derived = s3.url("xoff-sp/boot-2")
    st.derive_savepoint(derived, source=sp, max_parallelism=32,
                        transform={"count": lambda df: df.withColumn("value", df.value + 1)})
    on = st.keyed_state("xboot-on", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=s3.url("xoff-chk2"),
                        restore_from=derived, states=specs)
    got = on.apply(spark.createDataFrame(pd.DataFrame({"k": ["u1", "u7"], "v": [9, 9]})), declared_count_events, out,
                   checkpoint_id=0).collect()
    on.commit(0, wait=120)
    assert sorted((r.k, r.n, r.events) for r in got) == [("u1", 3, 4), ("u7", 9, 1)]
    assert [r.value for r in on.read("events", distributed=True).collect() if r.key == "u1"] == [1, 3, 5, 9]
