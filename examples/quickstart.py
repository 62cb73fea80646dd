"""spark-steward quickstart: runs on local[2] with zero configuration.

    make quickstart        (or: python examples/quickstart.py)
"""

from __future__ import annotations

import time

from pyspark.sql import SparkSession

import sparksteward


def main() -> None:
    spark = sparksteward.configure(
        SparkSession.builder.master("local[2]").appName("steward-quickstart").config("spark.ui.enabled", "false")
    ).getOrCreate()
    st = sparksteward.Steward.get(spark)
    print("driver agent:", {k: st.health()[k] for k in ("state", "pid", "app_id")})

    spark.sparkContext.addJobTag("quickstart")
    total = spark.sparkContext.parallelize(range(1000), 4).sum()
    spark.sparkContext.removeJobTag("quickstart")
    deadline = time.monotonic() + 10
    while not st.events("job_end") and time.monotonic() < deadline:
        time.sleep(0.05)
    job = st.events("job_start")[-1]
    print(f"sum = {total}; the driver agent saw Spark job {job['job_id']} with tags {job['job_tags']}")

    spark.stop()
    print("quickstart finished")


if __name__ == "__main__":
    main()
