"""Declared keyed state with TTL: against transformWithStateInPandas with TTL, and bounded by TTL, in one run.

Both scenarios run in one application on ``local-cluster[2,1,1024]`` (two executors of one core; the
session is ``bench_state.start_session``: parallelism / shuffle partitions 8, max parallelism 128).

**1. value + list state with TTL, three engines.** The same input (``BENCH_FILES`` parquet files of
``BENCH_ROWS`` rows ``(k string, v long)`` over ``BENCH_KEYS`` keys, read as a stream with
``maxFilesPerTrigger=1``: one file per batch) and the same logic per key: ``count += rows``, append
every row's ``v`` to a list, output ``(k, n, events)`` with ``events`` the list's length read back
from the state; the sink (``foreachBatch``) appends the output to parquet. Both variables have a TTL
of ``BENCH_TTL_S1`` seconds (default 600: on, but nothing expires during the run, so the engines
must agree) in all three engines:

- ``ours-pandas``: ``ks.process(fn, schema, sink, form="pandas")``, ``fn(key, rows, state)`` with
  ``state.value("count")`` and ``state.list("events")``;
- ``ours-arrow``: ``ks.process(..., form="arrow")``, no Python loop over keys in the function:
  ``value.get_many/put_many``, ``list.append_many/get_many`` and ``pc.list_value_length``;
- ``transformWithStateInPandas`` (``timeMode="ProcessingTime"``) with ``getValueState`` and
  ``getListState`` with ``ttlDurationMs``, on Spark's RocksDB state store with changelog
  checkpointing and ``spark.sql.shuffle.partitions`` = our parallelism. In ProcessingTime mode its
  operator asks for another (no-data) batch after every batch, so ``processAllAvailable`` never
  returns: the bench stops the query once the files are processed and skips the no-data batches.

Reported: records/s over the steady batches (batch 0 excluded: it pays the Python workers' start),
batch p50 (``triggerExecution`` of the query's progress minus the bench's own file scan), checkpoint
bytes per batch (ours: ``bytes_uploaded`` of ``ks.info()["checkpoints"]``; Spark: bytes of the
files newly written under ``<checkpointLocation>/state`` per batch), the ratios, and whether the
final per-key ``(n, events)`` of the three engines are equal (and equal to the input's row counts).
A line per engine splits its steady batch p50: ``foreachBatch`` (ours: the begin and the state
stage, the sink, the commit) and the query's own part.

**2. Bounded state with TTL (ours, Arrow form).** ``BENCH_TTL_BATCHES`` (60) batches, driven by
``ks.apply_arrow(df, fn, schema, checkpoint_id=i)`` + ``ks.commit(i)`` in a loop with the same
function as ``ours-arrow``. Batch ``i`` (from 0) has ``BENCH_TTL_ROWS`` rows whose keys are drawn
from the window ``[i * S, i * S + W)`` with ``S = BENCH_TTL_NEW_KEYS`` (new keys per batch, default
33,000) and ``W = BENCH_TTL_WINDOW`` (default ``2 * S``: a key gets rows in two consecutive
batches). Each batch starts ``BENCH_TTL_PERIOD`` seconds (default 2) after the previous one (the
bench sleeps the remainder; a batch that overruns is reported) and the TTL is 5 periods, so a key
lives for about 5 batches after its last row: about ``W + 4 * S`` keys (~200k) are live at any
time, and ``W + (BATCHES - 1) * S`` (~2M) distinct keys pass through. (With a TTL of 5 batches the
live keys are at least 5 batches' new keys, so "20k live" and "2M in total" cannot both hold over
60 batches: the ratio total / live is about ``BATCHES / 5``; the defaults keep the 2M total; set
``BENCH_TTL_NEW_KEYS=4000`` for ~24k live and ~240k in total, the same ratio.) It runs twice, with
the TTL and without (the same declarations minus ``ttl``). After batches 15, 30, 45 and 60 the
bench hard-links the latest checkpoint's files aside (instant, so that the measurement does not
shift the wall clock the TTL runs on); after the run it restores every subtask of each with
``checkpoint.rescale.restore_subtask_backend`` into a fresh temp dir with a fresh file cache, as a
task does at the start of every batch. Per measured batch, in a table per run:

- ``chk MB``: the checkpoint's bytes (its files' lengths in ``_metadata``); ``max MB``: the largest
  checkpoint of the batches since the previous row. Incremental checkpoints of RocksDB grow as L0
  files pile up and shrink when a compaction merges them (and drops what the TTL sweep deleted), so
  a single batch's checkpoint sits anywhere on that saw-tooth; the window's maximum does not;
- ``DB MB``: the restored DBs (their SSTs, WAL and MANIFEST), and ``compact`` the same after a full
  compaction (the live entries plus expired ones the sweep has not removed yet);
- ``restore s``: the time to restore all subtasks, one after the other (the median of 7 rounds, each
  restoring every set-aside checkpoint in turn, so the load of the machine falls on all alike);
- the DB's entries: values, list elements and expiry-index keys.

Then the ratios batch 60 / batch 15, and over the batches from 15 on: the checkpoints' MB (min,
median, max), the bytes uploaded per batch (p50, mean, max: a compaction uploads a subtask's whole
state at once), the batch p50, and how many subtask checkpoints rewrote all their SSTs (a full
compaction, the executor agent's (decision 0019) or, rarely, one of RocksDB's that finished in the
task). Targets, with TTL: checkpoint bytes, local DB size and restore
time <= 1.3x (the point samples), and the same for the saw-tooth-proof pair (the window's
largest checkpoint, the compacted DB); without TTL the checkpoint and the DB grow.

A single run on a shared 2-core machine: quote the ratios. The defaults take about 7 minutes. Needs
``protobuf`` (6.x) for transformWithStateInPandas. Run under the Spark lock::

    flock /tmp/steward-spark.lock nice -n 5 python benchmarks/bench_state_ttl.py

``BENCH_SCENARIOS=1`` or ``=2`` runs only one scenario.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_state
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from bench_state import MB, M, P, Written, add_input, pct, scan, start_session

KEYS = int(os.environ.get("BENCH_KEYS", "20000"))
ROWS = int(os.environ.get("BENCH_ROWS", "20000"))
FILES = int(os.environ.get("BENCH_FILES", "6"))
TTL_S1 = float(os.environ.get("BENCH_TTL_S1", "600"))
BATCHES = int(os.environ.get("BENCH_TTL_BATCHES", "60"))
NEW_KEYS = int(os.environ.get("BENCH_TTL_NEW_KEYS", "33000"))
WINDOW = int(os.environ.get("BENCH_TTL_WINDOW", str(2 * NEW_KEYS)))
ROWS2 = int(os.environ.get("BENCH_TTL_ROWS", str(WINDOW)))
PERIOD = float(os.environ.get("BENCH_TTL_PERIOD", "2.0"))
TTL_BATCHES = 5
SCENARIOS = os.environ.get("BENCH_SCENARIOS", "12")
#: ``process(persist=...)`` of ours. False (the bench's default): the sink's one write runs the state stage
#: in its job, one job a batch, as Spark runs transformWithStateInPandas; True (``BENCH_PERSIST=1``, the
#: default of ``process``, for sinks with several actions) persists the output first, then the sink reads it
PERSIST = os.environ.get("BENCH_PERSIST", "0") != "0"
MEASURE_AT = [b for b in (BATCHES // 4, BATCHES // 2, 3 * BATCHES // 4, BATCHES) if b > 0]
RESTORE_ROUNDS = 7   # restore time: the median of this many rounds over every set-aside checkpoint in turn
SCHEMA = "k string, n long, events long"
ENGINES = ("ours-pandas", "ours-arrow", "transformWithStateInPandas")


def declarations(ttl: float | None) -> list[dict[str, Any]]:
    from sparksteward import list_state, value_state

    return [value_state("count", "bigint", ttl=ttl), list_state("events", "bigint", ttl=ttl)]


# --- the logic, three ways ---------------------------------------------------------------------


def ours_pandas_fn(key, rows, state):
    count = state.value("count")
    n = (count.get() or 0) + len(rows)
    count.update(n)
    events = state.list("events")
    events.extend(rows["v"].tolist())
    return pd.DataFrame({"k": [key], "n": [n], "events": [len(events.get())]})


def ours_arrow_fn(keys, rows, state):
    g = rows.group_by("k").aggregate([("v", "count")])
    ks = g["k"]
    count = state.value("count")
    n = pc.add(pc.fill_null(count.get_many(ks), 0), g["v_count"])
    count.put_many(ks, n)
    events = state.list("events")
    events.append_many(rows["k"], rows["v"])
    length = pc.list_value_length(events.get_many(ks)).cast(pa.int64())
    return pa.table({"k": ks, "n": n, "events": length})


def tws_processor(ttl_ms: int):
    from pyspark.sql.streaming import StatefulProcessor

    class CountAndList(StatefulProcessor):
        def init(self, handle):
            self.count = handle.getValueState("count", "n long", ttlDurationMs=ttl_ms)
            self.events = handle.getListState("events", "v long", ttlDurationMs=ttl_ms)

        def handleInputRows(self, key, rows, timerValues):
            got = self.count.get()   # None when unset: no second round trip (exists())
            n = got[0] if got is not None else 0
            for pdf in rows:
                n += len(pdf)
                self.events.appendList([(int(v),) for v in pdf["v"]])
            self.count.update((n,))
            length = sum(1 for _ in self.events.get())
            yield pd.DataFrame({"k": [key[0]], "n": [n], "events": [length]})

        def close(self):
            pass

    return CountAndList()


# --- scenario 1 --------------------------------------------------------------------------------


def write_inputs(root: Path) -> tuple[list[Path], dict[str, int]]:
    """``FILES`` parquet files and the rows per key they hold."""
    rng = np.random.default_rng(17)
    names = np.array([f"user-{i:07d}" for i in range(KEYS)], dtype=object)
    staged = root / "inputs"
    staged.mkdir()
    out = []
    per_key = np.zeros(KEYS, dtype=np.int64)
    for i in range(FILES):
        idx = rng.integers(0, KEYS, ROWS)
        if i == 0:
            idx[:min(KEYS, ROWS)] = np.arange(min(KEYS, ROWS))  # every key exists from batch 0 on
        np.add.at(per_key, idx, 1)
        table = pa.table({"k": pa.array(names[idx], pa.string()), "v": pa.array(rng.integers(0, 1000, ROWS))})
        path = staged / f"part-{i:04d}.parquet"
        pq.write_table(table, path)
        out.append(path)
    return out, {names[i]: int(c) for i, c in enumerate(per_key) if c}


class Engine:
    """One streaming query of one engine over the files in ``indir``."""

    def __init__(self, spark: Any, engine: str, root: Path) -> None:
        self.spark = spark
        self.engine = engine
        self.chk = root / "queries" / engine
        self.out = root / "out" / engine
        self.ks = None
        if engine.startswith("ours"):
            from sparksteward import Steward

            self.ks = Steward.get(spark).keyed_state(engine, key="k", parallelism=P, max_parallelism=M,
                                                     checkpoint_dir=str(root / "ours-chk"),
                                                     states=declarations(TTL_S1))
            form = "pandas" if engine == "ours-pandas" else "arrow"
            fn = ours_pandas_fn if form == "pandas" else ours_arrow_fn
            self.run_batch = self.ks.process(fn, SCHEMA, self._write, form=form, persist=PERSIST)
            self.written = Written(root / "ours-chk" / "default" / engine)
            commit = self.ks.commit

            def timed_commit(*args: Any, **kwargs: Any) -> int:   # the commit's share of a batch
                t = time.perf_counter()
                try:
                    return commit(*args, **kwargs)
                finally:
                    self.parts.setdefault(self.batch, {})["commit"] = (time.perf_counter() - t) * 1000

            self.ks.commit = timed_commit  # type: ignore[method-assign]
        else:
            self.written = Written(self.chk / "state")
        self.parts: dict[int, dict[str, float]] = {}   # per batch: foreachBatch, sink and commit ms
        self.batch = -1

    def _write(self, df: Any, batch_id: int) -> None:
        t = time.perf_counter()
        df.write.mode("append").parquet(str(self.out))
        self.parts.setdefault(self.batch, {})["sink"] = (time.perf_counter() - t) * 1000

    def sink(self, df: Any, batch_id: int) -> None:
        if batch_id >= FILES:   # transformWithStateInPandas' no-data batches (see run): nothing to do, stop comes
            return
        self.batch = batch_id
        t = time.perf_counter()
        if self.ks is None:
            self._write(df, batch_id)
        else:
            self.run_batch(df, batch_id)
        self.parts.setdefault(batch_id, {})["foreach"] = (time.perf_counter() - t) * 1000
        self.written.look(batch_id)

    def run(self, indir: Path) -> dict[int, dict[str, float]]:
        src = self.spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
        if self.engine == "transformWithStateInPandas":
            df = src.groupBy("k").transformWithStateInPandas(tws_processor(int(TTL_S1 * 1000)), SCHEMA, "Update",
                                                             "ProcessingTime")
        else:
            df = src
        started = time.perf_counter()
        q = (df.writeStream.foreachBatch(self.sink).option("checkpointLocation", str(self.chk))
             .outputMode("update").start())
        try:
            if self.engine == "transformWithStateInPandas":
                # in ProcessingTime mode the operator asks for another (no-data) batch after every batch, so
                # processAllAvailable never returns: stop once every file was processed
                deadline = time.monotonic() + 1800
                while sum(1 for p in q.recentProgress if p.numInputRows) < FILES:
                    if q.exception() is not None:
                        raise RuntimeError(f"{self.engine}: {q.exception()}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.engine}: {FILES} batches not processed within 30 minutes")
                    time.sleep(0.1)
            else:
                q.processAllAvailable()
        finally:
            q.stop()
        self.wall = time.perf_counter() - started
        batches = {}
        for p in q.recentProgress:
            if p.numInputRows:
                batches[p.batchId] = {"ms": p.durationMs.get("triggerExecution", 0) - self.written.scan_ms.get(
                    p.batchId, 0.0), "rows": p.numInputRows}
        if len(batches) != FILES:
            raise RuntimeError(f"{self.engine}: {len(batches)} batches with input, expected {FILES}")
        return batches

    def bytes_per_batch(self) -> list[int]:
        if self.ks is None:
            return [n for _, (_, n) in sorted(self.written.per_batch.items())]
        return [c["bytes_uploaded"] for c in sorted(self.ks.info()["checkpoints"], key=lambda c: c["checkpoint_id"])]


def final_state(out: Path) -> dict[str, tuple[int, int]]:
    t = pq.read_table(out).group_by("k").aggregate([("n", "max"), ("events", "max")])
    return dict(zip(t.column("k").to_pylist(), zip(t.column("n_max").to_pylist(), t.column("events_max").to_pylist())))


def scenario_engines(spark: Any, root: Path) -> list[tuple[str, bool]]:
    files, per_key = write_inputs(root)
    indir = root / "in"
    indir.mkdir()
    base = time.time() - 3600
    for i, f in enumerate(files):
        add_input(f, indir, base + i)
    print(f"\n== 1. value + list state with TTL ({TTL_S1:g} s in every engine): {FILES} files x {ROWS:,} rows over "
          f"{KEYS:,} string keys, one file per batch; parallelism / shuffle partitions {P}; ours with "
          f"process(persist={PERSIST})", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for engine in ENGINES:
        e = Engine(spark, engine, root)
        b = e.run(indir)
        ids = sorted(b)[1:]   # batch 0 pays the Python workers' start
        rate = sum(b[i]["rows"] for i in ids) / (sum(b[i]["ms"] for i in ids) / 1000)
        per_batch = e.bytes_per_batch()
        steady = [e.parts[i] for i in ids if i in e.parts]
        parts = {k: statistics.median(x.get(k, 0.0) for x in steady) for k in ("foreach", "sink", "commit")}
        parts["trigger"] = statistics.median(b[i]["ms"] for i in ids)
        results[engine] = {"rate": rate, "p50": statistics.median(x["ms"] for x in b.values()), "parts": parts,
                           "p99": pct([x["ms"] for x in b.values()], .99), "bytes": per_batch,
                           "written": [n for _, (_, n) in sorted(e.written.per_batch.items())],
                           "state": final_state(e.out), "wall": e.wall}
        if e.ks is not None:
            removed = sum(c.get("ttl_expired_removed", 0) for c in e.ks.info()["checkpoints"])
            results[engine]["removed"] = removed
        print(f"  {engine}: {len(b)} batches in {e.wall:.1f} s", flush=True)

    print()
    print(f"{'engine':28} {'records/s':>10} {'batch p50':>10} {'p99':>8} {'chk KB/batch':>13}")
    for engine, r in results.items():
        print(f"{engine:28} {r['rate']:10,.0f} {r['p50']:8.0f}ms {r['p99']:6.0f}ms "
              f"{statistics.mean(r['bytes']) / 1024:13.1f}")
    print("  records/s over batches 1..; p50/p99 over all batches; chk KB/batch: ours = bytes_uploaded of the "
          "checkpoint's acks, Spark = bytes newly written under <checkpointLocation>/state")
    for engine, r in results.items():
        print(f"  {engine}: checkpoint KB per batch {[round(n / 1024) for n in r['bytes']]}"
              + (f"; new files under its checkpoint dir, KB {[round(n / 1024) for n in r['written']]}; "
                 f"ttl_expired_removed {r['removed']}" if "removed" in r else ""))
    for engine, r in results.items():
        x = r["parts"]
        rest = x["foreach"] - x["sink"] - x["commit"]
        print(f"  {engine}: steady batch p50 {x['trigger']:.0f} ms = foreachBatch {x['foreach']:.0f} ms ("
              + (f"begin + state stage {rest:.0f}, sink {x['sink']:.0f}, commit {x['commit']:.0f}"
                 if engine.startswith("ours") else "the stateful operator and the sink, one job") +
              f") + the query's own {x['trigger'] - x['foreach']:.0f} ms")
    tws = results["transformWithStateInPandas"]["rate"]
    arrow, pandas_ = results["ours-arrow"], results["ours-pandas"]
    r_arrow, r_pandas = arrow["rate"] / tws, pandas_["rate"] / tws
    r_bytes = statistics.mean(pandas_["bytes"]) / statistics.mean(arrow["bytes"])
    expected = {k: (n, n) for k, n in per_key.items()}
    same = all(r["state"] == expected for r in results.values())
    print(f"ratios: ours-arrow / transformWithStateInPandas {r_arrow:.1f}x, ours-pandas / transformWithStateInPandas "
          f"{r_pandas:.1f}x; checkpoint bytes per batch ours-pandas / ours-arrow {r_bytes:.2f}x")
    print(f"final per-key (count, list length) equal in all three engines and to the input: {same} "
          f"({len(expected):,} keys, {sum(per_key.values()):,} rows)")
    if not same:
        for engine, r in results.items():
            bad = [k for k in expected if r["state"].get(k) != expected[k]]
            print(f"  {engine}: {len(bad)} keys differ, e.g. {[(k, r['state'].get(k), expected[k]) for k in bad[:3]]}")
    return [("ours-arrow / transformWithStateInPandas records/s >= 10x", r_arrow >= 10),
            ("ours-pandas / transformWithStateInPandas records/s >= 4x", r_pandas >= 4),
            ("checkpoint bytes per batch ours-pandas / ours-arrow <= 2x", r_bytes <= 2),
            ("same final (count, list length) per key in all three engines", same)]


# --- scenario 2 --------------------------------------------------------------------------------


def batch_df(spark: Any, i: int) -> Any:
    """Batch ``i``: ``ROWS2`` rows, keys drawn from ``[i * NEW_KEYS, i * NEW_KEYS + WINDOW)``."""
    return spark.range(0, ROWS2, 1, P).selectExpr(
        f"concat('key-', cast({i * NEW_KEYS} + pmod(xxhash64(id, {i}), {WINDOW}) as string)) as k",
        f"id + {i * ROWS2} as v")


def checkpoint_bytes(meta: dict[str, Any]) -> int:
    """The bytes a checkpoint's ``_metadata`` references (its files' lengths)."""
    return sum(f["length"] for s in meta["subtasks"] for f in [*s["files"], *s.get("channel_state", [])])


def set_aside(ks: Any, info: dict[str, Any], side: Path) -> dict[str, Any]:
    """Hard-link the files of the latest checkpoint in ``info`` (``ks.info()``) under ``side`` (laid out
    as the checkpoint root) and return its ``_metadata`` and bytes."""
    meta = info["latest"]
    src = Path(str(info["checkpoint_dir"]).removeprefix("file://")) / info["cluster_id"] / ks.name
    dst = side / info["cluster_id"] / ks.name
    seen: set[str] = set()
    for s in meta["subtasks"]:
        for f in [*s["files"], *s.get("channel_state", [])]:
            if f["path"] in seen:
                continue
            seen.add(f["path"])
            target = dst / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(src / f["path"], target)
    return {"meta": meta, "bytes": checkpoint_bytes(meta), "files": len(seen), "cluster": info["cluster_id"]}


def db_bytes(workdir: Path) -> int:
    """The bytes of a RocksDB's data under ``workdir``: its SSTs, WAL, MANIFEST (not its info LOGs)."""
    return sum(n for p, n in scan(workdir).items()
               if p.endswith((".sst", ".log")) or os.path.basename(p).startswith(("MANIFEST-", "CURRENT")))


