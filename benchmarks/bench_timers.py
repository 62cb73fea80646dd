"""Keyed state with event-time timers against ``transformWithStateInPandas`` with ``timeMode="EventTime"``
(issue 38, must-show 4), the same processor on the same stream, in one run.

**The workload**, the same in every engine: input rows ``(k string, ts timestamp, v long)``; per key a
value state ``(n bigint, last_ms bigint)``, the key's row count and largest event time. On each batch's
rows of a key the state is updated and the key's event-time timer moved to ``last_ms + GAP`` (the old
one deleted), so that a key that stops getting rows fires once the watermark passes it; on the timer
the key emits ``(k, n, fired_at)`` and its state is cleared. Event time is ``ts`` with a watermark delay
of 5 s (Spark: ``withWatermark("ts", "5 seconds")``); each batch runs with the watermark the batches
before it set, in both.

The input: parquet files read as a stream with ``maxFilesPerTrigger=1`` (one file a batch). File ``i``
has ``BENCH_ROWS`` rows whose keys are drawn from a window of ``BENCH_KEYS`` keys (by default as many as
``BENCH_ROWS``, so a key gets about one row a file at any batch size) that slides by ``BENCH_SLIDE``
keys a file (``KEYS / 4``), so a key gets rows in about ``KEYS / SLIDE`` files, then goes quiet and
fires two or three batches later; keys that miss a file or two by chance fire early and start over.
File ``i``'s event times span ``[i * 10 s - 2 s, (i + 1) * 10 s)``: out of order within a file and
by up to 2 s across files, but never late (the watermark trails the largest event time by 5 s).

Engines, each a streaming query whose ``foreachBatch`` appends its output (with the batch id) to parquet:

- ``stateless``: the ceiling, part 1 only. The same stream, routing as our state's (each key's subtask,
  ``repartitionById`` into 8 partitions, as ``bench_state.stateless_write``) and sink, then ``mapInArrow``
  computing per key of the batch alone its row count and largest event time + ``GAP`` as
  ``(k, n, fired_at)`` (the group-by ours-arrow runs, without state or timers: ``stateless_fn``, adapted
  from ``bench_state``'s to this output). What Spark, the shuffle, Arrow and the sink cost at this batch
  size: no stateful engine can beat it, so a target above it cannot be met at this size. Its output is
  not a correctness peer and is not checked;
- ``ours-arrow``: ``ks.process(fn, schema, sink, form="arrow", on_timer=...)`` on
  ``keyed_state(..., event_time="ts", watermark_delay=5, states=[value_state("s", "n bigint, last_ms bigint")])``:
  ``fn(keys, rows, state)`` with ``get_many``/``put_many`` and ``state.timers.delete/register(keys,
  at_array, time="event")``; ``on_timer(keys, expired, state)`` once per subtask;
- ``ours-pandas``: the per-key form of the same (``state.value("s").get()/update()``,
  ``state.timers.delete/register(at, time="event")``, ``on_timer(key, timers, state)``);
- ``transformWithStateInPandas``: a ``StatefulProcessor`` with a ``ValueState``, ``registerTimer`` and
  ``deleteTimer`` in ``handleInputRows``, ``handleExpiredTimer`` emitting and clearing; ``timeMode="EventTime"``,
  output mode Update, on Spark's RocksDB state store with changelog checkpointing and
  ``spark.sql.shuffle.partitions`` = our parallelism (8) (``bench_state.start_session``);
- PyFlink (a ``KeyedProcessFunction`` on ``EmbeddedRocksDBStateBackend``, the same rows from a
  collection, bounded out-of-orderness 5 s) where ``import pyflink`` works; it is skipped with a note
  otherwise. Its records/s is over the whole job (its start included), and its watermark advances
  every 200 ms of processing, not per file, so only the sum of its emitted ``n`` is checked (every row
  is counted once by the time all timers fired). This engine has not been run: apache-flink was not
  installed where the bench was written.

**When a timer fires.** Ours fires an event-time timer once the watermark is at or past it, and so
does Spark 4.3 (``TimerStateImpl.getExpiredTimers`` returns the timers at or before the watermark it is
given, the bytecode shows). The bench does not depend on it: the event times are
even milliseconds, so every watermark (the largest event time minus 5,000 ms) is even, and ``GAP`` is
odd (10,001 ms), so no timer ever equals a watermark. When its input stops, Spark runs a no-data batch
(the watermark moved), which fires the timers the last file's watermark made due *before* the next
file's rows arrive; ours runs no batch without input, and in the next batch the rows come first and
re-arm those keys' timers, so the outputs would differ (a key fired and started again against one
longer run). So after every query of ours stops, the bench runs ``ks.drain(timers=True)``, an empty
batch that fires what is due, as Spark's no-data batch does; neither is measured (nor is each round's
first batch). After the measured rounds two drain files (one row each, far ahead in event time) fire
every timer left but theirs. Then the multisets of emitted ``(k, n, fired_at)`` must be equal across
the stateful engines and equal to a reference computed in plain Python from the files, with the stream's stops.

**1. Records/s.** Every engine processes ``BENCH_WARM_FILES`` files first (unmeasured, the warm pass of
``bench_state.py``), then ``BENCH_ROUNDS`` rounds each add ``BENCH_FILES`` files that every engine's
query, restarted, processes, the engines' order reversed every other round (the ceiling's too). Records/s
over the steady batches (each round's first excluded), from ``triggerExecution`` of the query's progress;
the ratios ours / transformWithStateInPandas come from each round (its engines ran minutes apart at most),
their median is the result; so do ours / stateless and stateless / transformWithStateInPandas, the latter
telling whether 10x transformWithStateInPandas is above what a pipeline without state reaches at this
batch size (the ``CEILING`` line).

**2. Firing ``BENCH_FIRE_KEYS`` (100,000) due timers in one batch.** A fresh state per stateful engine and round:
file 1 gives each of the keys one row (one event-time timer each), file 2 one row far ahead in event
time (it moves the watermark, which batch 3 runs with), file 3 one row more: batch 3 fires every
timer. Its ``triggerExecution`` is the time to fire; the fired rows are counted from the output.

Sizes: ``BENCH_KEYS``, ``BENCH_SLIDE``, ``BENCH_ROWS``, ``BENCH_FILES``, ``BENCH_ROUNDS``,
``BENCH_WARM_FILES``, ``BENCH_FIRE_KEYS``, ``BENCH_FIRE_ROUNDS``. Spark's fixed per-batch cost dominates
batches of 10,000 rows (ours-arrow's p50 965 ms, records/s 6.2x transformWithStateInPandas's), so raise
``BENCH_ROWS`` (the key window follows it) to see the engines' own costs: ``BENCH_ROWS=40000`` (its part 1
took 4 minutes, ``BENCH_SMALL=1 BENCH_ROWS=40000``; with part 2's 100,000 timers expect 7-9). The
defaults should take about 6-8 minutes (estimated from the small mode's rates, not run:
transformWithStateInPandas registered and fired about 800-1,100 timers/s there, so part 2 alone takes it
3-4 minutes at 100,000 timers).
``BENCH_SMALL=1`` gives sizes for a try-out (2-3.5 minutes on a 2-core machine; 5,000 timers fired), at
which fixed per-batch costs dominate, so its ratios say nothing about the targets. Needs
``protobuf`` (6.x) for transformWithStateInPandas. A single run on a shared 2-core machine: quote the
ratios. Run under the Spark lock::

    flock /tmp/steward-spark.lock .venv/bin/python benchmarks/bench_timers.py
    BENCH_ROWS=40000 flock /tmp/steward-spark.lock .venv/bin/python benchmarks/bench_timers.py
    BENCH_SMALL=1 flock /tmp/steward-spark.lock .venv/bin/python benchmarks/bench_timers.py

The process exits 0 once it ran, whether the targets passed or not.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_state  # noqa: E402 - the shared session setup, input staging and measurement
from bench_state import M, P, add_input, measured, start_session  # noqa: E402

SMALL = os.environ.get("BENCH_SMALL", "0") not in ("", "0")


def _size(name: str, full: int, small: int) -> int:
    return int(os.environ.get(name, str(small if SMALL else full)))


ROWS = _size("BENCH_ROWS", 10_000, 2_000)       # rows a file (a batch)
KEYS = _size("BENCH_KEYS", ROWS, ROWS)          # the window of keys a file draws from: scales with ROWS
SLIDE = _size("BENCH_SLIDE", KEYS // 4, KEYS // 4)   # how far the window moves a file
FILES = _size("BENCH_FILES", 3, 3)               # files (batches) each engine processes a round
ROUNDS = _size("BENCH_ROUNDS", 2, 2)
WARM = _size("BENCH_WARM_FILES", 1, 1)
FIRE_KEYS = _size("BENCH_FIRE_KEYS", 100_000, 5_000)
FIRE_ROUNDS = _size("BENCH_FIRE_ROUNDS", 1, 1)
T0 = 1_800_000_000_000   # the first file's event time (epoch ms; even)
SPAN_MS = 10_000         # event time a file covers
SKEW_MS = 2_000          # how far a file's rows reach back into the previous file's span
DELAY_S = 5              # the watermark delay
GAP_MS = 10_001          # a quiet key fires at its last event + GAP; odd, so never equal to a watermark
FAR_MS = T0 + 10 ** 9    # the drain rows' event time: past every timer of the run
STATELESS = "stateless"   # the ceiling: part 1 only, no state, no timers, not checked against the reference
TWS = "transformWithStateInPandas"
STATEFUL = ("ours-arrow", "ours-pandas", TWS)   # the engines whose outputs must be equal; part 2's engines
ENGINES = (STATELESS, *STATEFUL)                # part 1's, in round 0's order
INPUT = "k string, ts timestamp, v long"
OUT = "k string, n long, fired_at long"
STATE = "n bigint, last_ms bigint"
DRAIN = "zz-drain"   # the drain rows' key prefix: their timers never fire

# --- the processor, three ways ------------------------------------------------------------------


def _ms(ts: Any) -> pa.Array:
    """A timestamp array as int64 epoch ms."""
    ts = ts.combine_chunks() if isinstance(ts, pa.ChunkedArray) else ts
    return ts.cast(pa.timestamp("ms", ts.type.tz)).cast(pa.int64())


def ours_arrow_fn(keys, rows, state):
    g = rows.group_by("k").aggregate([("v", "count"), ("ts", "max")]).combine_chunks()
    ks = g.column("k").combine_chunks()
    s = state.value("s")
    old = s.get_many(ks)   # a struct array, null where the key is new
    old_last = pc.struct_field(old, "last_ms")
    last = pc.max_element_wise(old_last, _ms(g.column("ts_max")))
    n = pc.add(pc.fill_null(pc.struct_field(old, "n"), 0), g.column("v_count").combine_chunks())
    s.put_many(ks, pa.table({"n": n, "last_ms": last}))
    moved = pc.fill_null(pc.not_equal(old_last, last), True)   # new keys, and keys whose last event moved
    stale = pc.and_(moved, pc.is_valid(old_last))
    state.timers.delete(ks.filter(stale), pc.add(old_last.filter(stale), GAP_MS), time="event")
    state.timers.register(ks.filter(moved), pc.add(last.filter(moved), GAP_MS), time="event")
    # no output: a key emits when it fires


def ours_arrow_on_timer(keys, expired, state):
    k = expired.column("key")
    s = state.value("s")
    n = pc.struct_field(s.get_many(k), "n")
    s.clear_many(k)
    return pa.table({"k": k, "n": n, "fired_at": expired.column("at")})


def ours_pandas_fn(key, rows, state):
    s = state.value("s")
    old = s.get()   # a dict, None when the key is new
    top = int(rows["ts"].max().value // 1_000_000)
    last = top if old is None else max(old["last_ms"], top)
    s.update((len(rows) + (0 if old is None else old["n"]), last))
    if old is None or last != old["last_ms"]:
        if old is not None:
            state.timers.delete(old["last_ms"] + GAP_MS, time="event")
        state.timers.register(last + GAP_MS, time="event")
    # no output: a key emits when it fires


def ours_pandas_on_timer(key, timers, state):
    s = state.value("s")
    n = s.get()["n"]
    s.clear()
    return key, n, timers[0].at


def tws_processor():
    from pyspark.sql.streaming import StatefulProcessor

    class QuietKeys(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.s = handle.getValueState("s", "n long, last_ms long")

        def handleInputRows(self, key, rows, timerValues):
            got = self.s.get()   # None when unset: no second round trip (exists())
            n, last = got if got is not None else (0, None)
            top = last
            for pdf in rows:   # ts: naive UTC (the session's time zone is UTC)
                n += len(pdf)
                ms = int(pdf["ts"].max().value // 1_000_000)
                top = ms if top is None else max(top, ms)
            if top != last:
                if last is not None:
                    self.handle.deleteTimer(last + GAP_MS)
                self.handle.registerTimer(top + GAP_MS)
            self.s.update((n, top))
            return iter(())

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
            n, _ = self.s.get()
            self.s.clear()
            yield pd.DataFrame({"k": [key[0]], "n": [n], "fired_at": [expiredTimerInfo.getExpiryTimeInMs()]})

        def close(self):
            pass

    return QuietKeys()


def stateless_fn(batches):
    """The ceiling's per-subtask work (``bench_state.stateless_fn`` with this bench's output columns): per
    key of the batch alone its row count as ``n`` and its largest event time + ``GAP_MS`` (the timer
    ours-arrow would set) as ``fired_at``, in pyarrow; nothing kept, no timers."""
    for b in batches:
        g = pa.Table.from_batches([b]).group_by("k").aggregate([("v", "count"), ("ts", "max")])
        yield from pa.table({"k": g.column("k"), "n": g.column("v_count"),
                             "fired_at": pc.add(_ms(g.column("ts_max")), GAP_MS)}).to_batches()


def stateless_out(df: Any) -> Any:
    """``bench_state.stateless_write``'s routing (our state's: each key's subtask, ``repartitionById`` into
    ``P`` partitions) then :func:`stateless_fn`: the batch's output, lazy (the sink writes it)."""
    from pyspark.sql import functions as F
    from sparksteward.routing import subtask_sql

    route = "__steward_subtask"
    return (df.withColumn(route, F.expr(subtask_sql("k", P, M))).repartitionById(P, route)
            .mapInArrow(stateless_fn, OUT))


