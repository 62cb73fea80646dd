"""Keyed state against the same pipeline without state: how close to the ceiling (issue 20, must-show 6).

One application on ``local-cluster[2,1,1024]`` reads ``CEIL_FILES`` parquet files of ``CEIL_ROWS`` rows
over ``CEIL_KEYS`` string keys as a stream (``maxFilesPerTrigger=1``) and runs, one query after the
other, the same count-and-sum per key three ways, each writing its per-key output to parquet from
``foreachBatch``:

- ``stateless``: the ceiling. The same routing as ours (the subtask of each key, ``repartitionById``
  into the same P partitions), then ``mapInArrow`` computing the count and sum per key of the batch in
  pyarrow. No state: the cost of Spark, the shuffle, Arrow and the sink alone;
- ``ours-typed``: ``apply_arrow`` with a declared ``value_state("agg", "n bigint, s bigint")``,
  ``get_many``/``put_many`` on Arrow arrays, checkpointed every batch;
- ``ours-json``: the same with the untyped default value state (JSON values, Python lists);

The three run ``CEIL_ROUNDS`` times (default 2) in turn, each round on its own input dir and state:
the JVM warms up over the first queries (the ceiling itself ran 118k records/s first, 229k last), so
the report is of the last round, with the first for reference.

Records/s are over batches 1.. (batch 0 pays the Python workers' start); the report gives each as a
fraction of ``stateless``. ``CEIL_PROFILE=1`` then profiles one subtask's state work of a batch of the
same size without Spark (``run_arrow`` plus the snapshot) with cProfile and prints where it goes.

    flock /tmp/steward-spark.lock python benchmarks/bench_state_ceiling.py
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_state  # noqa: E402 - the shared session setup

KEYS = int(os.environ.get("CEIL_KEYS", "200000"))
ROWS = int(os.environ.get("CEIL_ROWS", "200000"))
FILES = int(os.environ.get("CEIL_FILES", "5"))
P, M = bench_state.P, bench_state.M
SCHEMA = "k string, n long, s long"
ENGINES = ("stateless", "ours-typed", "ours-json")
ROUNDS = int(os.environ.get("CEIL_ROUNDS", "2"))   # the JVM warms up over the first queries: the last round counts


def stateless_fn(batches):
    import pyarrow as pa

    for b in batches:
        t = pa.Table.from_batches([b]).drop_columns(["__steward_subtask"])
        g = t.group_by("k").aggregate([("v", "count"), ("v", "sum")])
        yield from pa.table({"k": g["k"], "n": g["v_count"], "s": g["v_sum"]}).to_batches()


def typed_fn(keys, rows, state):
    import pyarrow as pa
    import pyarrow.compute as pc

    g = rows.group_by("k").aggregate([("v", "count"), ("v", "sum")]).combine_chunks()
    agg = state.value("agg")
    old = agg.get_many(g["k"])
    had = pc.is_valid(old)
    n = pc.add(pc.if_else(had, pc.struct_field(old, "n"), 0), g["v_count"])
    s = pc.add(pc.if_else(had, pc.struct_field(old, "s"), 0), g["v_sum"])
    agg.put_many(g["k"], pa.StructArray.from_arrays([n.combine_chunks(), s.combine_chunks()], names=["n", "s"]))
    return pa.table({"k": g["k"], "n": n, "s": s})


def json_fn(keys, rows, state):
    return bench_state.ours_arrow_fn(keys, rows, state)


def write_inputs(root: Path) -> list[Path]:
    rng = np.random.default_rng(20)
    names = np.array([f"user-{i:07d}" for i in range(KEYS)], dtype=object)
    staged = root / "inputs"
    staged.mkdir()
    out = []
    for i in range(FILES):
        idx = rng.integers(0, KEYS, ROWS)
        t = pa.table({"k": pa.array(names[idx], pa.string()), "v": pa.array(rng.integers(0, 1000, ROWS))})
        path = staged / f"part-{i:04d}.parquet"
        pq.write_table(t, path)
        out.append(path)
    return out


def run_engine(spark: Any, engine: str, root: Path, indir: Path) -> dict[int, float]:
    from pyspark.sql import functions as F

    from sparksteward import Steward, value_state
    from sparksteward.routing import subtask_sql

    out = root / "out" / engine
    ks = None
    if engine != "stateless":
        states = [value_state("agg", "n bigint, s bigint")] if engine == "ours-typed" else None
        ks = Steward.get(spark).keyed_state(f"{engine}-{root.name}", key="k", parallelism=P, max_parallelism=M,
                                            checkpoint_dir=str(root / "chk"), states=states)

    def sink(df: Any, batch_id: int) -> None:
        if ks is None:
            routed = df.withColumn("__steward_subtask", F.expr(subtask_sql("k", P, M))).repartitionById(
                P, "__steward_subtask")
            routed.mapInArrow(stateless_fn, SCHEMA).write.mode("append").parquet(str(out))
        else:
            ks.apply_arrow(df, typed_fn if engine == "ours-typed" else json_fn, SCHEMA,
                           checkpoint_id=batch_id).write.mode("append").parquet(str(out))
            ks.commit(batch_id)

    src = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
    q = src.writeStream.foreachBatch(sink).option("checkpointLocation", str(root / "q" / engine)).start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    return {p.batchId: p.durationMs.get("triggerExecution", 0) for p in q.recentProgress if p.numInputRows}


def profile_state_work() -> str:
    """cProfile of one subtask's state work for a batch of ROWS / P rows (no Spark)."""
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.declared import resolve, value_state
    from sparksteward.state.keygroups import key_group_range
    from sparksteward.state.runner import run_arrow
    from sparksteward.state.typed import TypedStates

    tmp = Path(tempfile.mkdtemp(prefix="ceil-prof-"))
    try:
        rng = np.random.default_rng(3)
        n = ROWS // P
        rows = pa.record_batch({"k": pa.array([f"user-{i:07d}" for i in rng.integers(0, KEYS, n)]),
                                "v": pa.array(rng.integers(0, 1000, n))})
        kg = key_group_range(M, 1, 0)
        record = resolve(None, [value_state("agg", "n bigint, s bigint")])
        schema = pa.schema([("k", pa.string()), ("n", pa.int64()), ("s", pa.int64())])
        b = RocksDBStateBackend(tmp / "w0", kg, M, "string")
        list(run_arrow(iter([rows]), "k", typed_fn, b, schema, states=TypedStates(b, record, 0, 1)))  # warm
        b.snapshot(tmp / "s0")
        prof = cProfile.Profile()
        b = RocksDBStateBackend(tmp / "w0", kg, M, "string", create=False)
        started = time.perf_counter()
        prof.enable()
        list(run_arrow(iter([rows]), "k", typed_fn, b, schema, states=TypedStates(b, record, 0, 2)))
        b.snapshot(tmp / "s1")
        prof.disable()
        total = (time.perf_counter() - started) * 1000
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        return f"one subtask, {n:,} rows: {total:.0f} ms of state work\n" + text.getvalue()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    os.environ["XDG_STATE_HOME"] = str(root / "xdg")
    try:
        files = write_inputs(root)
        print(f"input: {FILES} files x {ROWS:,} rows over {KEYS:,} keys; {bench_state.MASTER}; P={P}, M={M}")
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(bench_state)   # the workers cannot import it by name
        spark = bench_state.start_session(root, "ceiling")
        rounds: list[dict[str, tuple[float, float]]] = []
        for r in range(ROUNDS):
            indir = root / f"in-{r}"
            indir.mkdir()
            base = time.time() - 3600
            for i, f in enumerate(files):
                bench_state.add_input(f, indir, base + i)
            got = {}
            for engine in ENGINES:
                ms = run_engine(spark, engine, root / f"round-{r}", indir)
                steady = [ms[i] for i in sorted(ms)[1:]]
                got[engine] = (ROWS * len(steady) / (sum(steady) / 1000), statistics.median(steady))
                print(f"  round {r}, {engine}: batches {[ms[i] for i in sorted(ms)]} ms", flush=True)
            rounds.append(got)
        spark.stop()
        print()
        print(f"{'engine':12} {'records/s':>10} {'batch p50':>10} {'of stateless':>13} {'(round 1)':>10}")
        last, first = rounds[-1], rounds[0]
        for e in ENGINES:
            print(f"{e:12} {last[e][0]:10,.0f} {last[e][1]:8.0f}ms {last[e][0] / last['stateless'][0]:12.2f} "
                  f"{first[e][0] / first['stateless'][0]:10.2f}")
        if os.environ.get("CEIL_PROFILE") == "1":
            print()
            print(profile_state_work())
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