def open_aside(side: Path, name: str, aside: dict[str, Any]) -> tuple[Any, Any]:
    """The storage and the metadata of a checkpoint set aside under ``side``."""
    import orjson
    from sparksteward.checkpoint.records import CheckpointMetadata
    from sparksteward.checkpoint.storage import CheckpointStorage

    storage = CheckpointStorage.open(str(side), name, aside["cluster"])
    return storage, CheckpointMetadata.from_bytes(orjson.dumps(aside["meta"]),
                                                  f"checkpoint {aside['meta']['checkpoint_id']}")


def time_restore(side: Path, name: str, aside: dict[str, Any], into: Path) -> float:
    """Seconds to restore every subtask of a set-aside checkpoint, one after the other, into a fresh
    dir ``into`` with a fresh cache (then deleted)."""
    from sparksteward.checkpoint.task.cache import LocalFileCache
    from sparksteward.checkpoint.task.subtask_restore import restore_subtask_backend

    storage, meta = open_aside(side, name, aside)
    cache = LocalFileCache(into / "cache")
    began = time.perf_counter()
    for h in meta.subtasks:
        backend, _ = restore_subtask_backend(storage, meta, h.subtask, into / f"s{h.subtask}", cache)
        backend.close()
    took = time.perf_counter() - began
    shutil.rmtree(into)
    return took


