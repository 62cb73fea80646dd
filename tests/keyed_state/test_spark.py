"""Keyed state in Spark, end to end (issue 8): st.keyed_state(...).apply/apply_arrow/commit/read on
local[2] (and local-cluster in test_spark_cluster.py). Run under the Spark lock."""

from __future__ import annotations

import pandas as pd
import pytest
from sparksteward import Steward
from sparksteward.errors import CheckpointError, StateEncodingError

from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = pytest.mark.slow


def rows_of(df) -> set[tuple]:
    return {tuple(r) for r in df.collect()}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("kstate")


@pytest.fixture(scope="module")
def st(spark):
    return Steward.get(spark)


@pytest.mark.compat
def test_count_and_sum_over_three_batches_equals_pandas_and_is_exactly_once(spark, st, dirs):
    batches = make_batches(1)
    ks = st.keyed_state("counts", key="k", parallelism=3, max_parallelism=16, checkpoint_dir=str(dirs / "chk"))
    seen = []
    for i, b in enumerate(batches):
        out = ks.apply(spark.createDataFrame(b), count_sum, SCHEMA, checkpoint_id=None if i == 2 else i)
        first = rows_of(out)
        assert rows_of(out) == first  # a second action on the lazy output restores the same base
        assert ks.commit(ks.last_checkpoint_id, wait=60) == i
        seen.append(first)
        if i == 1:  # the batch is applied again with the same id (a re-run): same output, same state
            again = ks.apply(spark.createDataFrame(b), count_sum, SCHEMA, checkpoint_id=1)
            assert rows_of(again) == first
            assert ks.commit(1, wait=60) == 1
    expected = reference(batches)
    assert state_of(ks) == expected
    # the last batch's output carries the running totals of the keys it touched
    last = {k: (n, s) for k, n, s in seen[2]}
    assert last == {k: expected[k] for k in set(batches[2]["k"])}
    info = ks.info()
    assert info["last_completed"] == 2 and info["pending"] == []
    assert (dirs / "chk" / "default" / "counts" / "chk-2" / "_metadata").is_file()
    assert not (dirs / "chk" / "default" / "counts" / "chk-0").exists()  # subsumed


