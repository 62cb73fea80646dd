"""A Spark application of its own for tests/keyed_state/test_timers_spark.py: it opens a keyed state with an
event-time column at parallelism 8, runs one batch whose keys register event-time timers (none due yet),
commits it and SIGKILLs itself, so that another application (the test's) takes the state over, rescaled,
and fires them (``python -m tests.helpers.timers_app --checkpoint-dir ... --state-dir ... --name ...``)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal

T = 1_800_000_000_000
KEYS = 40


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("checkpoint-dir", "state-dir", "name"):
        ap.add_argument(f"--{name}", required=True)
    args = ap.parse_args()

    import sparksteward
    from pyspark.sql import SparkSession
    from sparksteward import Steward

    from tests.keyed_state.test_timers_spark import OUT, arm

    builder = (SparkSession.builder.master("local[2]").appName("steward-timers-app")
               .config("spark.ui.enabled", "false").config("spark.steward.state-dir", args.state_dir))
    spark = sparksteward.configure(builder).getOrCreate()
    ks = Steward.get(spark).keyed_state(args.name, key="k", parallelism=8, max_parallelism=16,
                                        checkpoint_dir=args.checkpoint_dir, event_time="ts", watermark_delay=5)
    rows = [(f"k{i}", dt.datetime.fromtimestamp((T + 1000 * i) / 1000, tz=dt.timezone.utc), 1) for i in range(KEYS)]
    df = spark.createDataFrame(rows, "k string, ts timestamp, v long")
    assert ks.apply(df, arm, OUT, 0).collect() == []   # timers at T + 10 s + i s, none due
    ks.commit(0, wait=60)
    print(f"committed 0 in {spark.sparkContext.applicationId}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)   # no stop, no cleanup: the next application takes over


if __name__ == "__main__":
    main()