def look_restored(side: Path, name: str, aside: dict[str, Any], into: Path) -> dict[str, int]:
    """Restore every subtask of a set-aside checkpoint once more to look at the DBs: their bytes as
    restored and after a full compaction, and their entries by kind."""
    import rocksdict
    from sparksteward.checkpoint.task.cache import LocalFileCache
    from sparksteward.checkpoint.task.subtask_restore import restore_subtask_backend

    storage, meta = open_aside(side, name, aside)
    cache = LocalFileCache(into / "cache")
    restored = compacted = 0
    kinds = {b"v": 0, b"l": 0, b"x": 0}
    for h in meta.subtasks:
        workdir = into / f"s{h.subtask}"
        backend, _ = restore_subtask_backend(storage, meta, h.subtask, workdir, cache)
        try:
            restored += db_bytes(workdir)
            opts = rocksdict.CompactOptions()
            opts.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
            backend.db.compact_range(None, None, opts)
            for raw, _ in backend.iter_raw():
                kinds[raw[2:3]] = kinds.get(raw[2:3], 0) + 1
        finally:
            backend.close()
        compacted += db_bytes(workdir)
    shutil.rmtree(into)
    return {"db": restored, "compacted": compacted, "values": kinds[b"v"], "elements": kinds[b"l"],
            "index": kinds[b"x"]}


