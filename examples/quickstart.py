"""spark-steward quickstart: runs on local[2] with zero configuration.

    make quickstart        (or: python examples/quickstart.py)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import sparksteward
from pyspark.sql import SparkSession


def main() -> None:
    spark = sparksteward.configure(
        SparkSession.builder.master("local[2]").appName("steward-quickstart").config("spark.ui.enabled", "false")
    ).getOrCreate()
    sc = spark.sparkContext
    st = sparksteward.Steward.get(spark)
    health = st.health()
    print(f"driver agent {health['pid']} is {health['state']} for {health['app_id']}")

    # BLOB service: a 64 MB array, stored once, zero-copy in every Python worker
    table = np.arange(8 << 20, dtype=np.float64)
    h = st.broadcast(table)
    print("broadcast", h, "-> partial sums", sc.parallelize(range(4), 4).map(lambda i: float(h.value[i::4].sum())).collect())

    # JobResultStore: a job with a stable id is run once, its scratch space is cleaned up
    scratch = Path(tempfile.mkdtemp(prefix="quickstart-scratch-"))
    job_id = f"quickstart-{sc.applicationId}"
    with st.job(job_id) as job:
        job.cleanup_path(str(scratch))
        spark.range(1000).write.parquet(str(scratch / "out"))
        job.set_result({"rows": spark.read.parquet(str(scratch / "out")).count()})
    entry = st.job_results.get(job_id)
    print(f"job {job_id}: {entry.status.value}, {entry.state}, payload {entry.payload}, scratch gone: {not scratch.exists()}")
    again = st.run_once(job_id, lambda: spark.range(10).count())
    print(f"run_once({job_id!r}) returns the stored payload without running again: {again}")

    spark.stop()
    print("quickstart finished")


if __name__ == "__main__":
    main()
