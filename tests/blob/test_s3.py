"""The BLOB service with its HA store on S3 (moto's server on 127.0.0.1), in a real local[2] session."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from sparksteward import Steward

from tests.helpers import spark_session, wait_until


# its own session: the blob HA store is this module's S3 bucket, checked empty after spark.stop()
@pytest.fixture(scope="module")
def spark(s3, tmp_path_factory):
    conf = {"spark.steward.state-dir": str(tmp_path_factory.mktemp("s3-state")),
            "spark.steward.storage.options": s3.storage_options(),
            "spark.steward.blob.ha.storage-path": s3.url("ha"), "spark.steward.cluster-id": "s3-cluster"}
    with spark_session("local[2]", **conf) as session:
        yield session
    fs = s3.filesystem()
    left = fs.find(s3.url("ha")) if fs.exists(s3.url("ha")) else []
    assert not left, f"blob objects remain in S3 after spark.stop(): {left}"


def test_permanent_blobs_go_to_s3_and_leave_with_their_job(spark, s3, tmp_path):
    st = Steward.get(spark)
    fs = s3.filesystem()
    whl = tmp_path / "s3lib-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("s3lib/__init__.py", "X = 5\n")
    with st.job("s3-job") as job:
        key = st.add_library(whl)
        h = st.broadcast(np.arange(1000))
        ha_obj = s3.url("ha", "s3-cluster", "blob", "s3-job", key)
        assert fs.exists(ha_obj), "a permanent blob is acknowledged only once it is in the HA store"

        def use(_):
            import s3lib

            return int(h.value.sum()) + s3lib.X

        assert spark.sparkContext.parallelize([0, 1], 2).map(use).collect() == [499505, 499505]
    assert job.entry.clean
    wait_until(lambda: not fs.exists(s3.url("ha", "s3-cluster", "blob", "s3-job")), timeout=2,
               what="the job's HA directory on S3 to go")


def test_a_corrupt_s3_copy_is_never_served(spark, s3):
    st = Steward.get(spark)
    key = st.blobs.put_bytes(b"precious", "s3-app-blobs", permanent=True)
    obj = s3.url("ha", "s3-cluster", "blob", "s3-app-blobs", str(key))
    s3.filesystem().pipe_file(obj, b"tampered")
    assert st.blobs.get_bytes(key, "s3-app-blobs") == b"precious", "the server's verified local copy"
    st.blobs.delete_job("s3-app-blobs")
    assert not s3.filesystem().exists(obj)
