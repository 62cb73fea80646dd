"""Jars and files through steward:// URLs on local-cluster[2,1,1024] (issue 11, must-shows 1-3).

A Java UDF jar is compiled in the test (javac of the JDK, else pyspark's scalac is not needed: the
source is Java), added with ``st.add_jar`` and called from SQL on both executors; each executor agent
fetched it once through its BlobCache, verified. A corrupt HA copy falls back to the BlobServer; both
copies corrupt fail the task with the key and every source tried; a scoped job's end deletes its jar
blob from the driver's store and HA within 2 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sparksteward import Steward

from tests.helpers import agent_processes, spark_session, wait_until
from tests.helpers.jars import JAVAC, build_udf_jar, cache_stats_by_executor

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


# its own session: the HA store is a dir of its own, checked empty after spark.stop(), and fetches retry once
@pytest.fixture(scope="module")
def env():
    if not JAVAC:
        pytest.skip("no javac: the UDF jar is compiled in the test")
    tmp = Path(tempfile.mkdtemp(prefix="steward-jars-"))
    ha = tmp / "ha"
    conf = {"spark.executor.memory": "1g", "spark.steward.blob.ha.storage-path": str(ha),
            "spark.steward.blob.fetch.retries": "1"}
    with spark_session("local-cluster[2,1,1024]", **conf) as session:
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
        wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")
        yield session, tmp, ha
    wait_until(lambda: not agent_processes(), timeout=20, what="agents to exit after spark.stop()")
    assert not [p for p in ha.rglob("*") if p.is_file()], "spark.stop() left HA blobs behind"
    shutil.rmtree(tmp)


def _fetches(stats: dict[str, int]) -> int:
    return stats.get("ha_fetches", 0) + stats.get("transfers", 0)


def test_udf_jar_is_fetched_once_per_executor_through_the_blob_cache(env):
    from pyspark.sql.types import StringType

    spark, tmp, ha = env
    st = Steward.get(spark)
    jar = build_udf_jar(tmp / "udf")
    before = cache_stats_by_executor(spark)
    url = st.add_jar(jar)
    assert url.startswith("steward://app-") and url.endswith("/steward-udf-0.jar")
    assert url in spark.sparkContext._jsc.sc().listJars().mkString(",")
    spark.udf.registerJavaFunction("steward_udf", "stewardtest.ExecUdf", StringType())
    for _ in range(2):  # the second query fetches nothing
        rows = spark.range(0, 32, 1, 8).selectExpr("steward_udf(id) AS r").collect()
        assert {r.r.split(":")[0] for r in rows} == {"0", "1"}, rows
        assert sorted(int(r.r.split(":")[1]) for r in rows) == [2 * i for i in range(32)]
    after = cache_stats_by_executor(spark)
    for executor in ("0", "1"):
        got = after[executor]
        assert _fetches(got) - _fetches(before.get(executor, {})) == 1, (executor, got)
        assert got.get("ha_fetches", 0) - before.get(executor, {}).get("ha_fetches", 0) == 1, got  # verified HA copy
        assert got["file_opens"] >= 1


def test_corrupt_ha_copy_is_served_by_the_server_and_the_scoped_job_end_deletes_the_jar(env):
    spark, tmp, ha = env
    st = Steward.get(spark)
    jar = build_udf_jar(tmp / "udf2", padding=os.urandom(4096))
    before = cache_stats_by_executor(spark)
    with st.job("jars-scoped"):
        url = st.add_jar(jar)
        key = url.split("/")[-2]
        ha_copies = list(ha.rglob(key))
        assert len(ha_copies) == 1
        ha_copies[0].write_bytes(b"corrupt" + ha_copies[0].read_bytes()[7:])
        after = cache_stats_by_executor(spark)  # these tasks fetch the new jar first (Executor.updateDependencies)
        server_store = Path(st.blobs.incoming).parent
        assert list(server_store.rglob(key))
    for executor in ("0", "1"):
        b, a = before.get(executor, {}), after[executor]
        assert _fetches(a) - _fetches(b) == 1, (executor, a)
        assert a.get("ha_fetches", 0) == b.get("ha_fetches", 0), "a corrupt HA copy was accepted"
    wait_until(lambda: not list(ha.rglob(key)) and not list(server_store.rglob(key)), timeout=2,
               what=f"the scoped job's jar {key} to leave HA and the driver's store")


def test_add_file_and_a_url_put_ahead_of_time_and_a_foreign_scope(env):
    from sparksteward.blob.url import BlobUrl, app_scope
    from sparksteward.wire import new_secret

    spark, tmp, ha = env
    st = Steward.get(spark)
    f = tmp / "lookup.txt"
    f.write_text("steward-file-content\n")
    url = st.add_file(f)

    def read(_):
        from pyspark import SparkFiles

        with open(SparkFiles.get("lookup.txt")) as fh:
            yield fh.read()

    assert set(spark.sparkContext.parallelize(range(4), 4).mapPartitions(read).collect()) == {f.read_text()}
    # put ahead of time by the CLI into the HA store this application uses (tied to its job, so that
    # the application's end deletes it): cluster-scoped, readable by any application of the cluster
    rows = tmp / "ahead.txt"
    rows.write_text("".join(f"r{i}\n" for i in range(100)))
    out = subprocess.run([sys.executable, "-m", "sparksteward", "blobs", "put", str(rows), "--ha", str(ha),
                          "--job", st.current_job()], check=True, capture_output=True, text=True).stdout.strip()
    assert out.startswith("steward://cluster-") and spark.read.text(out).count() == 100
    parsed = BlobUrl.parse(url)
    foreign = str(BlobUrl(app_scope(new_secret()), parsed.job_id, parsed.key, parsed.name))
    with pytest.raises(Exception, match="belongs to another application"):
        spark.read.text(foreign).count()


def test_both_copies_corrupt_fail_the_task_naming_the_key_and_every_source(env):
    spark, tmp, ha = env
    st = Steward.get(spark)
    data = tmp / "rows.txt"
    data.write_text("".join(f"line {i}\n" for i in range(1000)))
    url = st._put_file_url(data, "file")  # read by a data source: a failure poisons no later task
    key = url.split("/")[-2]
    (ha_copy,) = ha.rglob(key)
    (local_copy,) = Path(st.blobs.incoming).parent.rglob(key)
    for copy in (ha_copy, local_copy):
        copy.write_bytes(b"CORRUPT" + copy.read_bytes()[7:])
    with pytest.raises(Exception) as err:
        spark.read.text(url).count()
    msg = str(err.value)
    assert key in msg and "HA store" in msg and "BlobServer" in msg, msg[:3000]
