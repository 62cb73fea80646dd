"""The streaming query of must-show 1 (issue 8), shared by tests/keyed_state/test_process_cluster.py and run
by it as a separate driver process (``python -m tests.helpers.state_process_driver ...``) that SIGKILLs itself
right after ``commit`` of one batch, before Spark records the batch.

The query reads JSON files (one per micro-batch: ``maxFilesPerTrigger=1``, ``availableNow``) and keeps
a count and sum per key with ``KeyedState.process``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import pandas as pd

SCHEMA = "k string, n long, s long"
INPUT_SCHEMA = "k string, v long"
KILL_KEY = "kill-me"  # only in file 2: the executor running its subtask is SIGKILLed mid-batch


def write_inputs(directory: Path, count: int, seed: int = 8, rows: int = 200, keys: int = 30) -> list[Path]:
    """``count`` JSON-lines files; file 2 also holds the key ``KILL_KEY``."""
    rnd = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        recs = [{"k": f"user-{rnd.randrange(keys)}", "v": rnd.randrange(100)} for _ in range(rows)]
        if i == 2:
            recs.append({"k": KILL_KEY, "v": 7})
        path = directory / f"part-{i:03d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        paths.append(path)
    return paths


def expected(paths: list[Path]) -> dict[str, tuple[int, int]]:
    rows = pd.concat([pd.read_json(p, lines=True) for p in paths])
    g = rows.groupby("k")["v"].agg(["count", "sum"])
    return {k: (int(r["count"]), int(r["sum"])) for k, r in g.iterrows()}


def count_sum_fn(hook_dir: str | None = None):
    """count and sum per key. With ``hook_dir`` holding an ``arm`` file, the first task to see
    ``KILL_KEY`` takes the arm, writes its executor JVM's pid to ``hook_dir/pid`` and waits for
    ``hook_dir/go`` (the test SIGKILLs that JVM meanwhile); its retry finds no arm and goes on."""

    def fn(key, rows, state):
        cur = state.get() or {"n": 0, "s": 0}
        cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
        state.update(cur)
        if hook_dir is not None and key == KILL_KEY:
            try:
                os.rename(os.path.join(hook_dir, "arm"), os.path.join(hook_dir, "taken"))
            except FileNotFoundError:
                pass  # not armed, or a retry
            else:
                import psutil

                jvm = next(p for p in psutil.Process().parents() if "CoarseGrainedExecutorBackend" in " ".join(
                    p.cmdline()))
                tmp = os.path.join(hook_dir, "pid.tmp")
                with open(tmp, "w") as f:
                    f.write(str(jvm.pid))
                os.replace(tmp, os.path.join(hook_dir, "pid"))
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(hook_dir, "go")) and time.monotonic() < deadline:
                    time.sleep(0.05)
        return pd.DataFrame({"k": [key], "n": [cur["n"]], "s": [cur["s"]]})

    return fn


def start_query(spark, ks, source: Path, spark_chk: Path, sink, fn=None, after_commit=None):
    """Start the query (``availableNow``: every file there, one per batch, then it stops)."""
    run = ks.process(fn or count_sum_fn(), SCHEMA, sink=sink, wait=120)

    def each_batch(batch_df, batch_id):
        run(batch_df, batch_id)
        if after_commit is not None:
            after_commit(batch_id)

    events = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(source)))
    return (events.writeStream.foreachBatch(each_batch).option("checkpointLocation", str(spark_chk))
            .trigger(availableNow=True).start())


def main() -> None:
    """A driver process: run the query, and SIGKILL this process right after commit(--kill-after)."""
    ap = argparse.ArgumentParser()
    for name in ("source", "spark-chk", "state-chk", "state-dir", "cluster-id", "name"):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--kill-after", type=int, required=True)
    args = ap.parse_args()

    import sparksteward
    from pyspark.sql import SparkSession
    from sparksteward import Steward

    builder = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("steward-process-driver")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "1g")
               .config("spark.sql.shuffle.partitions", "4").config("spark.steward.state-dir", args.state_dir)
               .config("spark.steward.cluster-id", args.cluster_id))
    spark = sparksteward.configure(builder).getOrCreate()
    ks = Steward.get(spark).keyed_state(args.name, key="k", parallelism=4, max_parallelism=32,
                                        checkpoint_dir=args.state_chk)

    def die_after_commit(batch_id):
        print(f"committed batch {batch_id}", flush=True)
        if batch_id == args.kill_after:  # committed, and Spark has not recorded the batch yet
            os.kill(os.getpid(), signal.SIGKILL)

    query = start_query(spark, ks, Path(args.source), Path(args.spark_chk), sink=lambda out, bid: out.collect(),
                        after_commit=die_after_commit)
    query.awaitTermination()
    print("query ended without the kill", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
