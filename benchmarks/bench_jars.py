"""A 64 MB jar to every executor: Spark's ``--jars`` (the driver's file server) against steward:// with HA on moto S3.

Issue 11, must-show 4. On ``local-cluster[2,1,1024]``, one application per way and run, so every
executor loads the UDF class from that way's jar (the jar is a compiled Java UDF plus a resource of
random padding):

- ``spark``: ``spark.jars=<local path of the jar>`` in the session conf, which is exactly what
  ``spark-submit --jars`` sets: the driver serves the jar from its file server and every executor
  downloads it from there.
- ``steward``: the jar is uploaded ahead of time with :func:`sparksteward.blob.cli.put` (what
  ``steward blobs put <jar> --ha <url>`` runs; not timed, like building the jar) and its steward:// URL
  goes into ``spark.jars``, with ``spark.steward.blob.ha.storage-path`` set to the same store: every
  executor's BlobCache fetches it from HA (moto S3), verified, and Spark reads the verified copy. The
  executor starts its agent before its plugin for this (Spark fetches start-time jars first), and the
  shim must be on the executors' class path (``spark.executor.extraClassPath``, set for both ways).
- ``add_jar`` (runtime, for reference): no jar at start; ``st.add_jar`` uploads it to HA (timed) and
  calls ``sc.addJar``; executors fetch it from HA when their first task of the query starts.

**The interval** is the same for ``spark`` and ``steward``: from the moment the later of the two
executors registered with the driver (``SparkListenerExecutorAdded``'s time, read from the driver's
status store, so polling does not shift it) until a SQL query has called the UDF (loaded its class)
on every executor. With ``spark.jars`` (Spark 3.4+), every executor fetches the jars named at startup
while it constructs its ``Executor``, i.e. after it registered and before it can run a task, so the
fetch lies inside this interval for both ways; so do the first tasks and their class loading, which
cost the same for both. For ``add_jar`` the interval starts at the ``st.add_jar`` call instead (both
executors are up by then), so it includes the upload to HA.

Both ways put the local jar on the driver's SQL class loader, untimed (``registerJavaFunction`` loads the
class there; client-mode ``spark-submit --jars`` puts it on the driver's class path).

**The driver's bytes**: for steward the driver's BlobServer counters (``bytes_served``, plus
``served_local`` files handed to same-host caches), which must be 0 with HA set. Spark's file server
keeps no counter, so for spark it is the jar size times the executors whose log says they fetched
the jar from the driver (``Fetching spark://...``; the file server is their only source).

Rounds alternate the order (spark, steward, then steward, spark, ...) so the first application's
warm-up (JIT, page cache) does not decide the ratio; each run is printed, then the median per way.

Run: ``flock /tmp/steward-spark.lock python benchmarks/bench_jars.py [--mb 64] [--rounds 3] [--no-add-jar]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparksteward import Steward  # noqa: E402
from sparksteward.blob.cli import put  # noqa: E402
from sparksteward.jar import shim_jar  # noqa: E402
from sparksteward.testing.s3 import local_s3  # noqa: E402
from tests.test_jars_cluster import build_udf_jar  # noqa: E402

from tests.conftest import spark_session, wait_until  # noqa: E402


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


def _executors_added_ms(spark) -> list[int]:
    """When each executor registered with the driver (epoch ms), from the driver's status store."""
    summaries = spark.sparkContext._jsc.sc().statusStore().executorList(True)
    times = []
    for i in range(summaries.size()):
        s = summaries.apply(i)
        if s.id() != "driver":
            times.append(int(s.addTime().getTime()))
    return times


def _driver_loads(spark, jar: Path) -> None:
    """Put the local jar on the driver's SQL class loader (``registerJavaFunction`` loads the class there).

    ``spark-submit --jars`` puts the jars on the driver's class path in client mode; this process
    launched its JVM before the session conf existed, so both ways add it here, the same way, untimed.
    Executors are not involved.
    """
    jvm = spark.sparkContext._jvm
    spark._jsparkSession.sharedState().jarClassLoader().addURL(jvm.java.io.File(str(jar)).toURI().toURL())


def _udf_on_every_executor(spark) -> set[str]:
    """Run the UDF until it has run on both executors; return the executor ids it ran on."""
    seen: set[str] = set()
    while len(seen) < 2:
        rows = spark.range(0, 16, 1, 8).selectExpr("bench_udf(id) AS r").collect()
        seen |= {r.r.split(":")[0] for r in rows}
    return seen


