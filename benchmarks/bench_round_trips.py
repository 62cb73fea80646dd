"""The requests and handshakes one keyed-state batch makes to the driver agent, and its duration.

Runs ``KeyedState.process`` (the Arrow form, P=8, 2,000 rows over 2,000 keys per batch) on
``local-cluster[2,1,1024]``: two warm-up batches, then five measured ones. The driver agent counts
what it receives (``health()["requests"]``, by op, and ``["handshakes"]``, new authenticated
connections). docs/architecture.md quotes the numbers.

Run: ``flock /tmp/steward-spark.lock python benchmarks/bench_round_trips.py``
"""

import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import sparksteward
from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession
from sparksteward import Steward
from sparksteward.jar import shim_jar

ROWS = KEYS = 2000
P, M = 8, 128
WARM, MEASURED = 2, 5


def add(keys, rows, state):
    """The Arrow form: per key of the batch, the sum of ``v`` added to its state."""
    t = rows.group_by("k").aggregate([("v", "sum")])
    batch_keys = t.column("k").to_pylist()
    old = state.get_many(batch_keys)
    sums = [(o or 0) + c for o, c in zip(old, t.column("v_sum").to_pylist())]
    state.put_many(batch_keys, sums)
    return pa.table({"k": batch_keys, "s": pa.array(sums, pa.int64())})


def main() -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    tmp = tempfile.mkdtemp(prefix="steward-bench-rt-")
    os.environ["XDG_STATE_HOME"] = os.path.join(tmp, "xdg")   # never the user's default state dir
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).set("spark.jars", str(shim_jar())))
    builder = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", str(P)).config("spark.executor.memory", "1g")
               .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    spark = sparksteward.configure(builder).getOrCreate()
    try:
        st = Steward.get(spark)
        ks = st.keyed_state("p", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=os.path.join(tmp, "chk"))
        run = ks.process(add, "k string, s long", form="arrow",
                         sink=lambda out, cid: out.write.mode("overwrite").parquet(os.path.join(tmp, "out")))
        rng = np.random.default_rng(1)

        def batch(cid: int) -> None:
            rows = pd.DataFrame({"k": [f"key-{i}" for i in rng.integers(0, KEYS, ROWS)],
                                 "v": rng.integers(0, 100, ROWS)})
            run(spark.createDataFrame(rows), cid)

        for cid in range(WARM):
            batch(cid)
        time.sleep(1.5)   # the warm-up's last heartbeats
        before = st.health()
        started = time.perf_counter()
        for cid in range(WARM, WARM + MEASURED):
            batch(cid)
        elapsed = time.perf_counter() - started
        after = st.health()
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    handshakes = (after.get("handshakes", 0) - before.get("handshakes", 0)) / MEASURED
    print(f"P={P} on local-cluster[2,1,1024], per batch: {handshakes:.1f} handshakes to the driver agent, "
          f"batch {elapsed / MEASURED * 1000:.0f} ms")
    for op, count in sorted(after.get("requests", {}).items()):
        per = (count - before.get("requests", {}).get(op, 0)) / MEASURED
        if per:
            print(f"  {op:20} {per:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
