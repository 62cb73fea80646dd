"""The application of docs/deployment.md's recipe: keyed state on an object store, submitted with
``spark-submit`` to a cluster whose executors run on other hosts.

    spark-submit --master spark://<master>:7077 \
        --conf spark.plugins=sparksteward.shim.StewardPlugin --jars "$(steward jar)" \
        --conf spark.steward.checkpoint.dir=s3://<bucket>/checkpoints \
        examples/cluster_app.py <batches>

Each run applies ``<batches>`` batches of 1,000 generated clicks over 50 users (the same rows whatever
the run, by batch number) to the keyed state ``clicks`` and commits each one. A second run goes on from
the state the first one left: its batch numbers continue after the latest checkpoint. It prints one JSON
line per batch (the batch, the clicks counted so far) and, at the end, the state read back offline and the
resident memory of the spark-steward agents it can see (this host's).
"""

from __future__ import annotations

import json
import sys

import pandas as pd
import sparksteward
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sparksteward import Steward, value_state


def count(key, rows, state):
    clicks = state.value("clicks")
    n = (clicks.get() or 0) + len(rows)
    clicks.update(n)
    return pd.DataFrame({"user": [key], "clicks": [n]})


def main(batches: int) -> None:
    spark = sparksteward.configure(SparkSession.builder.appName("steward-cluster-recipe")).getOrCreate()
    st = Steward.get(spark)
    ks = st.keyed_state("clicks", key="user", parallelism=4, states=[value_state("clicks", "bigint")])
    last = ks.info().get("last_completed")
    first = 0 if last is None else last + 1
    for b in range(first, first + batches):
        rows = spark.range(1000).select(F.concat(F.lit("u"), ((F.col("id") * 7 + b) % 50).cast("string")).alias("user"))
        ks.apply(rows, count, "user string, clicks long", checkpoint_id=b).collect()
        ks.commit(b, wait=120)
        total = st.read_state("clicks", variable="clicks").agg(F.sum("value")).first()[0]
        print(json.dumps({"batch": b, "clicks": total}), flush=True)
    print(json.dumps({"agents_rss_mb": _agents_rss()}), flush=True)
    spark.stop()


def _agents_rss() -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for role in ("driver", "executor"):
            if f"sparksteward.agents.{role}" in cmd and p.info["memory_info"] is not None:
                out[f"{role}-{p.pid}"] = round(p.info["memory_info"].rss / 2**20, 1)
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