def restore_rounds(side: Path, name: str, aside: dict[int, dict[str, Any]], scratch: Path,
                   rounds: int = RESTORE_ROUNDS) -> dict[int, float]:
    """The restore time of each set-aside checkpoint: ``rounds`` rounds, each restoring every one of
    them in turn (so a change in the machine's load falls on all of them alike), the median per
    checkpoint."""
    times: dict[int, list[float]] = {b: [] for b in aside}
    for r in range(rounds):
        for b, a in aside.items():
            times[b].append(time_restore(side / f"b{b}", name, a, scratch / f"b{b}-r{r}"))
    return {b: statistics.median(t) for b, t in times.items()}


def bounded_run(spark: Any, root: Path, ttl: float | None) -> dict[str, Any]:
    from sparksteward import Steward

    label = "ttl" if ttl else "no-ttl"
    name = f"bounded-{label}"
    ks = Steward.get(spark).keyed_state(name, key="k", parallelism=P, max_parallelism=M,
                                        checkpoint_dir=str(root / "bounded-chk"), states=declarations(ttl))
    side = root / "aside" / label
    aside: dict[int, dict[str, Any]] = {}
    durations: list[float] = []
    sizes: list[int] = []   # per batch, the bytes of its checkpoint
    rewrites: list[int] = []   # per batch, the subtasks whose SSTs are all new (a full compaction ran)
    previous: dict[int, set[str]] = {}
    overruns = 0
    began = time.perf_counter()
    for i in range(BATCHES):
        due = began + i * PERIOD
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        elif i:
            overruns += 1
        t = time.perf_counter()
        out = ks.apply_arrow(batch_df(spark, i), ours_arrow_fn, SCHEMA, checkpoint_id=i)
        out.write.format("noop").mode("overwrite").save()
        ks.commit(i)
        durations.append(time.perf_counter() - t)
        info = ks.info()
        sizes.append(checkpoint_bytes(info["latest"]))
        ssts = {s["subtask"]: {f["checksum"] for f in s["files"] if f["name"].endswith(".sst")}
                for s in info["latest"]["subtasks"]}
        rewrites.append(sum(1 for k, v in ssts.items() if v and previous.get(k) and not v & previous[k]))
        previous = ssts
        if i + 1 in MEASURE_AT:
            aside[i + 1] = set_aside(ks, info, side / f"b{i + 1}")
    wall = time.perf_counter() - began
    stats = sorted(ks.info()["checkpoints"], key=lambda c: c["checkpoint_id"])
    scratch = root / "scratch" / label
    seconds = restore_rounds(side, name, aside, scratch)
    measured = {b: {**look_restored(side / f"b{b}", name, a, scratch / f"b{b}-look"), "seconds": seconds[b],
                    "chk": a["bytes"], "files": a["files"]} for b, a in aside.items()}
    shutil.rmtree(scratch, ignore_errors=True)
    return {"label": label, "durations": durations, "overruns": overruns, "wall": wall, "measured": measured,
            "removed": sum(c.get("ttl_expired_removed", 0) for c in stats), "sizes": sizes, "rewrites": rewrites,
            "uploaded": [c["bytes_uploaded"] for c in stats]}


