"""Keyed state against the same pipeline without state: how close to the ceiling (issue 20, must-show 6).

One application on ``local-cluster[2,1,1024]`` reads ``CEIL_FILES`` parquet files of ``CEIL_ROWS`` rows
over ``CEIL_KEYS`` string keys as a stream (``maxFilesPerTrigger=1``) and runs, one query after the
other, the same count-and-sum per key three ways, each writing its per-key output to parquet from
``foreachBatch``:

- ``stateless``: the ceiling. The same routing as ours (the subtask of each key, ``repartitionById``
  into the same P partitions), then ``mapInArrow`` computing the count and sum per key of the batch in
  pyarrow. No state: the cost of Spark, the shuffle, Arrow and the sink alone;
- ``ours-typed``: ``apply_arrow`` over the default value state declared typed
  (``value_state("value", "n bigint, s bigint")``, as the README shows it), ``get_many``/``put_many`` on
  Arrow arrays, checkpointed every batch;
- ``ours-json``: the same with the untyped default value state (JSON values, Python lists);
- ``spark-agg``: Spark's native streaming aggregation, ``groupBy(k).agg(count, sum)`` on its RocksDB
  state store with changelog checkpointing (``bench_state.start_session``'s settings), the line of
  Spark SQL a user would write for this workload (issue 37);

The four run ``CEIL_ROUNDS`` times (default 4) in turn, each round on its own input dir and state.
Round 0 warms the JVM up (the ceiling itself ran 118k records/s first, 229k later) and is reported
apart. The rounds after it alternate the engines' order (the ceiling first, then last), and each gives
a fraction of the ceiling measured minutes apart at most; the report is their median, with every
round's fraction, since the VM's speed drifts by 25% between runs and a single round cannot tell 0.70
from 0.75.

Records/s are over batches 1.. (batch 0 pays the Python workers' start); the report gives each as a
fraction of ``stateless``, and the CPU each kind of process spent per batch (Python workers, agents,
JVMs; ``psutil``). ``CEIL_PROFILE=1`` then times one subtask's state work of a batch of the same size
without Spark, piece by piece (:func:`time_state_work`).

    flock /tmp/steward-spark.lock python benchmarks/bench_state_ceiling.py
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
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_state  # noqa: E402 - the shared session setup

KEYS = int(os.environ.get("CEIL_KEYS", "200000"))
ROWS = int(os.environ.get("CEIL_ROWS", "200000"))
FILES = int(os.environ.get("CEIL_FILES", "5"))
P, M = bench_state.P, bench_state.M
SCHEMA = "k string, n long, s long"
ENGINES = ("stateless", "ours-typed", "ours-json", "spark-agg")
ROUNDS = int(os.environ.get("CEIL_ROUNDS", "4"))   # round 0 warms the JVM up; the median of the rest counts


#: per engine, per batch of the last run: (stage and sink ms, commit wait ms, and the checkpoint report's
#: slowest sync phase, slowest async phase and completion ms)
SPLITS: dict[str, list[tuple[float, ...]]] = {}


def run_engine(spark: Any, engine: str, root: Path, indir: Path) -> dict[int, float]:
    from sparksteward import Steward

    out = root / "out" / engine
    ks = None
    if engine not in ("stateless", "spark-agg"):
        states = bench_state.arrow_states() if engine == "ours-typed" else None
        ks = Steward.get(spark).keyed_state(f"{engine}-{root.name}", key="k", parallelism=P, max_parallelism=M,
                                            checkpoint_dir=str(root / "chk"), states=states)

    def sink(df: Any, batch_id: int) -> None:
        if ks is None:   # the ceiling routes and aggregates; Spark's aggregation arrives aggregated
            began = time.perf_counter()
            if engine == "spark-agg":
                df.write.mode("append").parquet(str(out))
            else:
                bench_state.stateless_write(df, P, str(out))
            SPLITS.setdefault(engine, []).append(((time.perf_counter() - began) * 1000, 0.0, 0.0, 0.0, 0.0))
        else:
            began = time.perf_counter()
            ks.apply_arrow(df, bench_state.ours_arrow_fn if engine == "ours-typed" else bench_state.ours_json_fn, SCHEMA,
                           checkpoint_id=batch_id).write.mode("append").parquet(str(out))
            applied = time.perf_counter()
            ks.commit(batch_id)
            r = ks.report(checkpoint_id=batch_id) or {}
            SPLITS.setdefault(engine, []).append(
                ((applied - began) * 1000, (time.perf_counter() - applied) * 1000,
                 r.get("sync_ms", 0.0), r.get("async_ms", 0.0), r.get("commit_ms", 0.0)))

    src = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
    if engine == "spark-agg":
        from pyspark.sql import functions as F

        src = src.groupBy("k").agg(F.count("v").alias("n"), F.sum("v").alias("s"))
    q = src.writeStream.foreachBatch(sink).outputMode("update").option("checkpointLocation", str(root / "q" / engine)).start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    return {p.batchId: p.durationMs.get("triggerExecution", 0) for p in q.recentProgress if p.numInputRows}


def time_state_work(batches: int = 16) -> str:
    """One subtask's state work for a batch of ROWS / P rows without Spark, piece by piece, in CPU time
    of the whole process (RocksDB's flushes and compactions run on its own threads): subtask 0 of P,
    so the DB holds its share of the KEYS as in the bench. Each batch as a task does it (open the
    snapshot's files; build the keys; multi-get; compute; put_many; the sync phase, which flushes past
    ``task-flush-size``, decision 0022) and as the executor agent does next (fold a WAL past
    ``wal-flush-size`` or ``wal-flush-files``; compact by the default policy). Medians of the batches
    after the first four, then the same keys read three other ways, to compare with the multi-get."""
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.declared import resolve, value_state
    from sparksteward.state.keygroups import key_group_range, key_groups
    from sparksteward.state.snapshot import (
        TASK_FLUSH_BYTES,
        WAL_FLUSH_FILES,
        CompactionPolicy,
        compact_snapshot,
        fold_wal,
    )
    from sparksteward.state.typed import TypedStates, _raw_keys

    tmp = Path(tempfile.mkdtemp(prefix="ceil-time-"))
    rng = np.random.default_rng(3)
    n = ROWS // P
    kg = key_group_range(M, P, 0)
    names = [f"user-{i:07d}" for i in range(KEYS)]
    mine = np.array([k for k, g in zip(names, key_groups(names, M, "string")) if g in kg])
    record = resolve(None, [value_state("agg", "n bigint, s bigint")])
    times: dict[str, list[float]] = {}
    cpu = time.process_time
    try:
        RocksDBStateBackend(tmp / "w", kg, M, "string").snapshot(tmp / "s0")
        for cid in range(1, batches + 1):
            work = tmp / f"w{cid}"
            (work / "db").mkdir(parents=True)
            for f in (tmp / f"s{cid - 1}").iterdir():   # the agent links a restore's files, copies its WAL
                (shutil.copy if f.name.endswith(".log") else os.link)(f, work / "db" / f.name)
            rows = pa.table({"k": pa.array(mine[rng.integers(0, len(mine), n)]),
                             "v": pa.array(rng.integers(0, 1000, n))})
            t = [cpu()]
            b = RocksDBStateBackend(work, kg, M, "string", create=False, flush_wal_above=TASK_FLUSH_BYTES)
            t.append(cpu())
            agg = TypedStates(b, record, 0, cid).value("agg")
            g = rows.group_by("k").aggregate([("v", "count"), ("v", "sum")]).combine_chunks()
            _raw_keys(agg, g["k"])
            t.append(cpu())
            old = agg.get_many(g["k"])
            t.append(cpu())
            had = pc.is_valid(old)
            new = pa.StructArray.from_arrays(
                [pc.add(pc.if_else(had, pc.struct_field(old, f), 0), g[c]).combine_chunks()
                 for f, c in (("n", "v_count"), ("s", "v_sum"))], names=["n", "s"])
            t.append(cpu())
            agg.put_many(g["k"], new)
            t.append(cpu())
            b.snapshot(tmp / f"s{cid}")
            b.close()
            t.append(cpu())
            folded = fold_wal(tmp / f"s{cid}", max_files=WAL_FLUSH_FILES) > 0
            t.append(cpu())
            compacted = compact_snapshot(tmp / f"s{cid}", CompactionPolicy(), folded=folded)
            if compacted is not None:
                shutil.rmtree(tmp / f"s{cid}")
                os.rename(compacted.path, tmp / f"s{cid}")
            t.append(cpu())
            shutil.rmtree(work)
            if cid > 4:
                for name, a, z in zip(("open", "group_by + keys", "multi-get", "compute", "put_many",
                                       "sync phase (flush, links)", "agent: WAL fold", "agent: compaction"), t, t[1:]):
                    times.setdefault(name, []).append((z - a) * 1000)
        keys = pa.array(mine[rng.integers(0, len(mine), n)]).unique()
        reads = {}
        for way in ("multi-get", "sorted multi-get", "single gets"):
            work = tmp / f"r-{len(reads)}"
            (work / "db").mkdir(parents=True)
            for f in (tmp / f"s{batches}").iterdir():
                (shutil.copy if f.name.endswith(".log") else os.link)(f, work / "db" / f.name)
            b = RocksDBStateBackend(work, kg, M, "string", create=False)
            raw = _raw_keys(TypedStates(b, record, 0, 99).value("agg"), keys)
            started = cpu()
            if way == "single gets":
                for k in raw:
                    b.db.get(k)
            else:
                b.db.get(sorted(raw) if way == "sorted multi-get" else raw)
            reads[way] = (cpu() - started) * 1000
            b.close()
        ssts = sum(1 for f in (tmp / f"s{batches}").iterdir() if f.name.endswith(".sst"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [f"one subtask (0 of {P}, {len(mine):,} keys), {n:,} rows a batch, CPU ms, medians of batches 5-{batches}:"]
    lines += [f"  {name:26} {statistics.median(v):6.1f}" for name, v in times.items()]
    lines.append(f"  total {sum(statistics.median(v) for v in times.values()):.1f}; {ssts} SSTs at the end")
    lines.append(f"  the same {len(keys):,} keys read cold: " + ", ".join(f"{w} {ms:.1f}" for w, ms in reads.items()))
    return "\n".join(lines)


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of this machine's Spark processes by kind: the Python workers (and the
    workers they forked), our agents, the executors' and the driver's JVMs."""
    import psutil

    out: dict[str, float] = {}
    for proc in psutil.process_iter():
        try:
            cmd = " ".join(proc.cmdline())
            t = proc.cpu_times()
        except (psutil.Error, OSError):
            continue
        if "sparksteward.agents" in cmd:
            kind = "agents"
        elif "daemon" in cmd and "python" in proc.name():
            kind = "Python workers"
        elif "CoarseGrainedExecutorBackend" in cmd:
            kind = "executor JVMs"
        elif proc.pid == os.getpid() or "java" not in proc.name() or "deploy.worker" in cmd or "deploy.master" in cmd:
            continue
        else:
            kind = "driver JVM"
        out[kind] = out.get(kind, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


def run(root: Path) -> int:
    files = bench_state.write_inputs(root, FILES, KEYS, ROWS, seed=20, every_key_first=False)
    print(f"input: {FILES} files x {ROWS:,} rows over {KEYS:,} keys; {bench_state.MASTER}; P={P}, M={M}")
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(bench_state)   # the workers cannot import it by name
    spark = bench_state.start_session(root, "ceiling")
    rounds: list[dict[str, tuple[float, float]]] = []
    cpu: dict[str, list[dict[str, float]]] = {}
    splits: dict[str, list[tuple[float, ...]]] = {}
    for r in range(max(ROUNDS, 2)):
        indir = root / f"in-{r}"
        indir.mkdir()
        base = time.time() - 3600
        for i, f in enumerate(files):
            bench_state.add_input(f, indir, base + i)
        got = {}
        for engine in (ENGINES if r % 2 else ENGINES[::-1]) if r else ENGINES:
            SPLITS.pop(engine, None)
            before = cpu_by_process()
            ms = run_engine(spark, engine, root / f"round-{r}", indir)
            after = cpu_by_process()
            steady = [ms[i] for i in sorted(ms)[1:]]
            got[engine] = (ROWS * len(steady) / (sum(steady) / 1000), statistics.median(steady))
            if r:
                cpu.setdefault(engine, []).append({k: (after[k] - before.get(k, 0.0)) / len(ms) * 1000 for k in after})
                splits.setdefault(engine, []).extend(SPLITS.get(engine, [])[1:])
            print(f"  round {r}, {engine}: batches {[ms[i] for i in sorted(ms)]} ms", flush=True)
        rounds.append(got)
    spark.stop()
    measured = rounds[1:]
    print()
    print(f"{'engine':12} {'records/s':>10} {'batch p50':>10} {'of stateless':>13}   each round after the first (round 0)")
    for e in ENGINES:
        fractions = [g[e][0] / g["stateless"][0] for g in measured]
        print(f"{e:12} {statistics.median(g[e][0] for g in measured):10,.0f} "
              f"{statistics.median(g[e][1] for g in measured):8.0f}ms {statistics.median(fractions):12.2f}   "
              + " ".join(f"{f:.2f}" for f in fractions) + f" ({rounds[0][e][0] / rounds[0]['stateless'][0]:.2f})")
    print("a batch, medians over the rounds after the first, batches 1.. (ms): the stage and sink | commit wait "
          "(the acks: the async phases still running when the stage ended) | report: slowest sync, slowest async, "
          "completion | the rest of the batch (Spark's own and foreachBatch's; the ceiling has only the stage "
          "and sink)")
    for e, rows in splits.items():
        if not rows:
            continue
        rest = statistics.median(g[e][1] for g in measured) - statistics.median(r[0] + r[1] for r in rows)
        print(f"  {e:12} " + " | ".join(f"{statistics.median(col):7.1f}" for col in zip(*rows)) + f" | {rest:7.1f}")
    print("CPU ms per batch by process (medians over the rounds after the first):")
    for e in ENGINES:
        kinds = sorted({k for c in cpu[e] for k in c})
        print(f"  {e:12} " + ", ".join(f"{k} {statistics.median(c.get(k, 0.0) for c in cpu[e]):,.0f}" for k in kinds))
    if os.environ.get("CEIL_PROFILE") == "1":
        print()
        print(time_state_work())
    return 0


def main() -> int:
    return bench_state.bench_main("bench-ceiling-", run)


if __name__ == "__main__":
    sys.exit(main())
