"""Incremental checkpoints and rescale of keyed state in Spark (issue 8, must-show 4 and 2), on
local-cluster[2,1,1024].

A 1M-key state (``BENCH_KEYS``) at parallelism 8 gets ``BENCH_BATCHES`` batches that each update 1%
of the keys. For every checkpoint it prints the files and bytes uploaded and reused, taken from the
executor agents' acks (``ks.info()["checkpoints"]``), and the batch time. Then one more 1% batch
at parallelism 4 (a rescale 8 -> 4), with the old subtasks and bytes each new subtask read.

Expect a small upload per checkpoint until RocksDB's L0 reaches its slowdown trigger (about 20
files: a task's DB lives only for one batch, so background compactions rarely finish), then one
checkpoint that uploads the compacted files.

Run: ``flock /tmp/steward-spark.lock python benchmarks/bench_state_incremental.py``
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparksteward import Steward  # noqa: E402
from tests.test_state_rescale_spark import SCHEMA, add_counts  # noqa: E402

from tests.conftest import spark_session, wait_until  # noqa: E402

KEYS = int(os.environ.get("BENCH_KEYS", "1000000"))
BATCHES = int(os.environ.get("BENCH_BATCHES", "25"))
M = 128


def _batch(spark, ks, cid: int, df) -> float:
    t = time.perf_counter()
    ks.apply_arrow(df, add_counts, SCHEMA, checkpoint_id=cid).write.format("noop").mode("overwrite").save()
    ks.commit(cid, wait=300)
    return time.perf_counter() - t


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="bench-incr-"))
    try:
        conf = {"spark.executor.memory": "1g", "spark.steward.state-dir": str(root / "state")}
        with spark_session("local-cluster[2,1,1024]", **conf) as spark:
            status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
            wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")
            st = Steward.get(spark)
            ks = st.keyed_state("bench", key="k", parallelism=8, max_parallelism=M, checkpoint_dir=str(root / "chk"))
            secs = {}
            for cid in range(BATCHES + 1):
                if cid == 0:
                    df = spark.range(KEYS).selectExpr("id as k", "id % 1000 as v")
                else:
                    df = spark.range(KEYS // 100).selectExpr(f"(id * 7919 + {cid} * 104729) % {KEYS} as k", "1L as v")
                secs[cid] = _batch(spark, ks, cid, df)
            print(f"{KEYS} keys, P=8, each batch after the first updates 1% of the keys")
            print(f"{'chk':>4} {'files up':>8} {'reused':>6} {'bytes up':>11} {'total bytes':>11} {'sync max':>8} "
                  f"{'batch s':>7}")
            for s in ks.info()["checkpoints"]:
                cid = s["checkpoint_id"]
                print(f"{cid:>4} {s['files_uploaded']:>8} {s['files_reused']:>6} {s['bytes_uploaded']:>11} "
                      f"{s['bytes']:>11} {s['sync_ms_max']:>7.0f}ms {secs[cid]:>7.2f}")

            small = st.keyed_state("bench", key="k", parallelism=4, max_parallelism=M,
                                   checkpoint_dir=str(root / "chk"))
            cid = BATCHES + 1
            df = spark.range(KEYS // 100).selectExpr(f"(id * 7919 + {cid} * 104729) % {KEYS} as k", "1L as v")
            t = _batch(spark, small, cid, df)
            (s,) = [c for c in small.info()["checkpoints"] if c["checkpoint_id"] == cid]
            print(f"\nrescale 8 -> 4 (a 1% batch): {t:.2f} s for the batch; per new subtask:")
            for r in s["restores"]:
                print(f"  {r['subtask']}: old subtasks {[r['base'], *r['ingested_from']]}, read {r['bytes_read']} B, "
                      f"downloaded {r['bytes_downloaded']} B, rebuilt in {r['seconds']:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
