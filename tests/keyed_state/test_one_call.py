"""The per-key (pandas) form calls its function once per key per batch, with all of the key's rows,
however many Arrow buffers (``spark.sql.execution.arrow.maxRecordsPerBatch``) they arrive in, and with
the input spilled to disk (``spark.steward.state.spill-threshold``). The Arrow form calls its function
once per subtask per batch with all of its rows, up to the spill threshold of input a call. Shared
local[2]; run under the Spark lock."""

from __future__ import annotations

import pandas as pd
import pytest
from sparksteward import Steward

pytestmark = pytest.mark.slow

SMALL = {"spark.sql.execution.arrow.maxRecordsPerBatch": "7", "spark.steward.state.spill-threshold": "1k"}


def _with_conf(spark, settings):
    """Set ``settings`` for one test; the session's values come back after."""
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    yield
    for k, v in before.items():
        if v is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, v)


@pytest.fixture
def small_buffers(spark):
    """7-row Arrow buffers and a 1 KiB spill threshold."""
    yield from _with_conf(spark, SMALL)


@pytest.fixture
def seven_row_buffers(spark):
    """7-row Arrow buffers, the spill threshold left at its default (the Arrow form's call bound)."""
    yield from _with_conf(spark, {"spark.sql.execution.arrow.maxRecordsPerBatch": "7"})


def count(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    return pd.DataFrame({"k": [key], "rows": [len(rows)], "n": [n]})


def test_one_call_per_key_per_batch_over_many_small_buffers(spark, small_buffers, tmp_path):
    ks = Steward.get(spark).keyed_state("one-call", key="k", parallelism=2, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    pdf = pd.DataFrame({"k": ["hot"] * 100 + [f"c{i}" for i in range(30)], "v": range(130)})
    for batch in range(2):
        out = ks.apply(spark.createDataFrame(pdf.sample(frac=1, random_state=batch)), count,
                       "k string, rows long, n long", checkpoint_id=batch).collect()
        ks.commit(batch, wait=60)
        assert sorted((r.k, r.rows, r.n) for r in out) == \
            sorted([("hot", 100, 100 * (batch + 1))] + [(f"c{i}", 1, batch + 1) for i in range(30)])


def test_the_arrow_form_gets_a_subtasks_rows_in_one_call_however_many_buffers(spark, seven_row_buffers, tmp_path):
    import pyarrow as pa

    def vectorized(keys, rows, state):
        got = rows.group_by("k").aggregate([("k", "count")])
        old = state.get_many(got["k"])
        new = [(o or 0) + c for o, c in zip(old, got["k_count"].to_pylist())]
        state.put_many(got["k"], new)
        return pa.table({"k": got["k"], "rows": got["k_count"], "n": pa.array(new, pa.int64())})

    ks = Steward.get(spark).keyed_state("one-call-arrow", key="k", parallelism=2, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    pdf = pd.DataFrame({"k": ["hot"] * 100 + [f"c{i}" for i in range(30)], "v": range(130)})
    for batch in range(2):   # about 10 buffers a subtask
        out = ks.apply_arrow(spark.createDataFrame(pdf.sample(frac=1, random_state=batch)), vectorized,
                             "k string, rows long, n long", checkpoint_id=batch).collect()
        ks.commit(batch, wait=60)
        # one output row per key: the key's rows all reached one call, which read and wrote its state once
        assert sorted((r.k, r.rows, r.n) for r in out) == \
            sorted([("hot", 100, 100 * (batch + 1))] + [(f"c{i}", 1, batch + 1) for i in range(30)])