# --- input ---------------------------------------------------------------------------------------


def _table(keys: Any, ms: Any, v: Any) -> pa.Table:
    return pa.table({"k": pa.array(keys, pa.string()), "ts": pa.array(ms, pa.int64()).cast(pa.timestamp("ms", "UTC")),
                     "v": pa.array(v, pa.int64())})


def write_inputs(root: Path) -> tuple[list[Path], list[pa.Table]]:
    """The warm-up and measured files, then the two drain files: their paths and tables."""
    rng = np.random.default_rng(38)
    n = WARM + ROUNDS * FILES
    names = np.array([f"user-{i:07d}" for i in range(KEYS + SLIDE * n)], dtype=object)
    staged = root / "inputs"
    staged.mkdir()
    tables = []
    for i in range(n):
        idx = i * SLIDE + rng.integers(0, KEYS, ROWS)
        lo, hi = T0 + i * SPAN_MS - SKEW_MS, T0 + (i + 1) * SPAN_MS
        ms = 2 * rng.integers(lo // 2, hi // 2, ROWS)   # even milliseconds
        tables.append(_table(names[idx], ms, rng.integers(0, 1000, ROWS)))
    tables += [_table([f"{DRAIN}-{j}"], [FAR_MS], [0]) for j in range(2)]
    top = None
    for t in tables:   # no row is ever late: the bench compares engines, not late-row policies
        ms = _ms(t.column("ts"))
        if top is not None:
            assert pc.min(ms).as_py() > top - DELAY_S * 1000, "a late row in the input"
        top = max(top or 0, pc.max(ms).as_py())
    paths = []
    for i, t in enumerate(tables):
        paths.append(staged / f"part-{i:04d}.parquet")
        pq.write_table(t, paths[-1])
    return paths, tables


def expected(tables: list[pa.Table], stops: set[int]) -> Counter:
    """The ``(k, n, fired_at)`` rows the workload emits over ``tables``, one batch each, the stream
    stopping after the tables of the indexes ``stops`` (there a batch without input fires what the
    watermark allows: Spark's no-data batch, our drain): the reference."""
    state: dict[str, list[int]] = {}
    out: Counter = Counter()
    watermark = None

    def fire() -> None:
        for k in [k for k, (_, last) in state.items() if watermark is not None and last + GAP_MS <= watermark]:
            c, last = state.pop(k)
            out[(k, c, last + GAP_MS)] += 1

    for i, t in enumerate(tables):
        g = t.group_by("k").aggregate([("v", "count"), ("ts", "max")])
        for k, c, top in zip(g.column("k").to_pylist(), g.column("v_count").to_pylist(),
                             _ms(g.column("ts_max")).to_pylist()):
            s = state.setdefault(k, [0, top])
            s[0] += c
            s[1] = max(s[1], top)
        fire()   # after the input, at the watermark the batches before set
        top = pc.max(_ms(t.column("ts"))).as_py() - DELAY_S * 1000
        watermark = top if watermark is None else max(watermark, top)
        if i in stops:
            fire()
    return out


def write_fire_inputs(root: Path, r: int) -> Path:
    """Part 2's three files for round ``r`` in their own input dir."""
    rng = np.random.default_rng(100 + r)
    indir = root / f"fire-in-{r}"
    indir.mkdir()
    staged = root / f"fire-staged-{r}"
    staged.mkdir()
    far = T0 + 3_600_000
    ms = 2 * rng.integers(T0 // 2, (T0 + 5000) // 2, FIRE_KEYS)   # even, as in part 1
    tables = [_table([f"fire-{i:07d}" for i in range(FIRE_KEYS)], ms, np.ones(FIRE_KEYS, dtype=np.int64)),
              _table(["fire-watermark-a"], [far], [0]), _table(["fire-watermark-b"], [far], [0])]
    base = time.time() - 3600
    for i, t in enumerate(tables):
        path = staged / f"part-{i}.parquet"
        pq.write_table(t, path)
        add_input(path, indir, base + i)
    return indir


# --- Spark ---------------------------------------------------------------------------------------


class Engine:
    """One streaming query of one engine over the files present in an input dir (``bench_state.Run``'s
    pattern); ``part`` names its state, checkpoint and output."""

    def __init__(self, spark: Any, engine: str, root: Path, part: str) -> None:
        self.spark = spark
        self.engine = engine
        self.chk = root / "queries" / part / engine
        self.out = root / "out" / part / engine
        self.run_batch = None
        self.ks = None
        self.batch_id = -1   # Spark's id of the batch being written; -1: our drain's
        if engine.startswith("ours"):
            from sparksteward import Steward, value_state

            self.ks = Steward.get(spark).keyed_state(f"{part}-{engine}", key="k", parallelism=P, max_parallelism=M,
                                                     checkpoint_dir=str(root / "ours-chk"), event_time="ts",
                                                     watermark_delay=DELAY_S, states=[value_state("s", STATE)])
            arrow = engine == "ours-arrow"
            self.run_batch = self.ks.process(ours_arrow_fn if arrow else ours_pandas_fn, OUT, self.write,
                                             form="arrow" if arrow else "pandas",
                                             on_timer=ours_arrow_on_timer if arrow else ours_pandas_on_timer)

    def write(self, out: Any, checkpoint_id: int) -> None:
        from pyspark.sql import functions as F

        out.withColumn("batch", F.lit(self.batch_id)).write.mode("append").parquet(str(self.out))

    def sink(self, df: Any, batch_id: int) -> None:
        self.batch_id = batch_id
        try:
            if self.engine == STATELESS:
                self.write(stateless_out(df), batch_id)
            elif self.run_batch is None:
                self.write(df, batch_id)
            else:
                self.run_batch(df, batch_id)
        finally:
            self.batch_id = -1

    def run(self, indir: Path, drain: bool = False) -> dict[int, dict[str, float]]:
        """Process every file in ``indir`` not yet processed; per batch with input: ms and rows. ``drain``:
        then ours fires the timers due at the watermark the last file set, as Spark's no-data batch does
        (``ks.drain(timers=True)``, an empty batch; not measured, as Spark's no-data batches are not)."""
        src = self.spark.readStream.schema(INPUT).option("maxFilesPerTrigger", 1).parquet(str(indir))
        if self.engine == TWS:
            df = (src.withWatermark("ts", f"{DELAY_S} seconds").groupBy("k")
                  .transformWithStateInPandas(tws_processor(), OUT, "Update", "EventTime"))
        else:
            df = src
        started = time.perf_counter()
        q = (df.writeStream.foreachBatch(self.sink).option("checkpointLocation", str(self.chk))
             .outputMode("update").start())
        try:
            q.processAllAvailable()   # with event time Spark's no-data batch (the watermark moved) included
        finally:
            q.stop()
        self.wall = time.perf_counter() - started
        if drain and self.ks is not None:
            self.ks.drain(timers=True)
        return {p.batchId: {"ms": p.durationMs.get("triggerExecution", 0), "rows": p.numInputRows, "scan_ms": 0.0}
                for p in q.recentProgress if p.numInputRows}

    def emitted(self) -> pa.Table:
        if self.out.exists():
            return pq.read_table(self.out)
        return pa.table({"k": [], "n": [], "fired_at": [], "batch": []})


def emitted_rows(t: pa.Table) -> Counter:
    return Counter(zip(t.column("k").to_pylist(), t.column("n").to_pylist(), t.column("fired_at").to_pylist()))


def fire_round(spark: Any, root: Path, r: int, order: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Part 2, round ``r``: per engine, the firing batch's ms, the timers it fired, the registering batch's ms."""
    indir = write_fire_inputs(root, r)
    got = {}
    for engine in order:
        e = Engine(spark, engine, root, f"fire{r}")
        b = e.run(indir)
        ids = sorted(b)
        if len(ids) != 3:
            raise RuntimeError(f"{engine}: {len(ids)} batches with input in the firing part, expected 3")
        out = e.emitted()
        fired = out.column("batch").to_pylist().count(ids[-1])
        got[engine] = {"ms": b[ids[-1]]["ms"], "fired": fired, "others": out.num_rows - fired,
                       "register_ms": b[ids[0]]["ms"]}
        print(f"  firing round {r}, {engine}: {fired:,} timers fired in {b[ids[-1]]['ms'] / 1000:.2f} s "
              f"(registering them: {b[ids[0]]['ms'] / 1000:.2f} s)", flush=True)
    return got


# --- PyFlink -------------------------------------------------------------------------------------


def run_pyflink(tables: list[pa.Table]) -> dict[str, Any] | None:
    """The same processor as a PyFlink ``KeyedProcessFunction`` on RocksDB over the same rows (see the
    module docstring); None, with a note, where PyFlink is not installed."""
    try:
        import pyflink  # noqa: F401
    except ImportError:
        print("PyFlink: skipped (apache-flink is not installed here)")
        return None
    from pyflink.common import Duration, Row, Types, WatermarkStrategy
    from pyflink.common.watermark_strategy import TimestampAssigner
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.functions import KeyedProcessFunction
    from pyflink.datastream.state import ValueStateDescriptor
    from pyflink.datastream.state_backend import EmbeddedRocksDBStateBackend

    class EventTime(TimestampAssigner):
        def extract_timestamp(self, value, record_timestamp):
            return value[1]

    class QuietKeys(KeyedProcessFunction):
        def open(self, runtime_context):
            self.s = runtime_context.get_state(ValueStateDescriptor("s", Types.TUPLE([Types.LONG(), Types.LONG()])))

        def process_element(self, value, ctx):
            got = self.s.value()
            n, last = got if got is not None else (0, None)
            top = value[1] if last is None else max(last, value[1])
            if top != last:
                if last is not None:
                    ctx.timer_service().delete_event_time_timer(last + GAP_MS)
                ctx.timer_service().register_event_time_timer(top + GAP_MS)
            self.s.update((n + 1, top))
            yield from ()

        def on_timer(self, timestamp, ctx):
            n, _ = self.s.value()
            self.s.clear()
            yield Row(ctx.get_current_key(), n, timestamp)

    rows = [r for t in tables for r in zip(t.column("k").to_pylist(), _ms(t.column("ts")).to_pylist(),
                                           t.column("v").to_pylist())]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(P)
    env.set_state_backend(EmbeddedRocksDBStateBackend(True))
    env.enable_checkpointing(1000)
    strategy = (WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_seconds(DELAY_S))
                .with_timestamp_assigner(EventTime()))
    out = (env.from_collection(rows, type_info=Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()]))
           .assign_timestamps_and_watermarks(strategy)
           .key_by(lambda r: r[0], key_type=Types.STRING())
           .process(QuietKeys(), output_type=Types.ROW([Types.STRING(), Types.LONG(), Types.LONG()])))
    began = time.perf_counter()
    with out.execute_and_collect() as results:
        fired = [(r[0], r[1], r[2]) for r in results]
    secs = time.perf_counter() - began
    return {"rate": len(rows) / secs, "secs": secs, "fired": Counter(fired)}


# --- main ----------------------------------------------------------------------------------------


def run(root: Path) -> int:
    if not bench_state.has_protobuf():
        return 2
    t_all = time.perf_counter()
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(bench_state)   # the workers cannot import it by name
    if __name__ != "__main__":   # imported by another driver script: ship this module's functions too
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    files, tables = write_inputs(root)
    want = expected(tables, {WARM - 1, *(WARM + (r + 1) * FILES - 1 for r in range(ROUNDS)), len(tables) - 1})
    indir = root / "in"
    indir.mkdir()
    base = time.time() - 3600
    for i in range(WARM):
        add_input(files[i], indir, base + i)
    window = ("BENCH_KEYS, set" if "BENCH_KEYS" in os.environ else "= BENCH_ROWS, scaled with it")
    print(f"input: {WARM} warm-up + {ROUNDS} rounds x {FILES} measured files + 2 drain files, {ROWS:,} rows a file "
          f"from a window of {KEYS:,} keys ({window}; on average {ROWS / KEYS:.2g} row(s) a key a file) sliding by "
          f"{SLIDE:,} a file ({KEYS + SLIDE * (WARM + ROUNDS * FILES):,} keys in all), {SPAN_MS // 1000} s of event "
          "time a file; "
          f"watermark delay {DELAY_S} s, timer at last event + {GAP_MS} ms; firing part: {FIRE_KEYS:,} timers x "
          f"{FIRE_ROUNDS} round(s); {bench_state.MASTER}; parallelism / shuffle partitions {P}"
          + (" (BENCH_SMALL)" if SMALL else ""), flush=True)

    spark = start_session(root, "timers")
    spark.conf.set("spark.sql.session.timeZone", "UTC")   # transformWithStateInPandas' pandas timestamps: UTC
    try:
        for engine in ENGINES:   # every engine's own warm pass first (bench_state's docstring)
            Engine(spark, engine, root, "steady").run(indir, drain=True)
        print(f"  warm pass ({WARM} file(s) an engine) done", flush=True)
        per_round: dict[str, list[dict[int, dict[str, float]]]] = {e: [] for e in ENGINES}
        added = WARM
        for rnd in range(ROUNDS):
            for i in range(added, added + FILES):
                add_input(files[i], indir, base + i)
            added += FILES
            for engine in ENGINES if rnd % 2 == 0 else ENGINES[::-1]:
                e = Engine(spark, engine, root, "steady")
                b = e.run(indir, drain=True)
                per_round[engine].append(b)
                print(f"  round {rnd}, {engine}: {len(b)} batches in {e.wall:.1f} s", flush=True)
        for i in range(added, len(files)):   # the drain: every timer left fires
            add_input(files[i], indir, base + i)
        outputs = {}
        for engine in STATEFUL:   # the ceiling has nothing to fire
            e = Engine(spark, engine, root, "steady")
            e.run(indir, drain=True)
            outputs[engine] = e.emitted()
        fire: dict[str, list[dict[str, float]]] = {e: [] for e in STATEFUL}
        for r in range(FIRE_ROUNDS):
            for engine, got in fire_round(spark, root, r, STATEFUL if r % 2 == 0 else STATEFUL[::-1]).items():
                fire[engine].append(got)
    finally:
        spark.stop()
    try:
        flink = run_pyflink(tables)
    except Exception as exc:  # noqa: BLE001 - an optional engine, never run where this was written
        print(f"PyFlink failed, left out: {exc!r}")
        flink = None

    # --- report ---
    emitted = {e: emitted_rows(t) for e, t in outputs.items()}
    measured_ids = {e: {i for b in per_round[e] for i in sorted(b)[1:]} for e in STATEFUL}
    print()
    print(f"{'engine':28} {'records/s':>10} {'batch p50':>10} {'max':>8} {'first':>8} {'timers fired':>13} "
          f"{'in steady batches':>18}")
    rate = {}
    for e in ENGINES:
        rate[e], steady_ms, first_ms = measured(per_round[e])
        fired = "-", "-"   # the ceiling fires nothing
        if e in outputs:
            batch = outputs[e].column("batch").to_pylist()
            fired = f"{outputs[e].num_rows:,}", f"{sum(1 for b in batch if b in measured_ids[e]):,}"
        print(f"{e:28} {rate[e]:10,.0f} {statistics.median(steady_ms):8.0f}ms {max(steady_ms):6.0f}ms "
              f"{first_ms:6.0f}ms {fired[0]:>13} {fired[1]:>18}")
    if flink is not None:
        print(f"{'pyflink (whole job)':28} {flink['rate']:10,.0f} {'':>10} {'':>8} {'':>8} "
              f"{sum(flink['fired'].values()):13,}")
    print(f"  {ROUNDS} rounds of {FILES} batches, each round's first batch apart (the query's restart) and Spark's "
          f"no-data batches too; batch p50 and max over the steady batches, first = the firsts' median; timers fired "
          f"over the whole run (warm-up, no-data batches and drains included), then in the steady batches; "
          f"{STATELESS}: the ceiling, the same stream, routing and sink with per-key counts of the batch alone "
          f"(no state, no timers; its output is not checked)")

    def rounds(r: list[float]) -> str:
        return f"median; rounds: {' '.join(f'{x:.2f}' for x in r)}"

    ratio = {e: bench_state.ratios(per_round, e, TWS) for e in STATEFUL if e != TWS}
    for e, r in ratio.items():
        print(f"  {e} / {TWS}: {statistics.median(r):.2f}x ({rounds(r)})")
    of_ceiling = {e: bench_state.ratios(per_round, e, STATELESS) for e in STATEFUL}
    for e, r in of_ceiling.items():
        print(f"  {e} / {STATELESS}: {statistics.median(r):.2f} ({rounds(r)})")
    ceiling = bench_state.ratios(per_round, STATELESS, TWS)
    cm = statistics.median(ceiling)
    print(f"  {STATELESS} / {TWS}: {cm:.2f}x ({rounds(ceiling)}): 10x {TWS} ({10 * rate[TWS]:,.0f} records/s) is "
          + (f"ABOVE the stateless ceiling ({rate[STATELESS]:,.0f} records/s) at {ROWS:,} rows a batch: no stateful "
             f"engine can reach 10x here" if cm < 10 else
             f"within the stateless ceiling ({rate[STATELESS]:,.0f} records/s) at {ROWS:,} rows a batch"))
    same = all(emitted[e] == want for e in STATEFUL)
    print(f"emitted (k, n, fired_at) equal in all {len(STATEFUL)} stateful engines and to the reference: {same} "
          f"({sum(want.values()):,} timers fired, counting {sum(n * c for (_, n, _), c in want.items()):,} of "
          f"{sum(t.num_rows for t in tables):,} rows; the 2 drain keys' timers never fire)")
    if not same:
        for e in STATEFUL:
            missing, extra = want - emitted[e], emitted[e] - want
            print(f"  {e}: {sum(missing.values())} expected rows missing, e.g. {list(missing)[:3]}; "
                  f"{sum(extra.values())} unexpected, e.g. {list(extra)[:3]}")
    if flink is not None:
        counted = sum(n * c for (k, n, _), c in flink["fired"].items() if not k.startswith(DRAIN))
        print(f"  pyflink: {flink['secs']:.1f} s for the whole job; emitted n of the non-drain keys sums to "
              f"{counted:,} (the others: {sum(n * c for (_, n, _), c in want.items()):,})")

    print(f"\nfiring {FIRE_KEYS:,} due event-time timers in one batch ({FIRE_ROUNDS} round(s); batch 3's "
          f"triggerExecution):")
    fire_ms = {e: statistics.median(x["ms"] for x in fire[e]) for e in STATEFUL}
    fired_ok = all(x["fired"] == FIRE_KEYS and x["others"] == 0 for e in STATEFUL for x in fire[e])
    for e in STATEFUL:
        reg = statistics.median(x["register_ms"] for x in fire[e])
        print(f"  {e:28} {fire_ms[e] / 1000:7.2f} s ({FIRE_KEYS / fire_ms[e] * 1000:9,.0f} timers/s), fired "
              f"{[x['fired'] for x in fire[e]]}; registering them (batch 1) {reg / 1000:.2f} s")
    fire_ratio = {e: fire_ms[TWS] / fire_ms[e] for e in STATEFUL if e != TWS}
    for e, r in fire_ratio.items():
        print(f"  {e}: {r:.1f}x faster than {TWS}")
    print(f"  every engine fired exactly {FIRE_KEYS:,} timers in the firing batch and none before: {fired_ok}")

    ra, rp = statistics.median(ratio["ours-arrow"]), statistics.median(ratio["ours-pandas"])
    fa = fire_ratio["ours-arrow"]
    targets = [
        (f"records/s ours-arrow >= 10x {TWS}: {ra:.2f}x", ra >= 10),
        (f"records/s ours-pandas >= 4x {TWS}: {rp:.2f}x", rp >= 4),
        (f"firing {FIRE_KEYS:,} timers >= 10x faster than {TWS}: ours-arrow {fa:.1f}x "
         f"(ours-pandas {fire_ratio['ours-pandas']:.1f}x)", fa >= 10),
        ("same emitted (k, n, fired_at) in all engines and the reference; every engine fired all timers of the "
         "firing part", same and fired_ok),
    ]
    print("\nsummary (issue 38, must-show 4)" + (" - BENCH_SMALL sizes: fixed per-batch costs dominate, the ratios "
                                                  "say nothing about the targets" if SMALL else ""))
    for name, ok in targets:
        print(f"TARGET {'PASS' if ok else 'FAIL'}: {name}")
    ca, cp = (statistics.median(of_ceiling[e]) for e in ("ours-arrow", "ours-pandas"))
    print(f"CEILING ({ROWS:,} rows a batch): {STATELESS} = {cm:.2f}x {TWS}, so 10x {TWS} is "
          f"{'ABOVE' if cm < 10 else 'within'} it; ours-arrow at {ca:.2f} of it, ours-pandas at {cp:.2f}")
    print(f"bench took {time.perf_counter() - t_all:.0f} s")
    return 0


def main() -> int:
    return bench_state.bench_main("bench-timers-", run)


if __name__ == "__main__":
    sys.exit(main())