@pytest.mark.compat
def test_apply_arrow_form(spark, st, dirs):
    import pyarrow as pa
    import pyarrow.compute as pc

    def fn(keys, rows, state):
        sums = {}
        for k, v in zip(rows.column("k").to_pylist(), rows.column("v").to_pylist()):
            sums[k] = sums.get(k, 0) + v
        ks_ = keys.to_pylist()
        old = state.get_many(ks_)
        new = [(o or 0) + sums[k] for k, o in zip(ks_, old)]
        state.put_many(ks_, new)
        return pa.table({"k": ks_, "total": new})

    batches = make_batches(2, count=2)
    ks = st.keyed_state("arrow", key="k", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    for i, b in enumerate(batches):
        ks.apply_arrow(spark.createDataFrame(b), fn, "k string, total long", checkpoint_id=i).collect()
        ks.commit(i, wait=60)
    import orjson

    got = {r.key: orjson.loads(r.value) for r in ks.read().collect()}
    assert got == {k: s for k, (_, s) in reference(batches).items()}
    assert pc is not None


def test_failing_function_fails_the_task_and_aborts_the_checkpoint(spark, st, dirs):
    batches = make_batches(3, count=2)
    root = dirs / "chk" / "default" / "boom"
    ks = st.keyed_state("boom", key="k", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    ks.apply(spark.createDataFrame(batches[0]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    files_after_0 = sorted(p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir())

    def explode(key, rows, state):
        state.update({"n": -1, "s": -1})
        raise ValueError(f"boom on {key}")

    with pytest.raises(Exception, match="boom on user-"):
        ks.apply(spark.createDataFrame(batches[1]), explode, SCHEMA, checkpoint_id=1).collect()
    with pytest.raises(CheckpointError, match="cannot complete: subtasks .* have not acked"):
        ks.commit(1, wait=1)
    assert not (root / "chk-1").exists()
    assert sorted(p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()) == files_after_0
    assert ks.info()["pending"] == []
    # the batch applied again with a working function continues from checkpoint 0
    ks.apply(spark.createDataFrame(batches[1]), count_sum, SCHEMA, checkpoint_id=1).collect()
    ks.commit(1, wait=60)
    assert state_of(ks) == reference(batches)


def test_bad_key_column_is_named(spark, st, dirs):
    df = spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1.5]}))
    ks = st.keyed_state("badkey", key="user", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    with pytest.raises(StateEncodingError, match=r"key column 'user' .* does not exist; .*\['k', 'v'\]"):
        ks.apply(df, count_sum, SCHEMA)
    ks = st.keyed_state("badtype", key="v", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    with pytest.raises(StateEncodingError, match=r"key column 'v' .* has type double.*cast it"):
        ks.apply(df, count_sum, SCHEMA)


def test_a_scoped_job_records_the_final_checkpoint_of_each_state(spark, st, dirs):
    """FLIP-194 keeps a job's final checkpoint with its result: the JobResultStore entry of a nightly
    batch job names each keyed state it committed and the last completed checkpoint, restorable by path."""
    from sparksteward.checkpoint.storage import open_checkpoint

    ks = st.keyed_state("nightly", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"))
    batches = make_batches(7, count=2)
    with st.job("nightly-2026-11-22") as job:
        for b in batches:
            ks.apply(spark.createDataFrame(b), count_sum, SCHEMA).count()  # checkpoint_id=None: the next id
            ks.commit()
        job.set_result({"batches": len(batches)})
    entry = st.job_results.get("nightly-2026-11-22")
    [final] = entry.result.checkpoints
    assert (final.state, final.checkpoint_id) == ("nightly", 1)
    assert final.path.endswith("/nightly/chk-1")
    _, meta = open_checkpoint(final.path)
    assert meta.checkpoint_id == 1
    outside = st.keyed_state("outside", key="k", parallelism=1, max_parallelism=16, checkpoint_dir=str(dirs / "chk"))
    outside.apply(spark.createDataFrame(batches[0]), count_sum, SCHEMA).count()
    outside.commit()  # outside any scope: nothing recorded, nothing raised
    assert [c.state for c in st.job_results.get("nightly-2026-11-22").result.checkpoints] == ["nightly"]


def test_a_value_that_cannot_be_encoded_fails_the_task_naming_it_and_writes_nothing(spark, st, dirs):
    import datetime

    batches = make_batches(5, count=2)
    root = dirs / "chk" / "default" / "badvalue"
    ks = st.keyed_state("badvalue", key="k", parallelism=2, max_parallelism=8, checkpoint_dir=str(dirs / "chk"))
    ks.apply(spark.createDataFrame(batches[0]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    files_after_0 = sorted(p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir())

    def keeps_a_set(key, rows, state):
        state.update({"seen": {datetime.date(2026, 11, 22)}, "n": len(rows)})
        return

    with pytest.raises(Exception, match=r"state value .* of type dict cannot be encoded.*convert other objects"):
        ks.apply(spark.createDataFrame(batches[1]), keeps_a_set, SCHEMA, checkpoint_id=1).collect()
    ks.abort(1)
    assert not (root / "chk-1").exists()
    assert sorted(p.name for d in ("shared", "merged") if (root / d).is_dir() for p in (root / d).iterdir()) == files_after_0
    ks.apply(spark.createDataFrame(batches[1]), count_sum, SCHEMA, checkpoint_id=1).collect()
    ks.commit(1, wait=60)
    assert state_of(ks) == reference(batches)


def test_a_keyed_state_survives_a_restart_of_the_driver_agent(spark, st, dirs):
    """The shim restarts a SIGKILLed driver agent; the KeyedState a streaming query holds registers
    again by itself (the new agent takes the lease over from the dead one) instead of failing every
    later batch with "not registered"."""
    import signal

    from tests.helpers import agent_processes, wait_until

    batches = make_batches(41, count=2)
    ks = st.keyed_state("survivor", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"))
    ks.apply(spark.createDataFrame(batches[0]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    (old,) = [p for p in agent_processes() if any("agents.driver" in c for c in p.cmdline())]
    old.send_signal(signal.SIGKILL)
    wait_until(lambda: [p for p in agent_processes() if any("agents.driver" in c for c in p.cmdline())
                        and p.pid != old.pid], timeout=60, what="the shim to restart the driver agent")
    wait_until(lambda: _answers(st), timeout=60, what="the new driver agent to answer")
    ks.apply(spark.createDataFrame(batches[1]), count_sum, SCHEMA, checkpoint_id=1).collect()
    assert ks.commit(1, wait=60) == 1
    assert state_of(ks) == reference(batches)


def _answers(st) -> bool:
    try:
        st.health()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def test_workers_fork_from_a_frozen_daemon_and_a_state_task_freezes_its_imports(spark, st, dirs):
    """PySpark runs a full gc.collect() after each task of a reused worker. Our daemon freezes its
    objects before it forks, so those collections neither walk nor copy them, and a keyed-state task
    freezes what its worker imported, once per worker (sparksteward.worker.settle_heap)."""
    def frozen(names):
        """Which of the modules ``names`` this worker has frozen: their globals are outside the walks of
        the collector (gc.get_objects() lists the tracked objects of the three generations, not the frozen)."""
        import gc
        import sys

        tracked = {id(o) for o in gc.get_objects()}
        return ",".join(n for n in names if n in sys.modules and id(sys.modules[n].__dict__) not in tracked)

    daemon_modules = ("pyspark.daemon", "sparksteward.worker", "sparksteward.blob.payload")
    state_modules = ("sparksteward.keyed_tasks", "sparksteward.state.backend", "rocksdict")

    def plain_fn(it):
        for _ in it:
            pass
        yield pd.DataFrame({"frozen": [frozen(daemon_modules)]})

    plain = spark.range(2).repartition(2).mapInPandas(plain_fn, "frozen string").collect()
    assert all(r.frozen == ",".join(daemon_modules) for r in plain), plain   # frozen by the daemon before the fork

    def fn(key, rows, state):
        return pd.DataFrame({"k": [key], "frozen": [frozen(state_modules)]})

    ks = st.keyed_state("frozen-heap", key="k", parallelism=2, checkpoint_dir=str(dirs / "frozen"))
    df = spark.createDataFrame(pd.DataFrame({"k": ["a", "b", "c", "d"]}))
    rows = ks.apply(df, fn, "k string, frozen string", checkpoint_id=0).collect()
    ks.commit(0)
    # settled after its first state task imported the state modules, whatever the worker ran before
    assert all(r.frozen == ",".join(state_modules) for r in rows), rows


def test_info_and_read_work_before_the_first_batch(spark, st, tmp_path):
    """Issue 40: info() raised before the first batch while read() worked."""
    chk = str(tmp_path / "chk")
    ks = st.keyed_state("never-applied", key="k", parallelism=2, checkpoint_dir=chk)
    assert ks.read().collect() == []
    info = ks.info()
    assert info["applied"] is False and info["last_completed"] is None and info["parallelism"] == 2
    assert "'never-applied' has not been applied in this application yet; it has no checkpoint in" in info["note"]
    ks.apply(spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1]})), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    assert ks.info()["applied"] is True and ks.info()["last_completed"] == 0
    again = st.keyed_state("never-applied", key="k", parallelism=2, checkpoint_dir=chk)
    assert again.info()["applied"] is True   # open in this application: the driver's view
