"""Checkpoint file merging (FLIP-306, issue 9, must-show 1) against Spark's state store, in one run.

One application on ``local-cluster[2,1,1024]``. Three streaming queries over the same input (file 0
creates ``BENCH_MERGE_KEYS`` keys, each later file updates ``BENCH_MERGE_UPDATE`` random keys: the
state changes little per batch), with the count-and-sum-per-key workload of ``bench_state.py``:

- ``merged``: our Arrow form, ``parallelism=32``, checkpoints on moto's S3 server, file merging on;
- ``whole``: the same with ``file_merging=False`` (one object per new file);
- ``transformWithStateInPandas`` with 32 shuffle partitions (RocksDB provider, changelog
  checkpointing). Its checkpoint location is local, since the pyspark wheel has no S3A file system:
  each file it writes is at least one PUT on an object store, so its files per batch are counted.

Per batch it prints the objects written and the PUT-type requests (PutObject, multipart parts,
CopyObject) that moto saw, our batch duration, and Spark's files. The goal: ours writes at most
``executors + 2`` objects per checkpoint, at least 10x fewer than Spark's files. Run it alone
(``flock /tmp/steward-spark.lock python benchmarks/bench_merging.py``); ``bench_state.py`` runs it too.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_state  # noqa: E402
from bench_state import SCHEMA, Written, add_input, ours_json_fn, tws_processor  # noqa: E402

KEYS = int(os.environ.get("BENCH_MERGE_KEYS", "20000"))
UPDATE = int(os.environ.get("BENCH_MERGE_UPDATE", "200"))
BATCHES = int(os.environ.get("BENCH_MERGE_BATCHES", "6"))
P, M, EXECUTORS = 32, 128, 2
_PUTS = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "CopyObject")
_OBJECTS = ("PutObject", "CompleteMultipartUpload", "CopyObject")


def write_inputs(root: Path) -> list[Path]:
    rng = np.random.default_rng(306)
    names = np.array([f"user-{i:07d}" for i in range(KEYS)], dtype=object)
    out = []
    for i in range(BATCHES + 1):
        idx = np.arange(KEYS) if i == 0 else rng.integers(0, KEYS, UPDATE)
        path = root / "inputs" / f"part-{i:04d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"k": pa.array(names[idx], pa.string()),
                                 "v": pa.array(rng.integers(0, 1000, len(idx)))}), path)
        out.append(path)
    return out


def start(root: Path, s3: Any) -> Any:
    import sparksteward
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession
    from sparksteward.jar import shim_jar

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python workers: this venv
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).set("spark.jars", str(shim_jar())))
    conf = {"spark.ui.enabled": "false", "spark.executor.memory": "1g", "spark.sql.shuffle.partitions": str(P),
            "spark.sql.streaming.stateStore.providerClass":
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
            "spark.sql.adaptive.enabled": "false", "spark.steward.state-dir": str(root / "steward-state"),
            "spark.steward.storage.options": s3.storage_options(),
            "spark.steward.agent.python": sys.executable, "spark.pyspark.python": sys.executable}
    builder = SparkSession.builder.master("local-cluster[2,1,1024]").appName("bench-merging")
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = sparksteward.configure(builder).getOrCreate()
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
    deadline = time.monotonic() + 120
    while status().size() < EXECUTORS + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("executors did not register within 120 s")
        time.sleep(0.2)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class Query:
    def __init__(self, spark: Any, engine: str, root: Path, s3: Any) -> None:
        self.spark, self.engine, self.root, self.s3 = spark, engine, root, s3
        self.chk = root / "queries" / engine
        self.per_batch: dict[int, dict[str, Any]] = {}
        self.ks = None
        if engine != "transformWithStateInPandas":
            from sparksteward import Steward

            self.ks = Steward.get(spark).keyed_state(f"bench-{engine}", key="k", parallelism=P, max_parallelism=M,
                                                     checkpoint_dir=s3.url("bench-merging"),
                                                     file_merging=engine == "merged")
        self.written = Written(self.chk / "state")

    def sink(self, df: Any, batch_id: int) -> None:
        t = time.perf_counter()
        if self.ks is None:
            df.write.format("noop").mode("append").save()
            self.written.look(batch_id)
            n, b = self.written.per_batch[batch_id]
            self.per_batch[batch_id] = {"objects": n, "puts": n, "bytes": b, "ms": (time.perf_counter() - t) * 1000}
            return
        mark = self.s3.mark()
        self.ks.apply_arrow(df, ours_json_fn, SCHEMA, checkpoint_id=batch_id).write.format("noop").mode("append").save()
        self.ks.commit(batch_id)
        stats = next(c for c in self.ks.info()["checkpoints"] if c["checkpoint_id"] == batch_id)
        reqs = [q for q in self.s3.requests_since(mark) if q.op in _PUTS]
        self.per_batch[batch_id] = {"objects": len({q.key for q in reqs if q.op in _OBJECTS}), "puts": len(reqs),
                                    "bytes": sum(q.bytes_in for q in reqs), "ms": (time.perf_counter() - t) * 1000,
                                    "reported": stats["objects_written"]}

    def run(self, indir: Path) -> None:
        src = self.spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
        df = src if self.ks is not None else src.groupBy("k").transformWithStateInPandas(
            tws_processor(), SCHEMA, "Update", "None")
        q = (df.writeStream.foreachBatch(self.sink).option("checkpointLocation", str(self.chk))
             .outputMode("update").start())
        try:
            q.processAllAvailable()
        finally:
            q.stop()


def run_merging(root: Path) -> dict[str, Any]:
    """Run the three queries; print per batch and return the medians of the steady batches."""
    from pyspark import cloudpickle
    from sparksteward.testing.s3 import local_s3

    cloudpickle.register_pickle_by_value(bench_state)  # executors cannot import the bench's modules
    files = write_inputs(root)
    with local_s3() as s3:
        spark = start(root, s3)
        try:
            engines = ("merged", "whole", "transformWithStateInPandas")
            queries = {}
            for e in engines:
                indir = root / "in" / e
                indir.mkdir(parents=True)
                for i, f in enumerate(files):
                    add_input(f, indir, 1_700_000_000 + i)
                queries[e] = Query(spark, e, root, s3)
                queries[e].run(indir)
        finally:
            spark.stop()
    print(f"\nfile merging (FLIP-306): {KEYS:,} keys, then {BATCHES} batches of {UPDATE} updated rows; parallelism / "
          f"shuffle partitions {P}; {EXECUTORS} executors; ours on moto S3")
    print(f"{'engine':<28} {'batch':>5} {'objects':>8} {'PUTs':>6} {'KB':>9} {'ms':>8}")
    summary = {}
    for e, q in queries.items():
        for b, r in sorted(q.per_batch.items()):
            print(f"{e:<28} {b:>5} {r['objects']:>8} {r['puts']:>6} {r['bytes'] / 1024:>9.1f} {r['ms']:>8.0f}")
        steady = [r for b, r in q.per_batch.items() if b > 0]
        summary[e] = {k: statistics.median(r[k] for r in steady) for k in ("objects", "puts", "bytes", "ms")}
        summary[e]["max_objects"] = max(r["objects"] for r in steady)
    m, w, t = summary["merged"], summary["whole"], summary["transformWithStateInPandas"]
    print(f"steady batches (median): merged {m['objects']:.0f} objects / {m['puts']:.0f} PUTs (max "
          f"{m['max_objects']}), whole {w['objects']:.0f} / {w['puts']:.0f}, transformWithStateInPandas "
          f"{t['objects']:.0f} files")
    print(f"  merged vs transformWithStateInPandas: {t['objects'] / max(m['objects'], 1):.1f}x fewer objects "
          f"(goal >= 10x); vs whole files: {w['objects'] / max(m['objects'], 1):.1f}x fewer")
    print(f"  batch duration (median ms): merged {m['ms']:.0f}, whole {w['ms']:.0f} "
          f"({m['ms'] / max(w['ms'], 1):.2f}x)")
    ok = m["max_objects"] <= EXECUTORS + 2 and t["objects"] >= 10 * m["objects"]
    print(f"  at most executors + 2 = {EXECUTORS + 2} objects per checkpoint and >= 10x fewer: "
          f"{'PASS' if ok else 'FAIL'}")
    return summary


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-merging-") as tmp:
        run_merging(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
