"""steward:// URLs in ``spark.jars`` at start (what ``spark-submit --jars`` sets), on local-cluster[2,1,1024].

The URL comes from ``steward blobs put`` ahead of time. Spark adds the jars named at start before it
starts plugins, and each executor fetches them before its plugin runs: the executor starts its agent
early for that, and the driver plugin checks the URLs once its agent is ready. A URL naming no blob
fails the start with the URL and the fix.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from sparksteward.blob.cli import put
from sparksteward.jar import shim_jar

from tests.helpers import spark_session, wait_until
from tests.helpers.jars import JAVAC, build_udf_jar, cache_stats_by_executor

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.mark.compat
def test_a_put_jar_in_spark_jars_reaches_every_executor_through_ha():
    from pyspark.sql.types import StringType

    if not JAVAC:
        pytest.skip("no javac: the UDF jar is compiled in the test")
    with tempfile.TemporaryDirectory(prefix="steward-jars-start-") as tmp:
        ha = str(Path(tmp) / "ha")
        jar = build_udf_jar(Path(tmp) / "udf", b"at start")
        url = put(jar, ha)
        # executors fetch spark.jars at start through a Hadoop Configuration that does not see the jars
        # fetched just before: the shim's FileSystem must be on their class path
        conf = {"spark.executor.memory": "1g", "spark.steward.blob.ha.storage-path": ha, "spark.jars": url,
                "spark.executor.extraClassPath": str(shim_jar())}
        with spark_session("local-cluster[2,1,1024]", **conf) as spark:
            status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
            wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")
            # the driver's SQL class loader (client-mode spark-submit --jars puts the jar on the driver's
            # class path; this JVM was launched before this conf): registerJavaFunction loads the class there
            jvm = spark.sparkContext._jvm
            spark._jsparkSession.sharedState().jarClassLoader().addURL(jvm.java.io.File(str(jar)).toURI().toURL())
            spark.udf.registerJavaFunction("start_udf", "stewardtest.ExecUdf", StringType())
            seen: set[str] = set()
            for _ in range(5):
                seen |= {r.r.split(":")[0] for r in spark.range(0, 16, 1, 8).selectExpr("start_udf(id) AS r").collect()}
                if len(seen) >= 2:
                    break
            assert len(seen) == 2, seen
            stats = cache_stats_by_executor(spark)
            # each executor fetched the jar once, from HA, before its plugin ran; the driver served nothing
            assert {e: s.get("ha_fetches", 0) for e, s in stats.items()} == {e: 1 for e in stats}, stats
            assert all(s.get("transfers", 0) == 0 for s in stats.values()), stats
            from sparksteward import Steward

            served = Steward.get(spark).blobs.stats()
            assert served.get("bytes_served", 0) == 0 and served.get("served_local", 0) == 0, served


def test_a_url_naming_no_blob_fails_the_start_with_the_url_and_the_fix():
    with tempfile.TemporaryDirectory(prefix="steward-jars-start-") as tmp:
        ha = str(Path(tmp) / "ha")
        url = "steward://cluster-64656661756c74/~/p-" + "0" * 32 + "/missing.jar"
        conf = {"spark.steward.blob.ha.storage-path": ha, "spark.jars": url}
        with pytest.raises(Exception) as err, spark_session("local-cluster[2,1,1024]", **conf):
            pass
        assert url in str(err.value) and "steward blobs put" in str(err.value), str(err.value)[:2000]