def _spark_fetches(spark, jar_name: str) -> int:
    """Executors of this application whose log says they fetched the jar from the driver's file server."""
    app = spark.sparkContext.applicationId
    home = Path(spark.sparkContext._jvm.System.getenv("SPARK_HOME") or "")
    count = 0
    for stderr in (home / "work" / app).glob("*/stderr"):
        text = stderr.read_text(errors="replace")
        if "Fetching spark://" in text and jar_name in text:
            count += 1
    return count


def _run(way: str, jar: Path, ha: str) -> dict:
    from pyspark.sql.types import StringType

    # An executor fetches spark.jars at start through a Hadoop Configuration whose class loader does not
    # see the jars fetched just before (the shim among them), so steward:// there needs the shim on the
    # executors' class path, as any Hadoop FileSystem used for --jars does. Set for every way alike.
    conf = {"spark.executor.memory": "1g", "spark.steward.blob.ha.storage-path": ha,
            "spark.executor.extraClassPath": str(shim_jar())}
    if way == "spark":
        conf["spark.jars"] = str(jar)
    elif way == "steward":
        # again before every run (0 bytes if still there): an add_jar run's spark.stop() deletes its
        # blobs, and dedup by content may make that the same HA object
        conf["spark.jars"] = put(jar, ha)
    with spark_session("local-cluster[2,1,1024]", **conf) as spark:
        wait_until(lambda: len(_executors_added_ms(spark)) >= 2, timeout=120, interval=0.01,
                   what="both executors to register")
        st = Steward.get(spark)
        if way != "add_jar":  # st.add_jar does this itself
            _driver_loads(spark, jar)
        if way == "add_jar":
            start = time.time()
            st.add_jar(jar)
        spark.udf.registerJavaFunction("bench_udf", "stewardtest.ExecUdf", StringType())
        if way != "add_jar":
            start = max(_executors_added_ms(spark)) / 1000
        executors = _udf_on_every_executor(spark)
        elapsed = time.time() - start
        stats = st.blobs.stats()
        if way == "spark":
            fetched = _spark_fetches(spark, jar.name)
            served = fetched * jar.stat().st_size
            how = f"{fetched} executor log(s) say 'Fetching spark://...{jar.name}'"
        else:
            served = stats.get("bytes_served", 0) + stats.get("served_local", 0) * jar.stat().st_size
            how = (f"BlobServer bytes_served={stats.get('bytes_served', 0)}, "
                   f"served_local={stats.get('served_local', 0)}")
        return {"time": elapsed, "served": served, "executors": len(executors), "how": how}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="padding in the jar, MB (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the order (default 3)")
    parser.add_argument("--no-add-jar", action="store_true", help="skip the st.add_jar runtime row")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"spark": [], "steward": [], "add_jar": []}
    with tempfile.TemporaryDirectory(prefix="bench-jars-") as tmp, local_s3() as s3:
        jar = _padded_jar(Path(tmp), args.mb)
        size = jar.stat().st_size
        ha = s3.url("ha")
        url = put(jar, ha)  # `steward blobs put <jar> --ha <url>`, ahead of time
        print(f"{size / 2**20:.1f} MB jar to every executor of local-cluster[2,1,1024] (HA store: moto S3 on "
              f"loopback); steward URL {url}", flush=True)
        print(f"{'round':<7}{'way':<9}{'time (s)':>10}{'driver served':>16}{'executors':>11}  how the bytes were "
              "counted", flush=True)
        for r in range(args.rounds):
            order = ["spark", "steward"] if r % 2 == 0 else ["steward", "spark"]
            if not args.no_add_jar:
                order.append("add_jar")
            for way in order:
                res = _run(way, jar, ha)
                runs[way].append(res)
                print(f"{r + 1:<7}{way:<9}{res['time']:>10.2f}{res['served'] / 2**20:>13.1f} MB{res['executors']:>11}"
                      f"  {res['how']}", flush=True)
    print()
    med = {way: statistics.median(x["time"] for x in rs) for way, rs in runs.items() if rs}
    for way, m in med.items():
        served = max(x["served"] for x in runs[way])
        print(f"median {way:<9}{m:>8.2f} s   driver served (max over runs) {served / 2**20:.1f} MB")
    ratio = med["steward"] / med["spark"]
    steward_bytes = max(x["served"] for x in runs["steward"])
    print(f"steward / spark median time: {ratio:.2f}x (goal <= 1.2x: {'met' if ratio <= 1.2 else 'NOT met'}); "
          f"steward driver bytes: {steward_bytes} (goal 0: {'met' if steward_bytes == 0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
