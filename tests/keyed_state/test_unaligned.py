"""Unaligned checkpoints through the Spark API (issue 10, first slice): a subtask past its aligned
checkpoint timeout defers the rest of its input into the checkpoint as channel state (merged like
every small file), the next batch replays it first, a rescale re-routes it by key group, and bad
inputs are named. Real local[2] Spark with small Arrow batches, so a partition has many buffers."""

from __future__ import annotations

import pandas as pd
import pytest
from sparksteward import Steward
from sparksteward.errors import ConfigError, StewardError

from tests.helpers import spark_session
from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("unaligned")


# its own session: small Arrow batches (maxRecordsPerBatch=20) make subtasks defer input
@pytest.fixture(scope="module")
def spark(dirs):
    with spark_session("local[2]", **{"spark.steward.state-dir": str(dirs / "state"),
                                      "spark.sql.execution.arrow.maxRecordsPerBatch": "20"}) as session:
        yield session


@pytest.fixture(scope="module")
def st(spark):
    return Steward.get(spark)


def _run(spark, ks, batches, first_id=0):
    for i, b in enumerate(batches):
        ks.apply(spark.createDataFrame(b, "k string, v long"), count_sum, SCHEMA, checkpoint_id=first_id + i).collect()
        ks.commit(first_id + i, wait=60)
    return [c for c in ks.info()["checkpoints"] if c["checkpoint_id"] >= first_id]


