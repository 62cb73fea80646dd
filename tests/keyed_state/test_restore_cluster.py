"""restore_from on local-cluster[2,1,1024] with moto S3 (issue 8, must-show 3): executor agents in
their own JVMs; a NO_CLAIM restore moves no object bytes through any process (moto's request log), and
the next checkpoint, whose subtasks run on both executors, uploads only the files the restored
checkpoint lacks. Run under the Spark lock."""

from __future__ import annotations

import pytest
from sparksteward import Steward

from tests.helpers import agent_processes, spark_session, wait_until
from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of
from tests.helpers.restore import CLUSTER, checksums, listing, metadata, object_bytes, puts_under, root

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


# its own session: the cluster id "rs" names the S3 paths the tests read
@pytest.fixture(scope="module")
def spark(s3, tmp_path_factory):
    conf = {"spark.executor.memory": "1g", "spark.steward.state-dir": str(tmp_path_factory.mktemp("restore-cl")),
            "spark.steward.storage.options": s3.storage_options(), "spark.steward.cluster-id": CLUSTER}
    with spark_session("local-cluster[2,1,1024]", **conf) as session:
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
        wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")
        yield session
    wait_until(lambda: not agent_processes(), timeout=20, what="agents to exit after spark.stop()")


def test_no_claim_restore_on_a_cluster(spark, s3):
    st = Steward.get(spark)
    batches = make_batches(23, count=4, rows=400, keys=60)
    src = st.keyed_state("src", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=s3.url("chk"), file_merging=False,
                         num_retained=2)
    for i in range(3):
        src.apply(spark.createDataFrame(batches[i]), count_sum, SCHEMA, checkpoint_id=i).collect()
        src.commit(i, wait=120)
    src_url = root(s3, "chk", "src") + "/chk-1"
    restored = checksums(metadata(s3, src_url))
    # the source's checkpoints; not its _lease, which its live writer renews (a byte longer at times)
    checkpoints = lambda: {p: n for p, n in listing(s3, root(s3, "chk", "src")).items()  # noqa: E731
                           if not p.endswith("/_lease")}
    src_before = checkpoints()

    mark = s3.mark()
    ks = st.keyed_state("copy", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=s3.url("other"), file_merging=False,
                        restore_from=src_url)
    during = s3.requests_since(mark)
    copies = {r.key.split("/")[-1] for r in during if r.op == "CopyObject"}
    print(f"\nlocal-cluster NO_CLAIM restore of {len(restored)} files: {len(copies)} CopyObject, "
          f"{object_bytes(during)} object bytes")
    assert object_bytes(during) == 0 and copies == restored

    mark = s3.mark()
    ks.apply(spark.createDataFrame(batches[3]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=120)
    during = s3.requests_since(mark)
    dst = root(s3, "other", "copy")
    uploaded = puts_under(during, dst.split("/", 3)[3] + "/shared/")
    new = checksums(metadata(s3, dst + "/chk-0")) - restored
    print(f"next checkpoint uploaded {len(uploaded)} files ({sum(uploaded.values())} B); "
          f"{len(checksums(metadata(s3, dst + '/chk-0')) & restored)} restored files reused")
    assert set(uploaded) == new and not set(uploaded) & restored
    assert state_of(ks) == reference([*batches[:2], batches[3]])
    assert checkpoints() == src_before
