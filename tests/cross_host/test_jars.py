"""A Java UDF jar through a steward:// URL on the cross-host standalone worker (issue 11, must-show 1).

The worker runs in its own mount namespace with another boot id (:mod:`sparksteward.testing.standalone`),
so its executor agent cannot copy the BlobServer's file: the jar must be streamed, verified, once.
"""

from __future__ import annotations

import pytest
from sparksteward import Steward

from tests.helpers.cross_host import executor_cache_stats, on_executor
from tests.helpers.jars import JAVAC, build_udf_jar

pytestmark = pytest.mark.slow


def test_udf_jar_is_streamed_once_to_the_other_host_and_called_from_sql(spark, tmp_path):
    from pyspark.sql.types import StringType

    if not JAVAC:
        pytest.skip("no javac: the UDF jar is compiled in the test")
    st = Steward.get(spark)
    before = on_executor(spark, executor_cache_stats)
    url = st.add_jar(build_udf_jar(tmp_path))
    spark.udf.registerJavaFunction("steward_udf_xhost", "stewardtest.ExecUdf", StringType())
    for _ in range(2):
        rows = spark.range(0, 8, 1, 4).selectExpr("steward_udf_xhost(id) AS r").collect()
        assert sorted(int(r.r.split(":")[1]) for r in rows) == [2 * i for i in range(8)]
    after = on_executor(spark, executor_cache_stats)
    assert after.get("transfers", 0) - before.get("transfers", 0) == 1, (before, after)  # streamed, verified
    assert after.get("local_copies", 0) == before.get("local_copies", 0), "the other host cannot see the file"
    assert after.get("file_opens", 0) >= 1 and url.startswith("steward://app-")