def test_deferred_input_is_replayed_and_counted_exactly_once(spark, st, dirs):
    batches = make_batches(31, count=3, rows=400)
    ks = st.keyed_state("defer", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    stats = _run(spark, ks, batches)
    for c in stats:  # timeout 0: each subtask processes one buffer and defers the rest
        assert c["rows_deferred"] > 0 and c["channel_bytes"] > 0 and c["unaligned_subtasks"], c
        assert all(s["rows_processed"] >= 1 for s in c["per_subtask"])
    assert sum(c["rows_processed"] for c in stats) + stats[-1]["rows_deferred"] == sum(len(b) for b in batches)
    meta = ks.info()["latest"]
    assert any(sub["channel_state"] for sub in meta["subtasks"])
    assert all(f["path"].startswith("merged/") for sub in meta["subtasks"] for f in sub["channel_state"])
    # aligned again: the next batch replays what is deferred, then its own (empty) input
    ks = st.keyed_state("defer", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="aligned")
    last = _run(spark, ks, [batches[0].iloc[:0]], first_id=3)[-1]
    assert last["rows_deferred"] == 0 and last["channel_bytes"] == 0
    assert state_of(ks) == reference(batches)


def test_rescale_8_to_3_with_pending_channel_state_reroutes_by_key_group(spark, st, dirs):
    """Must-show 3: 8 -> 3 -> 5 while channel state is pending: replayed rows go to the subtask that
    owns their key group now, filtered while re-persisted, so the channel state after two rescales
    is no larger than before them; the final state is a clean run's."""
    batches = make_batches(32, count=2, rows=600, keys=80)
    ks = st.keyed_state("resc", key="k", parallelism=8, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    before = _run(spark, ks, batches)[-1]
    assert before["channel_bytes"] > 0 and before["rows_deferred"] > 0
    sizes = []
    for cid, p in ((2, 3), (3, 5)):
        ks = st.keyed_state("resc", key="k", parallelism=p, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                            alignment="unaligned", aligned_checkpoint_timeout=0)
        after = _run(spark, ks, [batches[0].iloc[:0]], first_id=cid)[-1]
        sizes.append((after["rows_deferred"], after["channel_bytes"]))
    print(f"\nchannel state before the rescales: {before['rows_deferred']} rows, {before['channel_bytes']} B; "
          f"after 8 -> 3 and 3 -> 5: {sizes}")
    assert sizes[-1][0] <= before["rows_deferred"] and sizes[-1][1] <= before["channel_bytes"]
    ks = st.keyed_state("resc", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="aligned")
    _run(spark, ks, [batches[0].iloc[:0]], first_id=4)
    assert state_of(ks) == reference(batches)


def test_a_failure_after_the_state_stage_of_an_unaligned_batch_is_exactly_once(spark, st, dirs, tmp_path):
    """Must-show 2: skewed input, deferral in every batch, and the sink failing after the state stage
    of batch 1: re-delivered, it starts again from checkpoint 0 with checkpoint 0's channel state.
    The final values, and each key's last row in the sink, equal an aligned run without the failure."""
    import pyarrow.parquet as pq

    rnd = __import__("random").Random(34)
    batches = [pd.DataFrame({"k": [f"user-{rnd.randrange(3) if rnd.random() < 0.8 else rnd.randrange(40)}"
                                   for _ in range(500)], "v": [rnd.randrange(100) for _ in range(500)]})
               for _ in range(3)]
    failed = {"once": False}

    def sink_to(out_dir):
        def sink(out, batch_id):
            if out_dir.name == "unaligned" and batch_id == 1 and not failed["once"]:
                failed["once"] = True
                raise ConnectionError("sink down after the state stage of batch 1")
            out.write.mode("append").parquet(str(out_dir / f"batch={batch_id}"))
        return sink

    runs = {}
    for mode in ("aligned", "unaligned"):
        opts = {"alignment": mode, "aligned_checkpoint_timeout": 0} if mode == "unaligned" else {"alignment": mode}
        ks = st.keyed_state(f"eo-{mode}", key="k", parallelism=3, max_parallelism=16,
                            checkpoint_dir=str(dirs / "chk"), **opts)
        run = ks.process(count_sum, SCHEMA, sink=sink_to(tmp_path / mode))
        for i, b in enumerate(batches):
            df = spark.createDataFrame(b, "k string, v long")
            if mode == "unaligned" and i == 1:
                with pytest.raises(Exception, match="sink down after the state stage"):
                    run(df, 1)
                assert ks.info()["pending"] == []  # aborted: batch 1 is re-delivered below
            run(df, i)
        if mode == "unaligned":
            assert sum(c["rows_deferred"] for c in ks.info()["checkpoints"]) > 0
            ks = st.keyed_state(f"eo-{mode}", key="k", parallelism=3, max_parallelism=16,
                                checkpoint_dir=str(dirs / "chk"), alignment="aligned")
            run = ks.process(count_sum, SCHEMA, sink=sink_to(tmp_path / mode))
            run(spark.createDataFrame(batches[0].iloc[:0], "k string, v long"), 3)  # drain what is deferred
        rows = pq.read_table(tmp_path / mode).to_pandas()
        last = rows.sort_values("n").groupby("k").tail(1)
        runs[mode] = (state_of(ks), {r.k: (int(r.n), int(r.s)) for r in last.itertuples()})
    assert runs["unaligned"][0] == runs["aligned"][0] == reference(batches)
    assert runs["unaligned"][1] == runs["aligned"][1] == reference(batches)


def test_a_corrupt_channel_state_file_fails_the_task_and_aborts_the_checkpoint(spark, st, dirs):
    import orjson

    batches = make_batches(35, count=1, rows=400)
    root = dirs / "chk" / "default" / "corrupt"
    ks = st.keyed_state("corrupt", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    _run(spark, ks, batches)
    meta = orjson.loads((root / "chk-0" / "_metadata").read_bytes())
    seg = next(f for s in meta["subtasks"] for f in s["channel_state"])
    physical = root / seg["path"]
    data = bytearray(physical.read_bytes())
    data[seg["offset"] + seg["length"] // 2] ^= 0xFF
    physical.write_bytes(bytes(data))
    with pytest.raises(Exception, match=rf"file {seg['name']} .* of checkpoint 0 of state 'corrupt', subtask \d is "
                                        rf"corrupt: expected checksum"):
        ks.apply(spark.createDataFrame(batches[0], "k string, v long"), count_sum, SCHEMA, checkpoint_id=1).collect()
    with pytest.raises(StewardError):
        ks.commit(1, wait=1)
    assert ks.info()["pending"] == [] and not (root / "chk-1").exists()


def test_bad_alignment_inputs_are_named(spark, st, dirs):
    with pytest.raises(ConfigError, match=r"aligned_checkpoint_timeout=-1 must be a number of seconds >= 0"):
        st.keyed_state("bad", key="k", parallelism=2, checkpoint_dir=str(dirs / "chk"), alignment="unaligned",
                       aligned_checkpoint_timeout=-1)
    with pytest.raises(ConfigError, match=r"alignment='sideways' is not valid"):
        st.keyed_state("bad", key="k", parallelism=2, checkpoint_dir=str(dirs / "chk"), alignment="sideways")
    ks = st.keyed_state("tiny", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned_max_inflight", aligned_checkpoint_timeout=0, max_inflight_bytes=10)
    batch = make_batches(33, count=1)
    # a cap below one buffer can defer nothing: every subtask finishes aligned, at once and exactly
    stats = _run(spark, ks, batch)[-1]
    assert stats["rows_deferred"] == 0 and stats["rows_processed"] == len(batch[0])
    assert state_of(ks) == reference(batch)


def test_a_channel_state_file_of_a_newer_version_is_refused_and_the_checkpoint_aborted(spark, st, dirs):
    """A checkpoint whose channel state was written by a newer spark-steward (a valid checksum, an
    unknown version): restored elsewhere, its replay fails the task with a message naming the file
    and the fix, and the checkpoint is aborted with nothing half-written."""
    import orjson
    import xxhash

    batches = make_batches(36, count=1, rows=400)
    src_root = dirs / "chk" / "default" / "newer-src"
    ks = st.keyed_state("newer-src", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0, file_merging=False)
    _run(spark, ks, batches)
    meta = orjson.loads((src_root / "chk-0" / "_metadata").read_bytes())
    sub = next(s for s in meta["subtasks"] if s["channel_state"])
    seg = sub["channel_state"][0]
    old_path = src_root / seg["path"]
    data = bytearray(old_path.read_bytes())
    data[7] = 9  # the version byte after the magic
    digest = xxhash.xxh3_128(bytes(data)).hexdigest()
    (src_root / "shared" / digest).write_bytes(bytes(data))
    seg.update(checksum=digest, path=f"shared/{digest}")
    (src_root / "chk-0" / "_metadata").write_bytes(orjson.dumps(meta))
    ks2 = st.keyed_state("newer-dst", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                         restore_from=str(src_root / "chk-0"))
    with pytest.raises(Exception, match=r"channel-state file .* was written by a newer spark-steward \(version 9; "
                                        r"this one reads up to 1\): upgrade spark-steward"):
        ks2.apply(spark.createDataFrame(batches[0], "k string, v long"), count_sum, SCHEMA, checkpoint_id=0).collect()
    with pytest.raises(StewardError):
        ks2.commit(0, wait=1)
    dst_root = dirs / "chk" / "default" / "newer-dst"
    assert ks2.info()["pending"] == [] and not (dst_root / "chk-0").exists()


def _echo_slow_once(marker: str):
    """Arrow form: one output row per input row; the second call of the first stage run sleeps past
    the timeout (so that run cuts after two buffers), later runs are fast (they would cut after one)."""

    def fn(keys, rows, state):
        import os
        import time

        import pyarrow as pa

        calls = f"{marker}.calls"
        with open(calls, "a") as f:
            f.write("x")
        if os.path.getsize(calls) == 2 and not os.path.exists(f"{marker}.slept"):
            open(f"{marker}.slept", "w").close()
            time.sleep(2.5)
        return pa.table({"k": rows.column("k"), "v": rows.column("v")})

    return fn


def test_every_attempt_of_an_unaligned_batch_cuts_the_same_rows(spark, st, dirs, tmp_path):
    """Item 5: a second action on an unaligned batch recomputes its subtask with another timing (its
    deadline has passed at once) and must still emit exactly the rows of the first; then every input
    row is emitted exactly once across the batch and the drain of its deferred rows."""
    rows = make_batches(34, count=1, rows=200, keys=40)[0]
    ks = st.keyed_state("cut-once", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=1.5)
    out = ks.apply_arrow(spark.createDataFrame(rows, "k string, v long"), _echo_slow_once(str(tmp_path / "m")),
                         "k string, v long", checkpoint_id=0)
    first = sorted(map(tuple, out.collect()))
    second = sorted(map(tuple, out.collect()))   # no persist: the stage runs again, from the same base
    assert 0 < len(first) < len(rows) and second == first
    ks.commit(0, wait=60)
    deferred = ks.info()["checkpoints"][-1]["rows_deferred"]
    assert deferred == len(rows) - len(first)
    ks = st.keyed_state("cut-once", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="aligned")
    drained = ks.apply_arrow(spark.createDataFrame(rows.iloc[:0], "k string, v long"),
                             lambda keys, r, state: r.select(["k", "v"]), "k string, v long", checkpoint_id=1)
    emitted = first + sorted(map(tuple, drained.collect()))
    ks.commit(1, wait=60)
    assert sorted(emitted) == sorted(map(tuple, rows.itertuples(index=False)))   # each row once, none lost


def test_drain_processes_the_backlog_and_the_next_batch_is_not_taken_for_its_rerun(spark, st, dirs, tmp_path):
    """Items 12-13: with no further input, drain() processes the deferred rows (aligned, under the next
    checkpoint id) through process()'s fn and sink; Spark's next batch id, equal to the drain's
    checkpoint id, gets the id after it (not a re-run that would drop its rows). A new input schema
    while rows are deferred fails naming the fix."""
    import pyarrow.parquet as pq

    batches = make_batches(36, count=3, rows=400, keys=40)
    ks = st.keyed_state("drain", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    seen = []

    def sink(out, cid):   # the ids written: the state stage runs inside the write (process() does not persist)
        out.write.mode("append").parquet(str(tmp_path / f"id={cid}"))
        seen.append(cid)

    run = ks.process(count_sum, SCHEMA, sink=sink)
    for i in range(2):
        run(spark.createDataFrame(batches[i], "k string, v long"), i)
    backlog = ks.info()["backlog"]
    assert backlog["checkpoint_id"] == 1 and backlog["rows"] > 0 and backlog["bytes"] > 0, backlog
    renamed = spark.createDataFrame(batches[2], "k string, v long").withColumnRenamed("v", "w")
    with pytest.raises(Exception, match=r"before changing the input schema"):
        run(renamed, 2)   # fails and aborts checkpoint 2: the drain below takes that id, the retry the next
    assert ks.info()["pending"] == []

    assert ks.drain() == 2 and seen[-1] == 2
    info = ks.info()
    assert info["backlog"]["bytes"] == 0 and info["drains"] == [2]
    assert state_of(ks) == reference(batches[:2])
    assert ks.drain() is None   # nothing left

    run(spark.createDataFrame(batches[2], "k string, v long"), 2)   # Spark's batch 2: checkpoint 3
    assert seen == [0, 1, 2, 3] and ks.info()["last_completed"] == 3
    assert ks.info()["backlog"]["rows"] > 0   # timeout 0: it deferred most of its rows again
    assert ks.drain() == 4 and ks.info()["drains"] == [2, 4]
    assert state_of(ks) == reference(batches)
    rows = pq.read_table(tmp_path).to_pandas()
    last = rows.sort_values("n").groupby("k").tail(1)
    assert {r.k: (int(r.n), int(r.s)) for r in last.itertuples()} == reference(batches)


def test_rows_a_cut_defers_are_judged_by_the_watermark_of_the_batch_they_arrived_in(spark, st, dirs):
    """Issue 38 with FLIP-76: a row on time in its batch that the cut defers is not late when the next batch
    replays it (the next watermark counts the deferred rows' event times; judging them again would drop
    them), so the unaligned run keeps every row, as the aligned one does, and no row is counted late."""
    batch = make_batches(38, count=1, rows=400)[0]
    batch["ts"] = pd.to_datetime(1_800_000_000_000 + 1000 * pd.RangeIndex(len(batch)), unit="ms", utc=True)
    ks = st.keyed_state("defer-event", key="k", parallelism=2, max_parallelism=16,
                        checkpoint_dir=str(dirs / "chk-event"), alignment="unaligned", aligned_checkpoint_timeout=0,
                        event_time="ts", watermark_delay=0)
    empty = batch.iloc[:0]
    ks.apply(spark.createDataFrame(batch), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    assert ks.report(checkpoint_id=0)["rows_deferred"] > 0
    assert ks.report(checkpoint_id=0)["max_event_ms"] == 1_800_000_000_000 + 399_000   # deferred rows count
    ks.apply(spark.createDataFrame(empty, spark.createDataFrame(batch).schema), count_sum, SCHEMA,
             checkpoint_id=1).collect()
    ks.commit(1, wait=60)
    drained = st.keyed_state("defer-event", key="k", parallelism=2, max_parallelism=16,
                             checkpoint_dir=str(dirs / "chk-event"), alignment="aligned", event_time="ts",
                             watermark_delay=0)
    drained.apply(spark.createDataFrame(empty, spark.createDataFrame(batch).schema), count_sum, SCHEMA,
                  checkpoint_id=2).collect()
    drained.commit(2, wait=60)
    assert [r["late_rows"] for r in (ks.report(checkpoint_id=0), ks.report(checkpoint_id=1),
                                     drained.report(checkpoint_id=2))] == [0, 0, 0]
    assert state_of(drained) == reference([batch])


def test_timers_of_keys_a_cut_deferred_wait_for_their_rows_so_sessions_equal_an_aligned_run(spark, st, dirs):
    """Issue 38 with FLIP-76: a key's due timer does not overtake the key's own rows that the cut deferred
    (it would close a session those on-time rows extend): the timers of a key with deferred rows fire in the
    batch that processes them, after them; other keys' timers fire as usual. So event-time sessions
    (``windows.sessions``, 60 s gap) over an unaligned run (timeout 0: every subtask defers, the backlog
    grows) are exactly those of the aligned run."""
    from sparksteward.windows import sessions

    t0 = 1_800_000_000_000
    rnd = __import__("random").Random(3811)
    batches = []
    for b in range(7):   # each batch 45 s of event time after the last, on 8 of the 25 keys: keys go quiet
        active = rnd.sample(range(25), 8)   # past the gap (their timers are due) and come back later
        keys = [f"user-{rnd.choice(active)}" for _ in range(150)]
        batches.append(pd.DataFrame({"k": keys, "ts": pd.to_datetime(
            [t0 + b * 45_000 + rnd.randrange(5_000) for _ in keys], unit="ms", utc=True)}))
    batches.append(pd.DataFrame({"k": ["zz"], "ts": pd.to_datetime([t0 + 3_600_000], unit="ms", utc=True)}))
    schema = spark.createDataFrame(batches[0]).schema
    s = sessions(key="k", time="ts", gap=60)

    def run(alignment):
        opts = dict(key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / f"chk-sessions-{alignment}"),
                    event_time="ts", watermark_delay=0, states=s.states)
        ks = st.keyed_state(f"sessions-{alignment}", alignment=alignment,
                            **({"aligned_checkpoint_timeout": 0} if alignment == "unaligned" else {}), **opts)
        out, deferred = [], 0
        for i, b in enumerate(batches + [b.iloc[:0] for b in batches[:2]]):
            if i == len(batches) + 1:   # the last batch aligned: everything deferred is processed
                ks = st.keyed_state(f"sessions-{alignment}", alignment="aligned", **opts)
            out += ks.apply(spark.createDataFrame(b, schema), s.fn, s.schema, checkpoint_id=i,
                            on_timer=s.on_timer).collect()
            ks.commit(i, wait=60)
            deferred += ks.report(checkpoint_id=i)["rows_deferred"]
        return sorted(tuple(r) for r in out), deferred

    aligned, none = run("aligned")
    unaligned, deferred = run("unaligned")
    assert none == 0 and deferred > 0
    assert len(aligned) > 25 and aligned == unaligned   # the same sessions closed, each once


def _count_and_arm(key, rows, state):
    state.update((state.get() or 0) + len(rows))
    state.timers.register(1_800_000_000_001, time="event")   # due once the watermark passes T + 1 ms


def _emit(key, timers, state):
    n = state.get()
    state.clear()
    return pd.DataFrame({"k": [key], "n": [n]})


def test_a_key_s_due_timer_waits_for_its_rows_the_cut_deferred(spark, st, dirs):
    """Issue 38 with FLIP-76: batch 1 defers the rows of ``hot`` (its key group is the subtask's last, after
    40 rows of others; timeout 0) while ``hot``'s timer is due: the timer waits, and fires in batch 2 after
    the deferred row is counted (``hot``, 2), never before it as (``hot``, 1) then (``hot``, 1)."""
    from sparksteward.state.keygroups import key_group

    t0 = 1_800_000_000_000
    hot = next(f"hot-{i}" for i in range(1000) if key_group(f"hot-{i}", 16, "string") == 15)
    others = [f"k-{i}" for i in range(1000) if key_group(f"k-{i}", 16, "string") < 15][:40]
    opts = dict(key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk-hold"),
                event_time="ts", watermark_delay=0)
    frame = [pd.DataFrame({"k": [hot, "far"], "ts": pd.to_datetime([t0, t0 + 100_000], unit="ms", utc=True)}),
             pd.DataFrame({"k": others + [hot], "ts": pd.to_datetime([t0 + 200_000] * 41, unit="ms", utc=True)})]
    schema = spark.createDataFrame(frame[0]).schema
    frame.append(frame[0].iloc[:0])
    out, deferred = [], []
    for i, alignment in enumerate(("aligned", "unaligned", "aligned")):
        ks = st.keyed_state("hold", alignment=alignment, **opts,
                            **({"aligned_checkpoint_timeout": 0} if alignment == "unaligned" else {}))
        out.append(sorted(tuple(r) for r in ks.apply(spark.createDataFrame(frame[i], schema), _count_and_arm,
                                                     "k string, n long", checkpoint_id=i, on_timer=_emit).collect()))
        ks.commit(i, wait=60)
        deferred.append(ks.report(checkpoint_id=i)["rows_deferred"])
    assert deferred[1] >= 1 and hot not in {k for k, _ in out[1]}   # hot's row deferred
    assert (hot, 1) not in out[1] and (hot, 2) in out[2]
    assert sum(n for batch in out for k, n in batch) == 43   # every row counted once, every key fired once


def _count_no_flag(key, rows, state):
    assert "__late" not in rows.columns, "late='drop' hands no late flag over"
    return count_sum(key, rows, state)


def test_a_backlog_deferred_under_late_keep_replays_under_late_drop(spark, st, dirs):
    """Rows are judged before the cut, so under ``late="keep"`` the channel state holds them with their late
    flag; reopened with ``late="drop"``, the drain replays the backlog without the flag and leaves out the rows
    flagged late (no schema mismatch between the replayed and the new rows)."""
    from sparksteward.state.keygroups import key_group

    t0 = 1_800_000_000_000
    low = [f"a-{i}" for i in range(2000) if key_group(f"a-{i}", 16, "string") == 0][:20]
    high = [f"z-{i}" for i in range(2000) if key_group(f"z-{i}", 16, "string") == 15][:40]
    first = pd.DataFrame({"k": ["w"], "v": 1, "ts": pd.to_datetime([t0 + 100_000], unit="ms", utc=True)})
    second = pd.DataFrame({"k": low + high, "v": 1, "ts": pd.to_datetime(   # on time in key group 0, late in 15
        [t0 + 200_000] * 20 + [t0 + 50_000] * 40, unit="ms", utc=True)})
    schema = spark.createDataFrame(second).schema
    opts = dict(key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk-keep"), event_time="ts",
                watermark_delay=0)
    ks = st.keyed_state("keep-drop", alignment="aligned", late="keep", **opts)
    ks.apply(spark.createDataFrame(first, schema), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    ks = st.keyed_state("keep-drop", alignment="unaligned", aligned_checkpoint_timeout=0, late="keep", **opts)
    ks.apply(spark.createDataFrame(second, schema), count_sum, SCHEMA, checkpoint_id=1).collect()
    ks.commit(1, wait=60)
    report = ks.report(checkpoint_id=1)
    assert report["late_rows"] == 40 and report["rows_deferred"] >= 40
    ks = st.keyed_state("keep-drop", alignment="aligned", late="drop", **opts)
    ks.apply(spark.createDataFrame(second.iloc[:0], schema), _count_no_flag, SCHEMA, checkpoint_id=2).collect()
    ks.commit(2, wait=60)
    assert ks.report(checkpoint_id=2)["rows_deferred"] == 0
    assert state_of(ks) == {"w": (1, 1), **{k: (1, 1) for k in low}}   # the 40 late rows left out


def _chunks_slow(marker: str):
    """``form="chunks"``: count and sum a key's rows chunk by chunk, 60 ms a chunk, and note per call the
    key and how many rows it read (in ``marker``), so the test sees where the cut fell."""

    def fn(key, chunks, state):
        import time

        n = s = 0
        for chunk in chunks:
            time.sleep(0.06)
            n, s = n + len(chunk), s + int(chunk["v"].sum())
        with open(marker, "a") as f:
            f.write(f"{key} {n}\n")
        cur = state.get() or {"n": 0, "s": 0}
        cur = {"n": cur["n"] + n, "s": cur["s"] + s}
        state.update(cur)
        return key, cur["n"], cur["s"]

    return fn


def test_a_cut_falls_inside_a_hot_key_with_chunks_and_every_row_is_counted_once(spark, st, dirs, tmp_path):
    """Issue 38 item 6 through Spark: with ``form="chunks"`` (20-row chunks, 60 ms each) the unaligned cut of a
    subtask whose first key group holds a hot key of 400 rows falls inside that key's call (the record keeps
    ``cut_rows``); a second action on the unpersisted output emits exactly the first's rows; the next batch's
    call of the hot key reads the rest first; the final state is every row counted once."""
    from sparksteward.state.keygroups import key_group

    hot = next(f"hot-{i}" for i in range(1000) if key_group(f"hot-{i}", 16, "string") == 0)
    others = [f"k-{i}" for i in range(1000) if key_group(f"k-{i}", 16, "string") > 0][:30]
    batches = [pd.DataFrame({"k": [hot] * 400 + others * 4, "v": list(range(520))}),
               pd.DataFrame({"k": [hot] * 40 + others, "v": list(range(70))})]
    spark.conf.set("spark.steward.state.chunk-rows", "20")
    try:
        opts = dict(key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk-chunks"))
        ks = st.keyed_state("chunks", alignment="unaligned", aligned_checkpoint_timeout=1.0, **opts)
        marker = str(tmp_path / "calls")
        out = ks.apply(spark.createDataFrame(batches[0], "k string, v long"), _chunks_slow(marker), SCHEMA,
                       checkpoint_id=0, chunks=True)
        first = sorted(map(tuple, out.collect()))
        second = sorted(map(tuple, out.collect()))   # no persist: the stage runs again from the same base
        ks.commit(0, wait=60)
        latest = ks.info()["latest"]
        calls = [line.split() for line in open(marker).read().splitlines()]
        read = int(next(n for k, n in calls if k == hot))
        assert second == first and [k for k, _, _ in first] == [hot]   # the cut fell inside the hot key
        assert 0 < read < 400 and latest["properties"]["cut_rows"] == {"0": read}, (read, latest["properties"])
        assert ks.report(checkpoint_id=0)["rows_deferred"] == 520 - read
        open(marker, "w").close()
        ks = st.keyed_state("chunks", alignment="aligned", **opts)
        ks.apply(spark.createDataFrame(batches[1], "k string, v long"), _chunks_slow(marker), SCHEMA,
                 checkpoint_id=1, chunks=True).collect()
        ks.commit(1, wait=60)
        calls = [line.split() for line in open(marker).read().splitlines()]
        assert [int(n) for k, n in calls if k == hot] == [400 - read + 40]   # one call: the rest, then the new
        assert state_of(ks) == reference(batches)
    finally:
        spark.conf.unset("spark.steward.state.chunk-rows")
