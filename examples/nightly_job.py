"""An application job with a stable id: run it twice, and the second submit is refused.

    spark-submit --conf spark.plugins=sparksteward.shim.StewardPlugin --jars "$(steward jar)" \\
        --conf spark.steward.job.id=nightly-2026-11-22 examples/nightly_job.py [runs-file]

The optional runs-file gets one line per run of the job body (the tests count them).
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("nightly").getOrCreate()
rows = spark.range(1000).count()
if len(sys.argv) > 1:
    with open(sys.argv[1], "a") as f:
        f.write(f"{spark.sparkContext.applicationId} {rows}\n")
print(f"nightly job done: {rows} rows")
spark.stop()
