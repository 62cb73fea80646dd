"""Keyed state rescale and incremental checkpoints in Spark, on local-cluster[2,1,1024] (issue 8,
must-show 2 and 4).

- Rescale 8 -> 3 -> 16 over a continuing stream: a file-source query whose foreachBatch applies and
  commits, stopped and restarted on the same Spark checkpointLocation with another parallelism, on a
  state of 1M keys. The final state equals Spark's own aggregation of every input row, and each new
  subtask of the first checkpoint after a rescale read exactly the files of the old subtasks that
  overlap its key groups (reported by the executor agents in the checkpoint stats).
- Incremental: on 1M keys, each checkpoint after the first uploads only its new files (printed).
- A max_parallelism change is refused, naming both values and the fix.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest
from sparksteward import Steward
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.task.subtask_restore import overlapping_subtasks
from sparksteward.errors import ParallelismError
from sparksteward.state.keygroups import key_group_range

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

M = 128
KEYS = 1_000_000
SCHEMA = "k bigint, n bigint"


def add_counts(keys, rows, state):
    """State per key: [count of rows, sum of v]. Arrow form; no output rows."""
    t = rows.group_by("k").aggregate([("v", "sum"), ("v", "count")])
    ks = t.column("k").to_pylist()
    old = state.get_many(ks)
    state.put_many(ks, [[(o[0] if o else 0) + c, (o[1] if o else 0) + s]
                        for o, c, s in zip(old, t.column("v_count").to_pylist(), t.column("v_sum").to_pylist())])
    return


@pytest.fixture(scope="module")
def spark(cluster_spark, tmp_path_factory):
    return cluster_spark, tmp_path_factory.mktemp("rescale-cluster")


def add_input(spark, inbox: Path, batch: int, rows: int, expr: str) -> None:
    """One parquet file of ``rows`` rows (k, v) in ``inbox``, staged elsewhere and moved in whole."""
    stage = inbox.parent / f"stage-{batch}"
    df = spark.range(rows).selectExpr(f"{expr} as k", f"cast({batch + 1} * (id % 1000) as bigint) as v")
    df.coalesce(1).write.parquet(str(stage))
    (part,) = stage.glob("part-*.parquet")
    os.replace(part, inbox / f"batch-{batch:02d}.parquet")


def run_query(spark, ks, inbox: Path, chk: Path, seconds: dict[int, float]) -> None:
    """Process every file in ``inbox`` not yet seen by ``chk``, one file per batch, then stop."""

    def each(df, batch_id):
        t = time.perf_counter()
        ks.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=batch_id).write.format("noop").mode("overwrite").save()
        ks.commit(batch_id, wait=180)
        seconds[batch_id] = time.perf_counter() - t

    q = (spark.readStream.schema("k bigint, v bigint").option("maxFilesPerTrigger", 1).parquet(str(inbox))
         .writeStream.foreachBatch(each).option("checkpointLocation", str(chk)).trigger(availableNow=True).start())
    q.awaitTermination(600)
    assert q.exception() is None, q.exception()


def stats_of(ks, checkpoint_id: int) -> dict:
    (s,) = [c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == checkpoint_id]
    return s


def assert_read_only_overlaps(stats: dict, old_json: dict, new_parallelism: int) -> list[tuple]:
    """Each new subtask read exactly the files of the old subtasks overlapping its key-group range."""
    old = CheckpointMetadata.from_bytes(orjson.dumps(old_json), "test")
    restores = {r["subtask"]: r for r in stats["restores"]}
    assert sorted(restores) == list(range(new_parallelism))
    total = sum(h.size for h in old.subtasks)
    rows = []
    for j, r in sorted(restores.items()):
        overlapping = [h for h, _ in overlapping_subtasks(old, key_group_range(M, new_parallelism, j))]
        assert (r["old_parallelism"], r["base_checkpoint"]) == (old.parallelism, old.checkpoint_id)
        assert [r["base"], *r["ingested_from"]] == [h.subtask for h in overlapping]
        assert r["files_read"] == [f.path for h in overlapping for f in h.files]
        assert r["bytes_read"] == sum(h.size for h in overlapping) < total
        assert r["bytes_downloaded"] <= r["bytes_read"]
        rows.append((j, [h.subtask for h in overlapping], r["bytes_read"], r["bytes_downloaded"], r["seconds"]))
    return rows


@pytest.mark.soak  # 2 min; make test keeps the rescales of test_keep_open_cluster.py and task/test_subtask_restore.py
def test_rescale_8_to_3_to_16_over_a_continuing_stream(spark):
    from pyspark.sql import functions as F

    spark, root = spark
    st = Steward.get(spark)
    inbox, chk, state_dir = root / "inbox", root / "query-chk", str(root / "kstate")
    inbox.mkdir()
    seconds: dict[int, float] = {}
    updates = "(id * 7919 + {b} * 104729) % 1000000"
    # batch 0 creates every key; each next batch updates 50k keys
    plan = [(8, [(KEYS, "id"), (50_000, updates.format(b=1))]),
            (3, [(50_000, updates.format(b=2)), (50_000, updates.format(b=3))]),
            (16, [(50_000, updates.format(b=4)), (50_000, updates.format(b=5))])]
    batch = 0
    previous = None
    report = []
    for parallelism, files in plan:
        for rows, expr in files:
            add_input(spark, inbox, batch, rows, expr)
            batch += 1
        ks = st.keyed_state("big", key="k", parallelism=parallelism, max_parallelism=M, checkpoint_dir=state_dir)
        first = batch - len(files)
        run_query(spark, ks, inbox, chk, seconds)
        info = ks.info()
        assert info["last_completed"] == batch - 1 and info["parallelism"] == parallelism
        if previous is not None:
            assert ks.rescaled_from == previous["parallelism"]
            rows = assert_read_only_overlaps(stats_of(ks, first), previous, parallelism)
            report.append((previous["parallelism"], parallelism, seconds[first], seconds[first + 1], rows))
        previous = info["latest"]
        assert previous["parallelism"] == parallelism

    for old_p, new_p, t_rescale, t_next, rows in report:
        print(f"\nrescale {old_p} -> {new_p} of {KEYS} keys: batch {t_rescale:.1f} s (next batch, no rescale: "
              f"{t_next:.1f} s); per new subtask (old subtasks read, bytes read, bytes downloaded, s):")
        for j, subtasks, read, downloaded, secs in rows:
            print(f"  {j:2d}: {subtasks} {read} {downloaded} {secs:.2f}")

    # the final state equals Spark's aggregation of every input row (a run that never rescaled)
    got = (ks.read(distributed=True).selectExpr("key as k", "from_json(value, 'array<bigint>') as a")
           .selectExpr("k", "a[0] as n", "a[1] as s"))
    want = spark.read.parquet(str(inbox)).groupBy("k").agg(F.count("*").alias("n"), F.sum("v").alias("s"))
    digest = ["count(*) as rows", "sum(n) as n", "sum(s) as s",
              "sum(cast(xxhash64(k, n, s) as decimal(38, 0))) as h"]
    got_d, want_d = got.selectExpr(*digest).first(), want.selectExpr(*digest).first()
    print(f"final state {got_d.asDict()} / reference {want_d.asDict()}")
    assert got_d.rows == KEYS
    assert got_d == want_d


def test_incremental_checkpoints_upload_only_new_files(spark):
    spark, root = spark
    st = Steward.get(spark)
    ks = st.keyed_state("incr", key="k", parallelism=4, max_parallelism=M, checkpoint_dir=str(root / "incr"))
    stats, metas = [], []
    for cid in range(6):
        if cid == 0:
            df = spark.range(KEYS).selectExpr("id as k", "id % 1000 as v")
        else:  # 1% of the keys
            df = spark.range(KEYS // 100).selectExpr(f"(id * 7919 + {cid} * 104729) % {KEYS} as k", "1L as v")
        ks.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=cid).write.format("noop").mode("overwrite").save()
        ks.commit(cid, wait=180)
        stats.append(stats_of(ks, cid))
        metas.append(CheckpointMetadata.from_bytes(orjson.dumps(ks.info()["latest"]), f"chk-{cid}"))
    print("\ncheckpoint: files uploaded / reused, bytes uploaded / total")
    for s in stats:
        print(f"  {s['checkpoint_id']}: {s['files_uploaded']} / {s['files_reused']}, "
              f"{s['bytes_uploaded']} / {s['bytes']}")
    first, later = stats[0], stats[1:]
    assert first["files_reused"] == 0 and first["bytes_uploaded"] == first["bytes"] == metas[0].size
    for prev, meta, s in zip(metas, metas[1:], later):
        # exactly the files the previous checkpoint lacks were uploaded; the rest were reused
        before = {f.path for f in prev.files()}
        new = [f.length for f in meta.files() if f.path not in before]
        assert (s["files_uploaded"], s["bytes_uploaded"]) == (len(new), sum(new))
        assert s["files_reused"] > 0 and s["files_uploaded"] + s["files_reused"] == s["files"]
    # a 1% update uploads a few percent (a checkpoint in which RocksDB compacted a subtask re-uploads
    # that subtask's compacted files, so look at the median)
    assert sorted(s["bytes_uploaded"] for s in later)[len(later) // 2] < first["bytes_uploaded"] * 0.05


def test_a_max_parallelism_change_is_refused(spark):
    spark, root = spark
    st = Steward.get(spark)
    df = spark.range(100).selectExpr("id as k", "id as v")
    ks = st.keyed_state("fixed", key="k", parallelism=2, max_parallelism=64, checkpoint_dir=str(root / "fixed"))
    ks.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=0).write.format("noop").mode("overwrite").save()
    ks.commit(0, wait=60)
    with pytest.raises(ParallelismError, match=r"keyed state 'fixed' has max_parallelism=64 and cannot be opened "
                                                r"with max_parallelism=32.*Keep max_parallelism=64"):
        st.keyed_state("fixed", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=str(root / "fixed"))
    # a parallelism-only change is accepted; the object with the old parallelism is then refused
    again = st.keyed_state("fixed", key="k", parallelism=4, max_parallelism=64, checkpoint_dir=str(root / "fixed"))
    again.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=1).write.format("noop").mode("overwrite").save()
    assert again.commit(1, wait=60) == 1
    with pytest.raises(ParallelismError, match=r"now has parallelism 4 .* routes rows to 2 subtasks"):
        ks.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=2)
