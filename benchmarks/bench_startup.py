"""Session start plus 200 tiny tasks, with and without spark-steward, in one run.

Each variant runs in a fresh Python process (so each pays its own JVM start), alternating
plain/steward for ROUNDS rounds; the medians are compared. Prints the overhead at start and per task.
Targets (issue 2): at most 1 s at start and 2 ms per task.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
TASKS = 200

CHILD = r"""
import json, sys, time
from pyspark.sql import SparkSession
import sparksteward
t0 = time.perf_counter()
b = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
if sys.argv[1] == "steward":
    b = sparksteward.configure(b)
spark = b.getOrCreate()
if sys.argv[1] == "steward":
    sparksteward.Steward.get(spark).health()   # the agent is up and answering
start = time.perf_counter() - t0
sc = spark.sparkContext
sc.parallelize(range(20), 20).count()          # warm the Python workers
t1 = time.perf_counter()
sc.parallelize(range(%d), %d).map(lambda x: x).count()
tasks = time.perf_counter() - t1
spark.stop()
print(json.dumps({"start": start, "tasks": tasks}))
""" % (TASKS, TASKS)  # noqa: UP031 - the child script is full of braces


def run(variant: str) -> dict[str, float]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
           "XDG_STATE_HOME": tempfile.mkdtemp(prefix="steward-bench-state-")}
    out = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from sparksteward.jar import shim_jar

    shim_jar()  # build outside the measurement
    results: dict[str, list[dict[str, float]]] = {"plain": [], "steward": []}
    for _ in range(ROUNDS):
        for variant in ("plain", "steward"):
            results[variant].append(run(variant))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("start", "tasks")} for v, rs in results.items()}
    start_overhead = med["steward"]["start"] - med["plain"]["start"]
    per_task_ms = (med["steward"]["tasks"] - med["plain"]["tasks"]) / TASKS * 1000
    print(f"session start + {TASKS} tiny tasks, local[2], median of {ROUNDS} rounds")
    print(f"{'':10} {'start s':>9} {'200 tasks s':>12}")
    for v in ("plain", "steward"):
        print(f"{v:10} {med[v]['start']:9.2f} {med[v]['tasks']:12.3f}")
    print(f"overhead at start: {start_overhead:+.2f} s (target <= 1 s); "
          f"per task: {per_task_ms:+.2f} ms (target <= 2 ms); "
          f"start ratio steward/plain: {med['steward']['start'] / med['plain']['start']:.2f}")
    return 0 if start_overhead <= 1.0 and per_task_ms <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
