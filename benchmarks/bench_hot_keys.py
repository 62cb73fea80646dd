"""Hot keys and unaligned checkpoints (issue 38 must-show 3): does a hot key still hold back the cut?

One application on ``local-cluster[2,1,1024]``, parallelism 4 (``max_parallelism`` 64). A parquet stream
(``maxFilesPerTrigger=1``) where every subtask gets ``BENCH_ROWS`` rows of ordinary keys per file, and
subtasks 0 and 1 also hold one hot key each with ``BENCH_HOT`` (5) times that many rows, in the first key
group of their range (the cut can fall only after it). The per-key function costs ``BENCH_ROW_US``
microseconds a row (a sleep: the work of a real function, without taking the two cores from Spark), so
the hot subtasks take 6x the time of the others. Three states over the same files through ``ks.process``:
``aligned``; ``unaligned`` with an aligned-checkpoint timeout of about one ordinary subtask's time, where
the per-key function gets a key's rows in one call (the cut waits for the whole hot key); and
``chunks``, the same unaligned state with ``form="chunks"`` (``fn(key, chunks, state)``, the cut may fall
between two chunks of the hot key: decision 0028, slice 6).

It prints batch duration p50 / p99 / max (``triggerExecution``), the rows deferred, and checks the final
per-key values equal (after a drain). The target: the unaligned p99 with chunks at most half the
aligned p99 (``unaligned`` is the baseline that shows why chunks are needed).
``flock /tmp/steward-spark.lock python benchmarks/bench_hot_keys.py``.
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

os.environ.setdefault("BENCH_P", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from bench_unaligned import M, P, pct, stage, start  # noqa: E402

FILES = int(os.environ.get("BENCH_FILES", "8"))
ROWS = int(os.environ.get("BENCH_ROWS", "2000"))     # ordinary rows per subtask per file
KEYS = int(os.environ.get("BENCH_KEYS", "400"))      # ordinary keys per subtask
HOT = int(os.environ.get("BENCH_HOT", "5"))          # a hot key's rows: HOT x ROWS
ROW_US = float(os.environ.get("BENCH_ROW_US", "200"))
SCHEMA = "k string, n long, s long"


def count_sum(key, rows, state):
    time.sleep(len(rows) * ROW_US / 1e6)   # the function's own work, per row
    cur = state.get() or [0, 0]
    cur = [cur[0] + len(rows), cur[1] + int(rows["v"].sum())]
    state.update(cur)
    return pd.DataFrame({"k": [key], "n": [cur[0]], "s": [cur[1]]})


def count_sum_chunks(key, chunks, state):
    n = s = 0
    for chunk in chunks:
        time.sleep(len(chunk) * ROW_US / 1e6)
        n, s = n + len(chunk), s + int(chunk["v"].sum())
    cur = state.get() or [0, 0]
    cur = [cur[0] + n, cur[1] + s]
    state.update(cur)
    return key, cur[0], cur[1]


def write_inputs(root: Path) -> tuple[list[Path], dict[int, str]]:
    from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group

    ordinary: dict[int, list[str]] = {s: [] for s in range(P)}
    hot: dict[int, str] = {}
    i = 0
    while min(len(v) for v in ordinary.values()) < KEYS or len(hot) < 2:
        k = f"user-{i:07d}"
        g = key_group(k, M)
        s = subtask_for_key_group(M, P, g)
        if s < 2 and s not in hot and g == key_group_range(M, P, s).start:
            hot[s] = k
        elif len(ordinary[s]) < KEYS:
            ordinary[s].append(k)
        i += 1
    rng = np.random.default_rng(38)
    out = []
    for f in range(FILES):
        parts = []
        for s in range(P):
            names = np.array(ordinary[s], dtype=object)
            parts.append(pd.DataFrame({"k": names[rng.integers(0, KEYS, ROWS)], "v": rng.integers(0, 100, ROWS)}))
            if s in hot:
                parts.append(pd.DataFrame({"k": [hot[s]] * (ROWS * HOT), "v": rng.integers(0, 100, ROWS * HOT)}))
        frame = pd.concat(parts).sample(frac=1.0, random_state=f).reset_index(drop=True)
        path = root / "inputs" / f"part-{f:04d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
        out.append(path)
    return out, hot


def run_mode(spark: Any, mode: str, root: Path, files: list[Path], timeout: float) -> dict[str, Any]:
    from sparksteward import Steward

    indir = stage(files, root / "in" / mode)
    st = Steward.get(spark)
    opts: dict[str, Any] = {"alignment": "aligned" if mode == "aligned" else "unaligned"}
    if mode != "aligned":
        opts["aligned_checkpoint_timeout"] = timeout
    chk = str(root / "chk")
    ks = st.keyed_state(f"hot-{mode}", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=chk, **opts)
    fn, form = (count_sum_chunks, "chunks") if mode == "chunks" else (count_sum, "pandas")
    run = ks.process(fn, SCHEMA, form=form, sink=lambda out, bid: out.write.format("noop").mode("append").save())
    src = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(str(indir))
    q = src.writeStream.foreachBatch(run).option("checkpointLocation", str(root / "q" / mode)).start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    durations = [p.durationMs.get("triggerExecution", 0) / 1000 for p in q.recentProgress if p.numInputRows]
    stats = {c["checkpoint_id"]: c for c in ks.info()["checkpoints"]}
    ks = st.keyed_state(f"hot-{mode}", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=chk,
                        alignment="aligned")
    last = max(stats)
    ks.apply(spark.createDataFrame([], "k string, v long"), count_sum, SCHEMA, checkpoint_id=last + 1
             ).write.format("noop").mode("append").save()
    ks.commit(last + 1)
    return {"durations": durations[1:], "deferred": [stats[b]["rows_deferred"] for b in sorted(stats)],
            "final": {r.key: r.value for r in ks.read().collect()}}


def main() -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench-hot-keys-"))
    os.environ["XDG_STATE_HOME"] = str(root / "xdg")
    ordinary_s = ROWS * ROW_US / 1e6
    timeout = float(os.environ.get("BENCH_TIMEOUT", str(round(max(0.5, ordinary_s), 2))))
    try:
        files, hot = write_inputs(root)
        spark = start(root)
        try:
            modes = os.environ.get("BENCH_MODES", "aligned,unaligned,chunks").split(",")
            results = {m: run_mode(spark, m, root, files, timeout) for m in modes}
        finally:
            spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nhot keys: {FILES} files; each of {P} subtasks {ROWS:,} ordinary rows a file over {KEYS} keys; subtasks 0 "
          f"and 1 also one hot key ({', '.join(hot.values())}) of {ROWS * HOT:,} rows in their first key group; "
          f"{ROW_US:g} us a row (an ordinary subtask ~{ordinary_s:.2f} s, a hot one ~{ordinary_s * (1 + HOT):.2f} s); "
          f"unaligned timeout {timeout:g} s; local-cluster[2,1,1024]; the first batch of each left out")
    print(f"{'mode':<10} {'p50 s':>6} {'p99 s':>6} {'max s':>6}  rows deferred per checkpoint")
    for m, r in results.items():
        d = r["durations"]
        print(f"{m:<10} {statistics.median(d):>6.2f} {pct(d, .99):>6.2f} {max(d):>6.2f}  {r['deferred']}")
    a = results["aligned"]
    for m in [m for m in results if m != "aligned"]:
        u = results[m]
        ratio = pct(u["durations"], .99) / max(pct(a["durations"], .99), 1e-9)
        same = a["final"] == u["final"]
        print(f"p99 {m} / aligned: {ratio:.2f} (target <= 0.5 with chunks); same final state: {same} "
              f"({len(a['final']):,} keys)")
        if m == "chunks":
            print(f"TARGET {'PASS' if ratio <= 0.5 and same else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
