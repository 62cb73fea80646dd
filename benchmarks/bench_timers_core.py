"""Timers in the state layer, without Spark (issue 38, must-show 4 in part): what holding many timers
costs a batch that fires none, and what firing many costs, on one subtask's RocksDB.

    python benchmarks/bench_timers_core.py      (BENCH_KEYS=1000000 BENCH_ROWS=20000 BENCH_FIRE=100000)

1. **1M registered timers, none due.** Two DBs with the same ``BENCH_KEYS`` keys in a typed value state;
   one also holds one processing-time timer per key, all far in the future. A batch is ``run_arrow`` over
   ``BENCH_ROWS`` rows of existing keys (read, add, write the value) followed by the firing step of a
   task with an ``on_timer`` (:func:`sparksteward.state.firing.fire`: the range scans that find nothing
   due, and the earliest timer left). Reported: the median batch of 7, alternating the two DBs, and the
   ratio (target: within 10%).
2. **Firing ``BENCH_FIRE`` due timers** in one batch (Arrow form: one callback with every fired timer,
   which reads the fired keys' values and returns them), median of 3 fresh registrations.

Peers (``transformWithStateInPandas`` with ``timeMode="EventTime"``) need Spark: not in this file.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sparksteward import value_state
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import resolve
from sparksteward.state.firing import fire
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.runner import run_arrow
from sparksteward.state.timers import Timers
from sparksteward.state.typed import TypedStates

KEYS = int(os.environ.get("BENCH_KEYS", "1000000"))
ROWS = int(os.environ.get("BENCH_ROWS", "20000"))
FIRE = int(os.environ.get("BENCH_FIRE", "100000"))
M = 128
T = 1_800_000_000_000
RECORD = resolve(None, [value_state("value", "bigint")])
SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64())])


def add(keys, rows, state):
    g = rows.group_by("k").aggregate([("k", "count")])
    n = pc.add(pc.fill_null(state.get_many(g["k"]), 0), g["k_count"])
    state.put_many(g["k"], n)


def fired(keys, expired, state):
    return pa.table({"k": expired.column("key"), "n": state.get_many(expired.column("key"))})


def build(path: Path, names: list[str], timers: bool) -> RocksDBStateBackend:
    b = RocksDBStateBackend(path, KeyGroupRange(0, M), M, "string")
    states = TypedStates(b, RECORD, T, 0)
    for i in range(0, len(names), 100_000):
        part = pa.array(names[i:i + 100_000])
        states.value("value").put_many(part, pa.array(np.ones(len(part), dtype=np.int64)))
        if timers:
            Timers(b).register(part, T + 10 ** 9)
    b.db.flush()
    return b


def batch(b: RocksDBStateBackend, rows: pa.Table, n: int) -> float:
    states = TypedStates(b, RECORD, T, n)
    t = time.perf_counter()
    for _ in run_arrow(rows.to_batches(), "k", add, b, SCHEMA, states=states, max_input_bytes=1 << 30):
        pass
    for _ in fire(fired, "arrow", b, states, SCHEMA, {}):
        pass
    return (time.perf_counter() - t) * 1000


def main() -> None:
    rng = np.random.default_rng(38)
    names = [f"user-{i:07d}" for i in range(KEYS)]
    with tempfile.TemporaryDirectory(prefix="steward-bench-timers-") as tmp:
        started = time.perf_counter()
        plain = build(Path(tmp) / "plain", names, timers=False)
        timed = build(Path(tmp) / "timers", names, timers=True)
        print(f"built two DBs of {KEYS:,} keys (one with {KEYS:,} timers) in {time.perf_counter() - started:.1f} s")
        times: dict[str, list[float]] = {"plain": [], "timers": []}
        for r in range(7):
            rows = pa.table({"k": pa.array([names[i] for i in rng.integers(0, KEYS, ROWS)])})
            for label, b in (("plain", plain), ("timers", timed)) if r % 2 == 0 else (("timers", timed),
                                                                                      ("plain", plain)):
                times[label].append(batch(b, rows, r + 1))
        p, t = statistics.median(times["plain"]), statistics.median(times["timers"])
        print(f"1. a batch of {ROWS:,} rows with firing, none due: no timers {p:.1f} ms, {KEYS:,} timers {t:.1f} ms "
              f"(x{t / p:.2f}; target <= 1.10)")
        plain.close()
        firing = []
        for r in range(3):
            keys = pa.array(names[:FIRE])   # fired and deleted each round, so registered afresh
            Timers(timed).register(keys, T - 1)
            states = TypedStates(timed, RECORD, T, 100 + r)
            t0 = time.perf_counter()
            out = sum(o.num_rows for o in fire(fired, "arrow", timed, states, SCHEMA, {}))
            firing.append((time.perf_counter() - t0) * 1000)
            assert out == FIRE, out
        f = statistics.median(firing)
        print(f"2. firing {FIRE:,} due timers in one batch (Arrow form, one callback): {f:.0f} ms "
              f"({FIRE / f * 1000:,.0f} timers/s)")
        timed.close()


if __name__ == "__main__":
    main()
