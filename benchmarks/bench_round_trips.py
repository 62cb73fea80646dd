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

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
import numpy as np
import pandas as pd
import pyarrow as pa
import sparksteward
from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession
from sparksteward.jar import shim_jar
from sparksteward import Steward
tmp = tempfile.mkdtemp()
os.environ["XDG_STATE_HOME"] = tmp + "/xdg"
SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).set("spark.jars", str(shim_jar())))
b = SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "8").config("spark.executor.memory", "1g").config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
spark = sparksteward.configure(b).getOrCreate()
st = Steward.get(spark)
ks = st.keyed_state("p", key="k", parallelism=8, max_parallelism=128, checkpoint_dir=tmp + "/chk")
def fn(keys, rows, state):
    t = rows.group_by("k").aggregate([("v", "sum")])
    ks_ = t.column("k").to_pylist()
    old = state.get_many(ks_)
    s = [(o or 0) + c for o, c in zip(old, t.column("v_sum").to_pylist())]
    state.put_many(ks_, s)
    return pa.table({"k": ks_, "s": pa.array(s, pa.int64())})
run = ks.process(fn, "k string, s long", lambda out, cid: out.write.mode("overwrite").parquet(tmp + "/out"), form="arrow")
rng = np.random.default_rng(1)
def batch(cid):
    df = spark.createDataFrame(pd.DataFrame({"k": [f"key-{i}" for i in rng.integers(0, 2000, 2000)], "v": rng.integers(0, 100, 2000)}))
    run(df, cid)
for cid in range(2):
    batch(cid)
time.sleep(1.5)
h0 = st.health()
N = 5
t = time.perf_counter()
for cid in range(2, 2 + N):
    batch(cid)
el = time.perf_counter() - t
h1 = st.health()
r0, r1 = h0.get("requests", {}), h1.get("requests", {})
print(f"handshakes/batch {(h1.get('handshakes', 0) - h0.get('handshakes', 0)) / N:.1f}  batch {el / N * 1000:.0f} ms")
for op in sorted(r1):
    d = r1[op] - r0.get(op, 0)
    if d:
        print(f"  {op:20} {d / N:6.1f}/batch")
spark.stop()
shutil.rmtree(tmp, ignore_errors=True)
