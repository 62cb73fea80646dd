"""A Java UDF jar compiled in the test (javac of the JDK), and the executors' BlobCache counters: what
the suites of jars through steward:// URLs share."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

from sparksteward.jar import pyspark_jars_dir

JAVAC = next((str(p) for p in (Path(os.environ.get("JAVA_HOME", "/nonexistent")) / "bin" / "javac",
                               Path("/usr/lib/jvm/java-17-openjdk-amd64/bin/javac")) if p.exists()),
             shutil.which("javac"))
_UDF = """package stewardtest;
import org.apache.spark.sql.api.java.UDF1;
public class ExecUdf implements UDF1<Long, String> {
  public String call(Long x) { return org.apache.spark.SparkEnv.get().executorId() + ":" + (x * 2); }
}
"""


def build_udf_jar(out: Path, padding: bytes = b"") -> Path:
    """Compile the UDF with javac against pyspark's jars; ``padding`` (a resource) changes the jar's key."""
    src = out / "src" / "stewardtest"
    src.mkdir(parents=True, exist_ok=True)
    (src / "ExecUdf.java").write_text(_UDF)
    classes = out / "classes"
    classes.mkdir(exist_ok=True)
    cp = os.pathsep.join(str(p) for p in sorted(pyspark_jars_dir().glob("*.jar")))
    subprocess.run([JAVAC, "-nowarn", "-cp", cp, "-d", str(classes), str(src / "ExecUdf.java")], check=True)
    jar = out / f"steward-udf-{len(padding)}.jar"
    with zipfile.ZipFile(jar, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n\n")
        z.write(classes / "stewardtest" / "ExecUdf.class", "stewardtest/ExecUdf.class")
        if padding:
            z.writestr("padding.bin", padding)
    return jar


def cache_stats_by_executor(spark) -> dict[str, dict[str, int]]:
    """Each executor agent's BlobCache counters, by executor id (8 tasks reach both executors)."""
    def probe(_):
        from sparksteward.worker import executor_connection

        conn = executor_connection()
        return [(conn.request("health")["executor_id"], conn.request("blob.cache_stats")["stats"])]

    out: dict[str, dict[str, int]] = {}
    for _ in range(5):
        out.update(spark.sparkContext.parallelize(range(8), 8).mapPartitions(probe).collect())
        if len(out) >= 2:
            return out
    raise AssertionError(f"tasks reached only executors {sorted(out)}")
