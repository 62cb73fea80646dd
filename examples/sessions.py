"""Event-time sessions over a file stream (issue 38), on local[2].

    make example-sessions        (or: python examples/sessions.py)

Click events arrive as JSON files, out of order (each file holds the last minutes of the one before)
and with a few late clicks (hours older than the watermark). ``sparksteward.windows.sessions`` keeps each
user's open sessions in keyed state with one event-time timer each; a session (30 minutes without a
click) is emitted once the watermark, the newest click seen minus 10 minutes, passes its end. The
query is stopped halfway and started again at another parallelism: the sessions continue from the
latest checkpoint, rescaled from 4 to 2 subtasks. At the end the example checks its sessions against
Spark's own ``session_window`` over the same clicks in a batch query, and the late clicks against the
count the state dropped.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import sparksteward
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sparksteward.windows import sessions

GAP = timedelta(minutes=30)
START = datetime(2026, 11, 30, 8, 0, tzinfo=timezone.utc)


def make_files(seed: int = 38, files: int = 8, per_file: int = 60) -> list[list[dict]]:
    """Clicks of 12 users; each file's last 5 minutes arrive with the next file (out of order, within the
    10-minute delay); files 5 and 6 also hold 2 clicks each from 3 hours before (late). The last file
    is an end-of-stream marker whose time moves the watermark past every session."""
    rnd = random.Random(seed)
    t = START
    clicks = []
    for _ in range(files * per_file):
        t += timedelta(minutes=rnd.choice([1, 2, 4, 40]))
        clicks.append({"user": f"u{rnd.randrange(12)}", "ts": t})
    out: list[list[dict]] = [clicks[i:i + per_file] for i in range(0, len(clicks), per_file)]
    for i in range(len(out) - 1):
        newest = max(c["ts"] for c in out[i])
        moved = [c for c in out[i] if c["ts"] > newest - timedelta(minutes=5)]
        out[i] = [c for c in out[i] if c not in moved]
        out[i + 1] = moved + out[i + 1]
    for i in (5, 6):
        out[i] += [{"user": f"u{j}", "ts": out[i][0]["ts"] - timedelta(hours=3), "late": True} for j in range(2)]
    out.append([{"user": "_end", "ts": t + timedelta(days=1)}])
    out.append([{"user": "_end", "ts": t + timedelta(days=1, minutes=1)}])
    for f in out:
        rnd.shuffle(f)
    return out


def write(src: Path, i: int, clicks: list[dict]) -> None:
    tmp = src.parent / f".clicks-{i}.json"
    tmp.write_text("\n".join(json.dumps({**c, "ts": c["ts"].isoformat()}) for c in clicks))
    os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))   # the file source reads them in this order
    tmp.rename(src / f"clicks-{i:02d}.json")   # and sees whole files only


def run(spark, st, src: Path, work: Path, parallelism: int):
    s = sessions(key="user", time="ts", gap=GAP)
    ks = st.keyed_state("sessions", key="user", parallelism=parallelism, max_parallelism=64,
                        checkpoint_dir=str(work / "state"), event_time="ts",
                        watermark_delay=timedelta(minutes=10), states=s.states)
    clicks = spark.readStream.schema("user string, ts timestamp").option("maxFilesPerTrigger", 1).json(str(src))
    sink = lambda df, batch_id: df.write.mode("append").parquet(str(work / "out"))  # noqa: E731
    query = (clicks.writeStream.foreachBatch(ks.process(s.fn, s.schema, sink, on_timer=s.on_timer))
             .option("checkpointLocation", str(work / "query")).start())
    query.processAllAvailable()
    query.stop()
    return ks, sum((ks.report(checkpoint_id=c) or {}).get("late_rows", 0) for c in range(100))


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="steward-sessions-"))
    src = work / "in"
    src.mkdir()
    spark = (sparksteward.configure(SparkSession.builder.master("local[2]").appName("steward-sessions"))
             .config("spark.sql.session.timeZone", "UTC").config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    st = sparksteward.Steward.get(spark)
    try:
        files = make_files()
        for i, f in enumerate(files[:5]):
            write(src, i, f)
        ks, late = run(spark, st, src, work, parallelism=4)
        print(f"first run: {ks.last_checkpoint_id + 1} batches at parallelism 4, {late} late clicks dropped")
        for i, f in enumerate(files[5:], start=5):
            write(src, i, f)
        ks, late2 = run(spark, st, src, work, parallelism=2)
        print(f"restarted at parallelism 2 ({ks.rescaled_from} before): {late2} late clicks dropped")

        got = {(r.user, r.window_start, r.window_end, r.events) for r in
               spark.read.parquet(str(work / "out")).where("user != '_end'").collect()}
        every = spark.read.schema("user string, ts timestamp, late boolean").json(str(src))
        expected = {(r.user, r.session_window.start, r.session_window.end, r["count"]) for r in
                    every.where("user != '_end' and late is null")
                    .groupBy("user", F.session_window("ts", "30 minutes")).count().collect()}
        late_clicks = every.where("late").count()
        assert got == expected, f"{len(got ^ expected)} sessions differ from the batch query's"
        assert late + late2 == late_clicks, (late, late2, late_clicks)
        print(f"{len(got)} sessions of {len({u for u, *_ in got})} users, equal to Spark's session_window over "
              f"the same clicks; {late_clicks} late clicks counted and dropped")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
