"""A 64 MB jar to every executor: Spark's file server against steward:// with the HA store on moto S3.

Issue 11, must-show 4. On ``local-cluster[2,1,1024]``, one application per way (so each executor loads
the UDF class from that way's jar):

- ``spark``: the jar is added with ``ADD JAR <local path>`` (``sc.addJar``; the same transport as
  ``--jars``: every executor downloads it from the driver's file server);
- ``steward``: ``st.add_jar`` (upload to the HA store, then every executor's BlobCache fetches it from
  HA, verified).

It prints the time from adding the jar until a SQL query has called the UDF (loaded its class) on every
executor, and the bytes the driver served: for ``steward`` the BlobServer's counters; for ``spark``
the file server has no counter, so it is the jar size times the executors that fetched it (the file
server is their only source). Run: ``flock /tmp/steward-spark.lock python benchmarks/bench_jars.py [MB] [order]`` (order: ``spark,steward``
by default; swap it to check that the first application's warm-up does not decide the ratio).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import spark_session, wait_until  # noqa: E402
from tests.test_jars_cluster import build_udf_jar  # noqa: E402

from sparksteward import Steward  # noqa: E402
from sparksteward.testing.s3 import local_s3  # noqa: E402


def _padded_jar(out: Path, mb: int) -> Path:
    jar = build_udf_jar(out)
    big = out / f"steward-udf-{mb}mb.jar"
    with zipfile.ZipFile(jar) as src, zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item))
        with dst.open("padding.bin", "w") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))
    return big


def _run(way: str, jar: Path, ha: str) -> tuple[float, int, set[str]]:
    from pyspark.sql.types import StringType

    conf = {"spark.executor.memory": "1g", "spark.steward.blob.ha.storage-path": ha}
    with spark_session("local-cluster[2,1,1024]", **conf) as spark:
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
        wait_until(lambda: status().size() >= 3, timeout=90, what="both executors")
        st = Steward.get(spark)
        start = time.perf_counter()
        if way == "spark":
            spark.sql(f"ADD JAR {jar}")
        else:
            st.add_jar(jar)
        spark.udf.registerJavaFunction("bench_udf", "stewardtest.ExecUdf", StringType())
        rows = spark.range(0, 16, 1, 8).selectExpr("bench_udf(id) AS r").collect()
        elapsed = time.perf_counter() - start
        executors = {r.r.split(":")[0] for r in rows}
        stats = st.blobs.stats()
        served = stats.get("bytes_served", 0) + stats.get("served_local", 0) * jar.stat().st_size
        if way == "spark":
            served = len(executors) * jar.stat().st_size
        return elapsed, served, executors


def main() -> int:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    with tempfile.TemporaryDirectory(prefix="bench-jars-") as tmp, local_s3() as s3:
        jar = _padded_jar(Path(tmp), mb)
        size = jar.stat().st_size
        order = sys.argv[2].split(",") if len(sys.argv) > 2 else ["spark", "steward"]  # e.g. steward,spark
        results = {way: _run(way, jar, s3.url("ha")) for way in order}
    print(f"{size / 2**20:.0f} MB jar to every executor of local-cluster[2,1,1024] "
          f"(HA store: moto S3 on loopback)")
    print(f"{'way':<10}{'time to class loaded on every executor':>42}{'driver served':>16}{'executors':>11}")
    for way, (elapsed, served, executors) in results.items():
        print(f"{way:<10}{elapsed:>40.2f} s{served / 2**20:>13.1f} MB{len(executors):>11}")
    ratio = results["steward"][0] / results["spark"][0]
    print(f"steward / spark time: {ratio:.2f}x (goal <= 1.2x); steward driver bytes: {results['steward'][1]} "
          f"(goal 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
