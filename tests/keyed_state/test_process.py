"""``KeyedState.process`` (issue 8): the foreachBatch function that applies, writes and commits each
batch, on local[2,3] (a failed task is retried up to 3 times). Exactly-once for a retried task, a
second action, a re-run of a committed batch; an older batch refused; a failing sink or user
function aborting the checkpoint and leaving nothing of it. Run under the Spark lock."""

from __future__ import annotations

import uuid
from pathlib import Path

import pandas as pd
import pytest
from sparksteward import Steward
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointOrderError, StateError

from tests.helpers import spark_session, wait_until
from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = pytest.mark.slow

CLUSTER = f"process-{uuid.uuid4().hex[:8]}"


def counting(log: Path, fail: str | None = None):
    """count_sum that logs one line per call to ``log`` (how often the state stage ran); with
    ``fail="first"`` the first attempt of the task holding user-3 raises after writing state, with
    ``fail="always"`` every attempt does."""
    log = str(log)

    def fn(key, rows, state):
        from pyspark import TaskContext

        cur = state.get() or {"n": 0, "s": 0}
        cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
        state.update(cur)
        attempt = TaskContext.get().attemptNumber()
        with open(log, "a") as f:
            f.write(f"{key} {attempt}\n")
        if key == "user-3" and (fail == "always" or (fail == "first" and attempt == 0)):
            raise RuntimeError(f"user function fails on {key}, attempt {attempt}")
        return pd.DataFrame({"k": [key], "n": [cur["n"]], "s": [cur["s"]]})

    return fn


def calls(log: Path) -> list[tuple[str, int]]:
    if not log.exists():
        return []
    return [(k, int(a)) for k, a in (line.split() for line in log.read_text().splitlines())]


# its own session: local[2,3] retries a failed task, and the cluster id names the checkpoint paths
@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    state = tmp_path_factory.mktemp("process-state")
    with spark_session("local[2,3]", **{"spark.steward.state-dir": str(state),
                                        "spark.steward.cluster-id": CLUSTER}) as session:
        yield session


def leftovers(ks, chk: Path) -> set[str]:
    """Files in the state's shared/ that no retained checkpoint references."""
    storage = CheckpointStorage.open(str(chk), ks.name, CLUSTER)
    info = ks.info()
    referenced = set().union(set(), *(storage.read_metadata(c).physical_paths() for c in info["retained"]))
    return storage.stored_files() - referenced


def _keys_in(batches, key):
    return sum(key in set(b["k"]) for b in batches)


def test_retried_tasks_second_actions_and_reruns_give_one_clean_run(spark, tmp_path):
    st = Steward.get(spark)
    chk = tmp_path / "chk"
    ks = st.keyed_state("retry", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(chk))
    batches = make_batches(11, count=3)
    log = tmp_path / "calls.log"
    outputs = {}

    def sink(out, batch_id):
        rows = {tuple(r) for r in out.collect()}
        assert {tuple(r) for r in out.collect()} == rows  # a second action reads the same output
        outputs[batch_id] = rows

    run = ks.process(counting(log, fail="first"), SCHEMA, sink=sink, persist=True)
    for i, b in enumerate(batches):
        run(spark.createDataFrame(b), i)
    assert state_of(ks) == reference(batches)
    seen = calls(log)
    # the task holding user-3 failed once per batch after writing state, and its retry started over
    assert seen.count(("user-3", 1)) == _keys_in(batches, "user-3") >= 2
    # persisted: the sink's two actions ran the state stage once per task attempt
    for (key, attempt) in set(seen):
        assert seen.count((key, attempt)) <= _keys_in(batches, key), (key, attempt)

    # Spark re-delivers batch 2, whose checkpoint completed (the driver died before recording it)
    before = outputs.pop(2)
    run(spark.createDataFrame(batches[2]), 2)
    assert outputs[2] == before and state_of(ks) == reference(batches)
    with pytest.raises(CheckpointOrderError, match=r"checkpoint 1 of state 'retry' is older than its last "
                                                   r"completed checkpoint 2: a batch that old cannot be applied"):
        run(spark.createDataFrame(batches[1]), 1)
    assert ks.info()["pending"] == []
    wait_until(lambda: not leftovers(ks, chk), timeout=30, what="files of replaced attempts to go")