def scenario_bounded(spark: Any, root: Path) -> list[tuple[str, bool]]:
    ttl = TTL_BATCHES * PERIOD
    total = WINDOW + (BATCHES - 1) * NEW_KEYS
    live = WINDOW + (TTL_BATCHES - 1) * NEW_KEYS
    print(f"\n== 2. bounded state (ours-arrow): {BATCHES} batches, one every {PERIOD:g} s, of {ROWS2:,} rows with keys "
          f"drawn from a window of {WINDOW:,} keys that slides by {NEW_KEYS:,} per batch: ~{live:,} keys live with a "
          f"TTL of {TTL_BATCHES} batches ({ttl:g} s), {total:,} distinct keys in all", flush=True)
    runs = []
    for t in (ttl, None):
        r = bounded_run(spark, root, t)
        runs.append(r)
        d = r["durations"]
        print(f"  {r['label']}: {BATCHES} batches in {r['wall']:.1f} s, batch p50 {statistics.median(d):.2f} s, "
              f"max {max(d):.2f} s, {r['overruns']} overran the period; ttl_expired_removed {r['removed']:,}",
              flush=True)
    checks = []
    for r in runs:
        m = r["measured"]
        sizes = r["sizes"]
        for b, x in m.items():   # the largest checkpoint of the window of batches that ends at b
            x["chk_max"] = max(sizes[max(0, b - min(m)):b])
        print()
        print(f"{r['label']:8} {'batch':>6} {'chk MB':>8} {'max MB':>8} {'files':>6} {'DB MB':>8} {'compact':>8} "
              f"{'restore s':>10} {'values':>10} {'list elems':>11} {'index keys':>11}")
        for b, x in sorted(m.items()):
            print(f"{'':8} {b:6} {x['chk'] / MB:8.2f} {x['chk_max'] / MB:8.2f} {x['files']:6} {x['db'] / MB:8.2f} "
                  f"{x['compacted'] / MB:8.2f} {x['seconds']:10.3f} {x['values']:10,} {x['elements']:11,} "
                  f"{x['index']:11,}")
        first, last = m[min(m)], m[max(m)]
        ratios = {k: last[k] / first[k] for k in ("chk", "chk_max", "db", "compacted", "seconds")}
        print(f"{'':8} batch {max(m)} / batch {min(m)}: checkpoint bytes {ratios['chk']:.2f}x (max of the "
              f"window {ratios['chk_max']:.2f}x), local DB as restored {ratios['db']:.2f}x (compacted "
              f"{ratios['compacted']:.2f}x), restore time {ratios['seconds']:.2f}x")
        later = [n / MB for n in sizes[min(m) - 1:]]
        up = r["uploaded"][min(m) - 1:]
        print(f"{'':8} checkpoint MB of every batch from {min(m)} on: min {min(later):.2f}, median "
              f"{statistics.median(later):.2f}, max {max(later):.2f}; uploaded per batch p50 "
              f"{statistics.median(up) / MB:.2f} MB, mean {statistics.mean(up) / MB:.2f} MB, max {max(up) / MB:.2f} "
              f"MB; batch p50 {statistics.median(r['durations'][min(m) - 1:]):.2f} s; subtask checkpoints that "
              f"rewrote all their SSTs {sum(r['rewrites'][min(m) - 1:])} of {P * len(later)}")
        if r["label"] == "ttl":
            checks.append((f"with TTL, batch {max(m)} / batch {min(m)} <= 1.3x: checkpoint bytes, local DB size and "
                           f"restore time", all(ratios[k] <= 1.3 for k in ("chk", "db", "seconds"))))
            checks.append((f"with TTL, batch {max(m)} / batch {min(m)} <= 1.3x: largest checkpoint of the last "
                           f"{min(m)} batches, compacted local DB", ratios["chk_max"] <= 1.3
                           and ratios["compacted"] <= 1.3))
        else:
            checks.append((f"without TTL, checkpoint bytes and local DB grow (batch {max(m)} / batch {min(m)} > 1.3x)",
                           ratios["chk"] > 1.3 and ratios["db"] > 1.3))
    print("  chk MB: the checkpoint of that batch (its files' lengths); max MB: the largest checkpoint of the "
          "batches since the previous row; DB MB: the restored DBs' SSTs, WAL and MANIFEST; compact: the same after a full "
          "compaction; restore: every subtask into a fresh dir and cache, median of 7 interleaved rounds; entries: after the compaction "
          "(expired entries the sweep has not removed yet included)")
    return checks


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    return bench_state.bench_main("bench-state-ttl-", run)


def run(root: Path) -> int:
    if "1" in SCENARIOS and not bench_state.has_protobuf():
        return 2
    t_all = time.perf_counter()
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(bench_state)  # the workers cannot import it: ship its functions
    if __name__ != "__main__":   # imported (a driver script of its own): ship this module's functions too
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark = start_session(root, "ttl")
    checks: list[tuple[str, bool]] = []
    try:
        if "1" in SCENARIOS:
            checks += scenario_engines(spark, root)
        if "2" in SCENARIOS:
            checks += scenario_bounded(spark, root)
    finally:
        spark.stop()
    print()
    for what, ok in checks:
        print(f"TARGET {'PASS' if ok else 'FAIL'}: {what}")
    print(f"bench took {time.perf_counter() - t_all:.0f} s ({bench_state.MASTER})")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
