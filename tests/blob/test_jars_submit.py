"""``spark-submit --jars steward://...`` in client mode, the real command, on local-cluster[2,1,1024].

In client mode SparkSubmit downloads ``--jars`` through the Hadoop FileSystem of their scheme, to put
them on the driver's class path, before the SparkContext (and so the driver agent) exists; ``spark.jars``
keeps the steward:// URL for the executors. The shim's file system then reads the blob with a one-shot
``python -m sparksteward blobs get`` from the HA store named by ``fs.steward.ha.storage-path``. The
application calls the UDF of the jar on both executors; each executor fetched it once from HA and the
driver's BlobServer served 0 bytes. Without the HA setting, spark-submit fails with the URL and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sparksteward.blob.cli import put
from sparksteward.jar import shim_jar

from tests.helpers.jars import JAVAC, build_udf_jar

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

_APP = '''
import json, time
from pyspark.sql import SparkSession
from pyspark.sql.types import StringType
from sparksteward import Steward

spark = SparkSession.builder.getOrCreate()
status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
deadline = time.monotonic() + 90
while status().size() < 3 and time.monotonic() < deadline:
    time.sleep(0.2)
# the jar is on the driver's class path (spark-submit put it there): the class loads here
spark.udf.registerJavaFunction("u", "stewardtest.ExecUdf", StringType())
seen = set()
for _ in range(10):
    seen |= {r.r.split(":")[0] for r in spark.range(0, 16, 1, 8).selectExpr("u(id) AS r").collect()}
    if len(seen) >= 2:
        break

def probe(_):
    from sparksteward.worker import executor_connection
    conn = executor_connection()
    return [(conn.request("health")["executor_id"], conn.request("blob.cache_stats")["stats"])]

caches = {}
for _ in range(10):
    caches.update(spark.sparkContext.parallelize(range(8), 8).mapPartitions(probe).collect())
    if len(caches) >= 2:
        break
print("RESULT " + json.dumps({"executors": sorted(seen), "caches": caches,
                              "served": dict(Steward.get(spark).blobs.stats())}), flush=True)
spark.stop()
'''


def _submit(tmp: Path, url: str, *extra_conf: str) -> subprocess.CompletedProcess[str]:
    jar = str(shim_jar())
    spark_submit = Path(sys.executable).parent / "spark-submit"
    (tmp / "app.py").write_text(_APP)
    cmd = [str(spark_submit if spark_submit.exists() else shutil.which("spark-submit")),
           "--master", "local-cluster[2,1,1024]",
           "--conf", "spark.plugins=sparksteward.shim.StewardPlugin",
           "--conf", f"spark.steward.blob.ha.storage-path={tmp / 'ha'}",
           "--conf", "spark.hadoop.fs.steward.impl=sparksteward.shim.StewardFileSystem",
           *extra_conf,
           "--conf", f"spark.executor.extraClassPath={jar}", "--driver-class-path", jar,
           "--conf", "spark.ui.enabled=false", "--driver-java-options", f"-Djava.io.tmpdir={tmp / 'jvmtmp'}",
           "--jars", url, str(tmp / "app.py")]
    (tmp / "jvmtmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def udf(tmp_path):
    if not JAVAC:
        pytest.skip("no javac: the UDF jar is compiled in the test")
    jar = build_udf_jar(tmp_path / "udf", b"spark-submit")
    return jar, put(jar, str(tmp_path / "ha"))


@pytest.mark.compat
def test_spark_submit_jars_with_a_put_url_runs_the_udf_on_every_executor(tmp_path, udf):
    _, url = udf
    proc = _submit(tmp_path, url, "--conf", f"spark.hadoop.fs.steward.ha.storage-path={tmp_path / 'ha'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert len(result["executors"]) == 2, result
    # each executor fetched the jar once, verified, from HA; the driver's BlobServer served nothing
    assert {e: s.get("ha_fetches", 0) for e, s in result["caches"].items()} == {"0": 1, "1": 1}, result
    assert all(s.get("transfers", 0) == 0 for s in result["caches"].values()), result
    served = result["served"]
    assert served.get("bytes_served", 0) == 0 and served.get("served_local", 0) == 0, served
    assert not list((tmp_path / "jvmtmp").glob("spark-steward-fetch-*")), "the staged copy outlived spark-submit"


_PLAIN = '''
import sys
from pyspark.sql import SparkSession
from pyspark.sql.types import StringType
import sparksteward

ha, url, shim = sys.argv[1:]
builder = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
           .config("spark.steward.blob.ha.storage-path", ha).config("spark.jars", url)
           .config("spark.driver.extraClassPath", shim).config("spark.executor.extraClassPath", shim))
spark = sparksteward.configure(builder).getOrCreate()
spark.udf.registerJavaFunction("u", "stewardtest.ExecUdf", StringType())
seen = set()
for _ in range(10):
    seen |= {r.r.split(":")[0] for r in spark.range(0, 16, 1, 8).selectExpr("u(id) AS r").collect()}
    if len(seen) >= 2:
        break
print("EXECUTORS", sorted(seen), flush=True)
spark.stop()
'''


def test_a_plain_python_app_with_a_put_url_in_spark_jars_of_its_first_session(tmp_path, udf):
    """PySpark launches the JVM through spark-submit with the first builder's conf, so spark.jars is
    downloaded there too, before any agent: configure() hands the HA path to the file system."""
    _, url = udf
    (tmp_path / "plain.py").write_text(_PLAIN)
    proc = subprocess.run([sys.executable, str(tmp_path / "plain.py"), str(tmp_path / "ha"), url, str(shim_jar())],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "EXECUTORS ['0', '1']" in proc.stdout, proc.stdout


def test_spark_submit_without_the_ha_setting_fails_with_the_url_and_the_fix(tmp_path, udf):
    _, url = udf
    proc = _submit(tmp_path, url)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RESULT" not in proc.stdout
    assert url in out and "spark.hadoop.fs.steward.ha.storage-path" in out, out[-6000:]