def flushing_sum(log: str):
    """An Arrow-form count and sum per key into a declared value (puts without a TTL: an ingested SST,
    decision 0023) and the batch's sum per key into a value with a TTL (through the WAL, past
    task-flush-size: a flush, decision 0022), whose first attempt of the subtask holding user-3 raises
    after writing every key of its batch."""

    def fn(keys, rows, state):
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark import TaskContext

        g = rows.group_by("k").aggregate([("v", "count"), ("v", "sum")]).combine_chunks()
        agg = state.value("agg")
        old = agg.get_many(g["k"])
        had = pc.is_valid(old)
        n = pc.add(pc.if_else(had, pc.struct_field(old, "n"), 0), g["v_count"]).combine_chunks()
        s = pc.add(pc.if_else(had, pc.struct_field(old, "s"), 0), g["v_sum"]).combine_chunks()
        agg.put_many(g["k"], pa.StructArray.from_arrays([n, s], names=["n", "s"]))
        state.value("last").put_many(g["k"], g["v_sum"])
        attempt = TaskContext.get().attemptNumber()
        with open(log, "a") as f:
            f.write(f"{TaskContext.get().partitionId()} {attempt}\n")
        if attempt == 0 and pc.any(pc.equal(g["k"], "user-3")).as_py():
            raise RuntimeError(f"the first attempt fails after {len(g)} puts")
        return pa.table({"k": g["k"], "n": n, "s": s})

    return fn


def test_retries_and_second_actions_over_batches_that_flush_in_their_tasks(spark, tmp_path):
    """Batches whose subtasks write past ``task-flush-size`` (64 KB of WAL) flush their memtable into an
    SST at the sync phase (decision 0022), and put their large bulk writes in as SSTs of their own
    (decision 0023). The first attempt of one task fails after all its puts and is
    retried from the base; without persist, the sink's second action runs the stage again, whose
    snapshots race the first's for the ack. State and output stay exactly once."""
    import numpy as np
    from sparksteward import value_state

    st = Steward.get(spark)
    ks = st.keyed_state("flushed", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(tmp_path / "chk"),
                        states=[value_state("agg", "n bigint, s bigint"), value_state("last", "bigint", ttl=3600)])
    rng = np.random.default_rng(5)
    batches = [pd.DataFrame({"k": [f"user-{k}" for k in rng.integers(0, 30_000, 40_000)],
                             "v": rng.integers(0, 1000, 40_000)}) for _ in range(2)]
    outputs: dict[int, set[tuple]] = {}

    def sink(out, batch_id):
        rows = {tuple(r) for r in out.collect()}
        assert {tuple(r) for r in out.collect()} == rows   # the second action gets the same rows
        outputs[batch_id] = rows

    log = tmp_path / "calls.log"
    run = ks.process(flushing_sum(str(log)), "k string, n long, s long", sink=sink, form="arrow", persist=False)
    for i, b in enumerate(batches):
        run(spark.createDataFrame(b), i)
        stats = next(c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == i)
        assert len(stats["flush_ms"]) == 2 and all(ms > 0 for ms in stats["flush_ms"]), stats   # both flushed
        assert all(n > 10_000 for n in stats["entries_ingested"]), stats   # and ingested their puts of agg
    attempts = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert any(a == 1 for _, a in attempts) and any(a == 0 for _, a in attempts), attempts   # failed, retried
    seen = pd.concat(batches).groupby("k")["v"].agg(["count", "sum"])
    got = {r.key: (r.value.n, r.value.s) for r in ks.read("agg").collect()}
    assert got == {k: (int(r["count"]), int(r["sum"])) for k, r in seen.iterrows()}
    last = {**batches[0].groupby("k")["v"].sum().to_dict(), **batches[1].groupby("k")["v"].sum().to_dict()}
    assert {r.key: r.value for r in ks.read("last").collect()} == last
    upto = pd.concat(batches[:2]).groupby("k")["v"].agg(["count", "sum"])
    assert outputs[1] == {(k, int(upto.loc[k, "count"]), int(upto.loc[k, "sum"])) for k in set(batches[1]["k"])}


def test_without_persist_a_second_action_runs_the_stage_again_from_the_same_base(spark, tmp_path):
    st = Steward.get(spark)
    ks = st.keyed_state("twice", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(tmp_path / "chk"))
    batches = make_batches(12, count=2)
    log = tmp_path / "calls.log"

    def sink(out, batch_id):
        assert {tuple(r) for r in out.collect()} == {tuple(r) for r in out.collect()}

    run = ks.process(counting(log), SCHEMA, sink=sink, persist=False)
    for i, b in enumerate(batches):
        run(spark.createDataFrame(b), i)
    assert state_of(ks) == reference(batches)
    seen = calls(log)
    assert seen.count(("user-3", 0)) == 2 * _keys_in(batches, "user-3")  # two actions, two stage runs


