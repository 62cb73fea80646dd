"""Unaligned checkpoints (FLIP-76, issue 10, must-show 1): a skewed stream in three alignments, one run.

One application on ``local-cluster[2,1,1024]``. A parquet stream (``maxFilesPerTrigger=1``) whose
subtask 0 gets ``BENCH_SKEW`` (10) times the rows of each other subtask in every file, through
``ks.process`` with the per-key pandas form (count and sum per key; Arrow batches of
``BENCH_BUFFER_ROWS`` rows, so a subtask has many buffer boundaries). Three states over the same files:

- ``aligned``: every batch waits for subtask 0;
- ``unaligned``: aligned-checkpoint timeout 1 s: past it, a subtask defers the rest of its input into
  the checkpoint and the next batch replays it first;
- ``unaligned_max_inflight``: the same, while the deferred bytes fit in ``BENCH_MAX_INFLIGHT``.

Per mode it prints batch duration p50, p99 and max (``triggerExecution`` of the query's progress),
checkpoint completion time (from the start of ``foreachBatch`` to ``commit`` returning), the rows
deferred, and the throughput over the whole run: every input row counted, including the drain at the
end (the state opened aligned for one empty batch, which replays what is still deferred). The final
per-key values of the three modes must be equal. Targets: p99 with ``unaligned`` at least 5x lower
than ``aligned``, and throughput at least 0.9x of ``aligned``. Run alone, under the Spark lock:
``flock /tmp/steward-spark.lock python benchmarks/bench_unaligned.py``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

FILES = int(os.environ.get("BENCH_FILES", "5"))
SKEW = int(os.environ.get("BENCH_SKEW", "10"))
ROWS = int(os.environ.get("BENCH_ROWS", "4000"))          # per normal subtask per file
KEYS = int(os.environ.get("BENCH_KEYS", "1600"))           # distinct keys per normal subtask per file
BUFFER_ROWS = int(os.environ.get("BENCH_BUFFER_ROWS", "1000"))
MAX_INFLIGHT = os.environ.get("BENCH_MAX_INFLIGHT", "4m")
TIMEOUT = float(os.environ.get("BENCH_TIMEOUT", "1.0"))
P, M = int(os.environ.get("BENCH_P", "2")), 64  # 2 subtasks: one per executor core
SCHEMA = "k string, n long, s long"
MODES = ("aligned", "unaligned", "unaligned_max_inflight")


def count_sum(key, rows, state):
    cur = state.get() or [0, 0]
    cur = [cur[0] + len(rows), cur[1] + int(rows["v"].sum())]
    state.update(cur)
    return pd.DataFrame({"k": [key], "n": [cur[0]], "s": [cur[1]]})


def write_inputs(root: Path) -> tuple[list[Path], int]:
    """Files whose subtask-0 rows are SKEW times those of each other subtask."""
    from sparksteward.state.keygroups import key_group, subtask_for_key_group

    by_subtask: dict[int, list[str]] = {i: [] for i in range(P)}
    i = 0
    while min(len(v) for v in by_subtask.values()) < KEYS * SKEW:
        k = f"user-{i:07d}"
        by_subtask[subtask_for_key_group(M, P, key_group(k, M))].append(k)
        i += 1
    rng = np.random.default_rng(76)
    out, total = [], 0
    for f in range(FILES):
        parts = []
        for s in range(P):
            n, keys = (ROWS * SKEW, KEYS * SKEW) if s == 0 else (ROWS, KEYS)
            names = np.array(by_subtask[s][:keys], dtype=object)
            parts.append(pd.DataFrame({"k": names[rng.integers(0, keys, n)], "v": rng.integers(0, 100, n)}))
        frame = pd.concat(parts).sample(frac=1.0, random_state=f).reset_index(drop=True)
        path = root / "inputs" / f"part-{f:04d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
        out.append(path)
        total += len(frame)
    return out, total


def start(root: Path) -> Any:
    import sparksteward
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession
    from sparksteward.jar import shim_jar

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).set("spark.jars", str(shim_jar())))
    conf = {"spark.ui.enabled": "false", "spark.executor.memory": "1g", "spark.sql.shuffle.partitions": str(P),
            "spark.sql.adaptive.enabled": "false", "spark.steward.state-dir": str(root / "steward-state"),
            "spark.sql.execution.arrow.maxRecordsPerBatch": str(BUFFER_ROWS),
            "spark.steward.agent.python": sys.executable}
    builder = SparkSession.builder.master("local-cluster[2,1,1024]").appName("bench-unaligned")
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = sparksteward.configure(builder).getOrCreate()
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
    deadline = time.monotonic() + 120
    while status().size() < 3:
        if time.monotonic() > deadline:
            raise RuntimeError("executors did not register within 120 s")
        time.sleep(0.2)
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(0, 4 * P, 1, 4 * P).mapInPandas(lambda it: it, "id long").collect()  # start the workers
    return spark


def stage(files: list[Path], indir: Path) -> Path:
    """``files`` copied into a new ``indir`` for a file stream: renamed into place, mtimes in their order."""
    indir.mkdir(parents=True)
    for i, f in enumerate(files):
        tmp = indir / f".{f.name}.tmp"   # the file source skips dot files
        shutil.copyfile(f, tmp)
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        os.replace(tmp, indir / f.name)
    return indir


def run_mode(spark: Any, mode: str, root: Path, files: list[Path]) -> dict[str, Any]:
    from sparksteward import Steward
    from sparksteward.config import parse_bytes

    indir = stage(files, root / "in" / mode)
    st = Steward.get(spark)
    opts: dict[str, Any] = {"alignment": mode}
    if mode != "aligned":
        opts["aligned_checkpoint_timeout"] = TIMEOUT
    if mode == "unaligned_max_inflight":
        opts["max_inflight_bytes"] = parse_bytes(MAX_INFLIGHT)
    chk_dir = str(root / "chk")
    ks = st.keyed_state(f"skew-{mode}", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=chk_dir, **opts)
    completion: dict[int, float] = {}
    run = ks.process(count_sum, SCHEMA, sink=lambda out, bid: out.write.format("noop").mode("append").save())

    def timed(df: Any, batch_id: int) -> None:
        t = time.perf_counter()
        run(df, batch_id)
        completion[batch_id] = time.perf_counter() - t

    src = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
    started = time.perf_counter()
    q = src.writeStream.foreachBatch(timed).option("checkpointLocation", str(root / "q" / mode)).start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    streamed = time.perf_counter() - started
    durations = [p.durationMs.get("triggerExecution", 0) / 1000 for p in q.recentProgress if p.numInputRows]
    stats = {c["checkpoint_id"]: c for c in ks.info()["checkpoints"]}
    deferred = [stats[b]["rows_deferred"] for b in sorted(stats)]
    # drain: the state opened aligned for one empty batch replays everything still deferred
    t = time.perf_counter()
    ks = st.keyed_state(f"skew-{mode}", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=chk_dir,
                        alignment="aligned")
    last = max(stats)
    ks.apply(spark.createDataFrame([], "k string, v long"), count_sum, SCHEMA, checkpoint_id=last + 1
             ).write.format("noop").mode("append").save()
    ks.commit(last + 1)
    drain = time.perf_counter() - t
    final = {r.key: r.value for r in ks.read().collect()}
    return {"durations": durations, "completion": [completion[b] for b in sorted(completion)],
            "deferred": deferred, "streamed": streamed, "drain": drain, "final": final,
            "channel_bytes": [stats[b]["channel_bytes"] for b in sorted(stats)]}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def main() -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench-unaligned-"))
    os.environ["XDG_STATE_HOME"] = str(root / "xdg")
    try:
        files, total = write_inputs(root)
        spark = start(root)
        try:
            results = {m: run_mode(spark, m, root, files) for m in MODES}
        finally:
            spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nskewed stream: {FILES} files of {total // FILES:,} rows; subtask 0 gets {SKEW}x the rows of each of the "
          f"other {P - 1}; Arrow buffers of {BUFFER_ROWS} rows; local-cluster[2,1,1024]; timeout {TIMEOUT:g} s")
    print(f"{'mode':<24} {'p50 s':>6} {'p99 s':>6} {'max s':>6} {'ckpt p50':>8} {'ckpt p99':>8} {'run s':>6} "
          f"{'drain s':>7} {'rows/s':>8}")
    rate = {}
    for m, r in results.items():
        d, c = r["durations"], r["completion"]
        rate[m] = total / (r["streamed"] + r["drain"])
        print(f"{m:<24} {statistics.median(d):>6.2f} {pct(d, .99):>6.2f} {max(d):>6.2f} {statistics.median(c):>8.2f} "
              f"{pct(c, .99):>8.2f} {r['streamed']:>6.1f} {r['drain']:>7.1f} {rate[m]:>8.0f}")
        print(f"  rows deferred per checkpoint: {r['deferred']}; channel bytes: {r['channel_bytes']}")
    a, u = results["aligned"], results["unaligned"]
    p99_ratio = pct(a["durations"], .99) / max(pct(u["durations"], .99), 1e-9)
    same = a["final"] == u["final"] == results["unaligned_max_inflight"]["final"]
    print(f"p99 batch duration aligned / unaligned: {p99_ratio:.1f}x (goal >= 5x); throughput unaligned / aligned: "
          f"{rate['unaligned'] / rate['aligned']:.2f}x (goal >= 0.9x); same final state in all modes: {same} "
          f"({len(a['final']):,} keys)")
    ok = p99_ratio >= 5 and rate["unaligned"] >= 0.9 * rate["aligned"] and same
    print(f"TARGET {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
