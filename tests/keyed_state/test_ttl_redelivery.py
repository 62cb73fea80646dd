"""The processing time of a checkpoint is chosen once (issue 35 item 3), through Spark on local[2]: a
batch whose sink failed after its rows were written is delivered again after the TTL of what it read
has passed by the wall clock; the second delivery must expire nothing the first saw, or the state
would differ from the rows the sink kept (a sink that skips a batch id it wrote keeps the first)."""

from __future__ import annotations

import time
import uuid

import pandas as pd
import pytest
from sparksteward import Steward, value_state

from tests.helpers import spark_session, wait_until

pytestmark = pytest.mark.slow

TTL = 20.0


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    with spark_session("local[2]", **{"spark.steward.state-dir": str(tmp_path_factory.mktemp("state"))}) as s:
        yield s


def _count(key, rows, state):
    count = state.value("count")
    n = (count.get() or 0) + len(rows)
    count.update(n)
    return pd.DataFrame({"k": [key], "n": [n]})


def test_a_batch_delivered_again_after_the_ttl_expires_what_its_first_delivery_did(spark):
    st = Steward.get(spark)
    ks = st.keyed_state(f"ttl{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16,
                        states=[value_state("count", "bigint", ttl=TTL)])
    batch = spark.createDataFrame([(f"k{i}", 1) for i in range(12)], "k string, v long")
    warm = st.keyed_state(f"warm{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16)
    warm.apply(batch, lambda k, rows, state: None, "k string", checkpoint_id=0).collect()   # workers started
    warm.commit(0, wait=60)
    written = time.time()   # batch 0's processing time is at or after this
    ks.apply(batch, _count, "k string, n long", checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    out = ks.apply(batch, _count, "k string, n long", checkpoint_id=1)
    assert time.time() - written < TTL - 2, "batch 1 began too late to see batch 0's entries: raise TTL"
    sink = {r.k: r.n for r in out.collect()}            # the sink wrote batch 1's rows, then failed
    assert set(sink.values()) == {2}
    ks.abort(1)
    wait_until(lambda: time.time() - written > TTL + 1, timeout=TTL + 5, interval=0.2, what="the TTL to pass")
    again = {r.k: r.n for r in ks.apply(batch, _count, "k string, n long", checkpoint_id=1).collect()}
    assert again == sink, "the second delivery expired entries the first one read"
    ks.commit(1, wait=60)