def test_by_default_one_job_a_batch_until_a_sink_takes_two_actions_and_a_partial_sink_still_commits(
        spark, tmp_path, caplog):
    """``process()`` with its defaults (issue 37 item 4): the state stage runs inside the sink's one
    action (``out`` is not persisted); a sink that takes two actions runs it twice in that batch, which
    the commit's report counts, and from the next batch on the output is persisted (one run); a sink
    whose action computes only some subtasks (``take``) still commits, every subtask run."""
    st = Steward.get(spark)
    batches = make_batches(14, count=6)
    log = tmp_path / "calls.log"
    ks = st.keyed_state("auto", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(tmp_path / "chk"))
    cached: dict[int, bool] = {}
    actions = {"n": 1}

    def sink(out, batch_id):
        cached[batch_id] = out.is_cached
        if actions["n"] == 0:
            out.take(1)   # computes the first partition only
            return
        for _ in range(actions["n"]):
            out.collect()

    run = ks.process(counting(log), SCHEMA, sink=sink)
    run(spark.createDataFrame(batches[0]), 0)
    run(spark.createDataFrame(batches[1]), 1)
    assert cached == {0: False, 1: False} and ks.report(checkpoint_id=1)["stage_runs"] == 1
    assert len(calls(log)) == sum(b["k"].nunique() for b in batches[:2])   # each key once a batch

    actions["n"] = 2
    with caplog.at_level("WARNING", logger="sparksteward"):
        run(spark.createDataFrame(batches[2]), 2)
    assert ks.report(checkpoint_id=2)["stage_runs"] == 2 and not cached[2]
    assert "persists the output from the next batch on" in caplog.text
    run(spark.createDataFrame(batches[3]), 3)
    assert cached[3] and ks.report(checkpoint_id=3)["stage_runs"] == 1

    partial = ks.process(counting(log), SCHEMA, sink=sink)   # a new process(): not persisted again
    actions["n"] = 0
    run_at = len(calls(log))
    partial(spark.createDataFrame(batches[4]), 4)
    assert not cached[4] and ks.info()["last_completed"] == 4
    assert len(calls(log)) - run_at >= batches[4]["k"].nunique()   # every key's subtask ran
    partial(spark.createDataFrame(batches[5]), 5)
    assert state_of(ks) == reference(batches)


def test_a_failing_sink_or_function_aborts_the_batch_and_leaves_nothing(spark, tmp_path):
    st = Steward.get(spark)
    chk = tmp_path / "chk"
    root = chk / CLUSTER / "fails"
    ks = st.keyed_state("fails", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(chk))
    batches = make_batches(13, count=3)
    down = {"sink": False}

    def sink(out, batch_id):
        if down["sink"]:  # at once, while the subtasks' uploads are still in flight: their acks come late
            raise ConnectionError(f"sink is down for batch {batch_id}")
        out.write.mode("append").parquet(str(tmp_path / "out"))

    # persisted: the state stage runs (and uploads) before the sink fails
    good = ks.process(counting(tmp_path / "good.log"), SCHEMA, sink=sink, persist=True)
    good(spark.createDataFrame(batches[0]), 0)
    files_of_0 = {p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()}

    down["sink"] = True
    with pytest.raises(ConnectionError, match="sink is down for batch 1"):
        good(spark.createDataFrame(batches[1]), 1)
    down["sink"] = False
    assert ks.info()["pending"] == [] and not (root / "chk-1").exists()
    wait_until(lambda: {p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()} == files_of_0, timeout=30,
               what="the aborted checkpoint's uploads (late acks included) to go")

    failing = ks.process(counting(tmp_path / "bad.log", fail="always"), SCHEMA, sink=sink, persist=True)
    with pytest.raises(Exception, match="user function fails on user-3"):
        failing(spark.createDataFrame(batches[1]), 1)
    assert calls(tmp_path / "bad.log").count(("user-3", 2)) == 1  # the task was tried 3 times
    assert ks.info()["pending"] == [] and not (root / "chk-1").exists()
    wait_until(lambda: {p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()} == files_of_0, timeout=30,
               what="the failed checkpoint's uploads to go")

    good(spark.createDataFrame(batches[1]), 1)  # Spark re-delivers batch 1
    good(spark.createDataFrame(batches[2]), 2)
    assert state_of(ks) == reference(batches)
    assert not leftovers(ks, chk)


def test_process_arguments_are_checked(spark, tmp_path):
    ks = Steward.get(spark).keyed_state("args", key="k", parallelism=2, max_parallelism=16,
                                        checkpoint_dir=str(tmp_path / "chk"))
    with pytest.raises(StateError, match="sink=None must be a function sink"):
        ks.process(counting(tmp_path / "x"), SCHEMA, sink=None)
    with pytest.raises(StateError, match="form='polars' must be 'pandas'"):
        ks.process(counting(tmp_path / "x"), SCHEMA, sink=print, form="polars")


def _stream(spark, source: Path, chk: Path, run):
    """One streaming query over the JSON files in ``source``, run until they are all processed;
    returns the query (stopped), its exception (if it failed) included."""
    q = (spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).json(str(source))
         .writeStream.foreachBatch(run).option("checkpointLocation", str(chk)).trigger(availableNow=True).start())
    try:
        q.awaitTermination(120)
    except Exception:  # noqa: BLE001 - the test reads q.exception()
        pass
    q.stop()
    return q


