"""A small streaming application for ``tests/test_console_noise.py``: ``console_app.py plain|steward DIR``
runs one foreachBatch query over one parquet file and stops it, plain PySpark or through
``ks.process`` with the plugin on. Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import sys

import pandas as pd
from pyspark.sql import SparkSession


def main(how: str, d: str) -> None:
    builder = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
    if how == "steward":
        import sparksteward

        builder = sparksteward.configure(builder)
    spark = builder.getOrCreate()
    spark.createDataFrame(pd.DataFrame({"k": ["a", "b"], "v": [1, 2]})).write.parquet(f"{d}/in")
    sink = lambda out, batch_id: out.write.mode("append").parquet(f"{d}/out")  # noqa: E731
    if how == "steward":
        ks = sparksteward.Steward.get(spark).keyed_state("noise", key="k", parallelism=2, checkpoint_dir=f"{d}/chk")
        sink = ks.process(lambda key, rows, state: (key, len(rows)), "k string, n long", sink=sink)
    q = (spark.readStream.schema("k string, v long").parquet(f"{d}/in").writeStream.foreachBatch(sink)
         .option("checkpointLocation", f"{d}/q").start())
    q.processAllAvailable()
    q.stop()
    print("STOPPED", flush=True)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
