"""Unaligned checkpoints through the Spark API (issue 10, first slice): a subtask past its aligned
checkpoint timeout defers the rest of its input into the checkpoint as channel state (merged like
every small file), the next batch replays it first, a rescale re-routes it by key group, and bad
inputs are named. Real local[2] Spark with small Arrow batches, so a partition has many buffers."""

from __future__ import annotations

import pandas as pd
import pytest

from sparksteward import Steward
from sparksteward.errors import ConfigError, StewardError
from tests.conftest import spark_session
from tests.test_state_spark import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("unaligned")


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


def test_rescale_with_pending_channel_state_reroutes_by_key_group(spark, st, dirs):
    batches = make_batches(32, count=2, rows=400, keys=60)
    ks = st.keyed_state("resc", key="k", parallelism=4, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    before = _run(spark, ks, batches)[-1]["channel_bytes"]
    assert before > 0
    ks = st.keyed_state("resc", key="k", parallelism=3, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    after = _run(spark, ks, [batches[0].iloc[:0]], first_id=2)[-1]
    assert after["channel_bytes"] <= before  # re-persisted filtered: no growth across the rescale
    ks = st.keyed_state("resc", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="aligned")
    _run(spark, ks, [batches[0].iloc[:0]], first_id=3)
    assert state_of(ks) == reference(batches)


def test_bad_alignment_inputs_are_named(spark, st, dirs):
    with pytest.raises(ConfigError, match=r"aligned_checkpoint_timeout=-1 must be a number of seconds >= 0"):
        st.keyed_state("bad", key="k", parallelism=2, checkpoint_dir=str(dirs / "chk"), alignment="unaligned",
                       aligned_checkpoint_timeout=-1)
    with pytest.raises(ConfigError, match=r"alignment='sideways' is not valid"):
        st.keyed_state("bad", key="k", parallelism=2, checkpoint_dir=str(dirs / "chk"), alignment="sideways")
    ks = st.keyed_state("tiny", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(dirs / "chk"),
                        alignment="unaligned_max_inflight", aligned_checkpoint_timeout=0, max_inflight_bytes=10)
    df = spark.createDataFrame(make_batches(33, count=1)[0])
    with pytest.raises(Exception, match=r"larger than max_inflight_bytes=10: a cap below one buffer"):
        ks.apply(df, count_sum, SCHEMA, checkpoint_id=0).collect()
    with pytest.raises(StewardError):
        ks.commit(0, wait=1)
    assert ks.info()["pending"] == [] and ks.info()["last_completed"] is None