def test_one_state_belongs_to_one_streaming_query(spark, tmp_path):
    """Query B's batch 0 is not a re-run of query A's batch 0 (B's rows would never reach the state),
    nor is the batch 0 of A restarted on a deleted checkpointLocation: both are refused by name."""
    st = Steward.get(spark)
    ks = st.keyed_state("one-query", key="k", parallelism=2, max_parallelism=16,
                        checkpoint_dir=str(tmp_path / "state"))
    batches = make_batches(21, count=1)
    source_a, source_b = tmp_path / "in-a", tmp_path / "in-b"
    for d, b in ((source_a, batches[0]), (source_b, make_batches(22, count=1)[0])):
        d.mkdir()
        b.to_json(d / "part-0.json", orient="records", lines=True)
    written = {}
    run = ks.process(count_sum, SCHEMA, sink=lambda out, batch_id: written.setdefault(batch_id, out.count()))
    a = _stream(spark, source_a, tmp_path / "chk-a", run)
    assert a.exception() is None and state_of(ks) == reference(batches)

    b = _stream(spark, source_b, tmp_path / "chk-b", run)
    assert b.exception() is not None
    message = str(b.exception())
    assert f"batch 0 of streaming query {b.id}" in message and f"belongs to streaming query {a.id}" in message
    assert "one state belongs to one query" in message and "restore_from" in message

    again = _stream(spark, source_a, tmp_path / "chk-a-deleted", run)   # A with its checkpointLocation gone
    assert again.exception() is not None and f"belongs to streaming query {a.id}" in str(again.exception())
    assert state_of(ks) == reference(batches) and ks.info()["pending"] == []


_SECOND_APP = """
import sys
import pandas as pd
from pyspark.sql import SparkSession
import sparksteward
from tests.helpers import spark_session
from tests.helpers.keyed import SCHEMA, count_sum

state_dir, checkpoint_dir, cluster = sys.argv[1:4]
with spark_session("local[1]", **{"spark.steward.state-dir": state_dir, "spark.steward.cluster-id": cluster}) as spark:
    try:   # refused at keyed_state() already (issue 35 item 9), before any batch
        ks = sparksteward.Steward.get(spark).keyed_state("shared", key="k", parallelism=2, max_parallelism=16,
                                                          checkpoint_dir=checkpoint_dir)
        print("OPENED", flush=True)
        ks.apply(spark.createDataFrame(pd.DataFrame({"k": ["x"], "v": [1]})), count_sum, SCHEMA).collect()
    except Exception as exc:
        print("REFUSED", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
    else:
        print("ACCEPTED", flush=True)
"""


def test_a_second_application_on_a_state_is_refused_and_the_first_restores(spark, tmp_path):
    """Must-show 3: two applications on one state (same checkpoint dir, cluster id and name): the
    second is refused naming the state, its root and the holder; every checkpoint of the first restores."""
    import subprocess
    import sys

    st = Steward.get(spark)
    chk = tmp_path / "chk"
    ks = st.keyed_state("shared", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(chk), num_retained=3)
    batches = make_batches(31, count=4)
    run = ks.process(count_sum, SCHEMA, sink=lambda out, batch_id: out.count())
    for i, b in enumerate(batches[:2]):
        run(spark.createDataFrame(b), i)
    second = subprocess.run([sys.executable, "-c", _SECOND_APP, str(tmp_path / "app2"), str(chk), CLUSTER],
                            capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[2]))
    line = next((x for x in second.stdout.splitlines() if x.startswith(("REFUSED", "ACCEPTED"))), second.stderr[-3000:])
    assert line.startswith("REFUSED StateLeaseError"), line
    assert "OPENED" not in second.stdout, "refused only at the first batch, not when the state was opened"
    root = CheckpointStorage.open(str(chk), "shared", CLUSTER).url
    assert "keyed state 'shared'" in line and root in line and f"application {spark.sparkContext.applicationId}" in line
    assert "since" in line and "Stop that application" in line
    for i, b in enumerate(batches[2:], start=2):   # the first goes on, untouched
        run(spark.createDataFrame(b), i)
    storage = CheckpointStorage.open(str(chk), "shared", CLUSTER)
    from tests.helpers.keyed import read_values

    retained = ks.info()["retained"]
    assert retained == [1, 2, 3]
    for cid in retained:   # every retained checkpoint restores, to the values of its batches
        import orjson

        meta = storage.read_metadata(cid).to_json()
        values = {k: tuple(orjson.loads(v).values()) for k, v in read_values(str(chk), "shared", CLUSTER, meta)}
        assert values == reference(batches[:cid + 1]), cid
