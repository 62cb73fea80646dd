"""The per-key form's cost a key, without Spark (issue 37): one subtask's batch through
``state.runner.run_pandas`` on a real RocksDB backend, with four functions:

- ``noop``: returns None (the runner's own work a key: the key's rows, the state handle, the loop);
- ``row``: the count and sum of ``bench_state.py``, returning a row ``(key, n, s)``;
- ``frame``: the same returning a one-row DataFrame, as Spark's per-key operators require;
- ``frame-iloc``: ``frame`` with each key's rows taken by ``iloc`` and a new index (the public pandas path
  the runner falls back to) instead of pandas' block manager.

Prints microseconds a key (best of ``BENCH_ROUNDS`` batches, each of ``BENCH_ROWS`` rows over
``BENCH_KEYS`` keys: about one row a key, as a subtask of ``bench_state.py`` sees it).

    python benchmarks/bench_per_key_calls.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from sparksteward.state import runner
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange

ROWS = int(os.environ.get("BENCH_ROWS", "2500"))
KEYS = int(os.environ.get("BENCH_KEYS", "20000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "12"))
M = 128
SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64()), ("s", pa.int64())])


def noop(key, rows, state):
    return None


def row(key, rows, state):
    n, s = state.get() or (0, 0)
    n, s = n + len(rows), s + int(rows["v"].sum())
    state.update([n, s])
    return key, n, s


def frame(key, rows, state):
    n, s = state.get() or (0, 0)
    n, s = n + len(rows), s + int(rows["v"].sum())
    state.update([n, s])
    return pd.DataFrame({"k": [key], "n": [n], "s": [s]})


def _iloc_slicer(df: Any) -> Any:
    def rows(start: int, end: int) -> Any:
        part = df.iloc[start:end].copy(deep=False)
        part.index = pd.RangeIndex(end - start)
        return part
    return rows


def per_key_us(fn: Any, batches: list[pa.RecordBatch], root: str, label: str) -> float:
    best = float("inf")
    with RocksDBStateBackend(os.path.join(root, label), KeyGroupRange(0, M), M) as backend:
        for b in batches:
            keys = len(pa.compute.unique(b.column(0)))
            t = time.perf_counter()
            for _ in runner.run_pandas([b], "k", fn, backend, SCHEMA):
                pass
            best = min(best, (time.perf_counter() - t) / keys * 1e6)
    return best


def main() -> int:
    rng = np.random.default_rng(1)
    batches = [pa.record_batch({"k": pa.array([f"key-{i}" for i in rng.integers(0, KEYS, ROWS)]),
                                "v": pa.array(rng.integers(0, 100, ROWS))}) for _ in range(ROUNDS)]
    print(f"one subtask's batch: {ROWS:,} rows over up to {KEYS:,} keys, best of {ROUNDS} (pandas {pd.__version__})")
    with tempfile.TemporaryDirectory(prefix="bench-per-key-") as root:
        got = {name: per_key_us(fn, batches, root, name) for name, fn in (("noop", noop), ("row", row), ("frame", frame))}
        fast = runner._row_slicer
        runner._row_slicer = _iloc_slicer   # the public path, for comparison
        try:
            got["noop-iloc"] = per_key_us(noop, batches, root, "noop-iloc")
            got["frame-iloc"] = per_key_us(frame, batches, root, "frame-iloc")
        finally:
            runner._row_slicer = fast
    for name, us in got.items():
        print(f"  {name:12} {us:7.1f} us a key")
    print(f"a one-row DataFrame costs {got['frame'] - got['row']:.0f} us a key more than a row; the block manager's "
          f"slices save {got['noop-iloc'] - got['noop']:.0f} us a key against iloc")
    return 0


if __name__ == "__main__":
    sys.exit(main())
