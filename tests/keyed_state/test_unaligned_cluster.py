"""Channel state goes through file merging (issue 10, must-show 4): 32 subtasks on
local-cluster[2,1,1024] defer input at once, and each checkpoint still writes at most
executors + 2 objects to moto's S3 server. Run under the Spark lock."""

from __future__ import annotations

import pytest
from sparksteward import Steward
from sparksteward.storage import PROBE_PREFIX

from tests.helpers import spark_session
from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


# its own session: small Arrow batches (maxRecordsPerBatch=10) make subtasks defer input
@pytest.fixture(scope="module")
def spark(s3, tmp_path_factory):
    with spark_session("local-cluster[2,1,1024]", **{
            "spark.steward.state-dir": str(tmp_path_factory.mktemp("unaligned-cluster")),
            "spark.steward.storage.options": s3.storage_options(),
            "spark.sql.execution.arrow.maxRecordsPerBatch": "10"}) as session:
        yield session


def test_32_subtasks_deferring_at_once_write_at_most_executors_plus_2_objects(spark, s3):
    st = Steward.get(spark)
    ks = st.keyed_state("wide", key="k", parallelism=32, max_parallelism=64, checkpoint_dir=s3.url("wide"),
                        alignment="unaligned", aligned_checkpoint_timeout=0)
    batches = make_batches(41, count=3, rows=2000, keys=400)
    for i, b in enumerate(batches):
        mark = s3.mark()
        ks.apply(spark.createDataFrame(b), count_sum, SCHEMA, checkpoint_id=i).collect()
        ks.commit(i, wait=120)
        c = next(c for c in ks.info()["checkpoints"] if c["checkpoint_id"] == i)
        objects = {q.key for q in s3.requests_since(mark) if q.op in ("PutObject", "CompleteMultipartUpload")
                   and not q.key.endswith(("/_lease", "/_begun")) and PROBE_PREFIX not in q.key}
        # (the lease and the begun record are the state's records, rewritten in place, and the store's
        # conditional-write probe runs once: not checkpoint objects)
        print(f"\ncheckpoint {i}: {len(c['unaligned_subtasks'])} of 32 subtasks deferred {c['rows_deferred']} rows "
              f"({c['channel_bytes']} B of channel state); {len(objects)} objects written")
        assert len(c["unaligned_subtasks"]) == 32
        assert len(objects) <= 2 + 2, sorted(objects)
    ks = st.keyed_state("wide", key="k", parallelism=32, max_parallelism=64, checkpoint_dir=s3.url("wide"),
                        alignment="aligned")
    ks.apply(spark.createDataFrame(batches[0].iloc[:0], "k string, v long"), count_sum, SCHEMA,
             checkpoint_id=3).collect()
    ks.commit(3, wait=120)
    assert state_of(ks) == reference(batches)
