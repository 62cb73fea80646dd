"""The streaming application of the nemesis soak (tests/checkpoint/test_nemesis.py), run by it as a
driver process of its own (``python -m tests.helpers.nemesis_app --control DIR --app N ...``) so
that the soak can SIGKILL it.

It reads the JSON files the soak adds to ``config["source"]`` (one file per micro-batch) and runs
``KeyedState.process`` over them on local-cluster[2,1,1024], checkpoints on moto's S3 server, with
three declared states: ``count`` (a value state with a processing-time TTL), ``recent`` (the row ids of
the key, a list state with the same TTL) and ``total`` (the sum of ``v``, no TTL). The function emits
one row per input row it processes, with what the states hold after its call and the batch's
processing time, so the soak can replay every emitted row against a model in plain Python.

The sink is the standard exactly-once ``foreachBatch`` sink: one JSON file per checkpoint id,
written atomically (staged, then renamed), skipped when it exists already.

Everything the soak and the application say to each other goes through files in ``--control``:

- ``config.json`` (soak -> app): paths, names, timeouts;
- ``events-<app>.log`` (app -> soak): one line per event (``started``, ``begin``, ``sink``,
  ``committed``, ``refused-parallelism`` (the failure asks to run the batch at that parallelism),
  ``query-failed``, ``drained``, ``stopped``);
- ``sink/<cid>.json``: the sink's output;
- ``kill-after-sink`` (soak -> app): a checkpoint id; the sink of that id SIGKILLs this process right
  after it wrote its file, before the commit (it renames the file first, so the re-delivery lives);
- ``fail-arm`` (soak -> task): the first call of the function in a task's attempt 0 takes it and
  raises (``before`` its state writes, ``mid`` between them or ``after`` them, as the file says);
- ``gate-arm`` / ``gate-held-<pid>`` / ``gate-go`` (soak <-> task): the first call takes the arm,
  says which Python worker holds, and waits until the soak lets it go;
- ``resume-<app>-<n>`` (soak -> app): go on after the query's n-th failure (the soak checks the
  checkpoints while nothing runs);
- ``stop-<app>`` (soak -> app): stop the query, ``drain`` first if the file says so, and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import time
from pathlib import Path

import pandas as pd

OUT_SCHEMA = "rid long, k string, v long, n long, m long, t long, now long"
INPUT_SCHEMA = "rid long, k string, v long"
COUNT, RECENT, TOTAL = "count", "recent", "total"


def event(control: Path, app: int, text: str) -> None:
    with open(control / f"events-{app}.log", "a") as f:
        f.write(f"{time.time():.3f} {text}\n")
        f.flush()


def processing_time(state) -> int:
    """The batch's processing time the state views use (the per-key state object keeps it in its
    typed views; a soak needs it to replay the TTL)."""
    access = getattr(state, "_access", None)
    states = getattr(access, "states", None)
    now = getattr(states, "now_ms", None)
    if now is None:
        raise RuntimeError("nemesis: cannot find the batch's processing time (state._access.states.now_ms); "
                           "tests/helpers/nemesis_app.py must follow where the per-key state keeps it")
    return int(now)


def _take(path: str, taken: str) -> bool:
    try:
        os.rename(path, taken)
    except OSError:
        return False
    return True


def nemesis_fn(control: str):
    """The user function (per key): see the module docstring."""

    def fn(key, rows, state):
        from pyspark import TaskContext

        gate = os.path.join(control, "gate-arm")
        if os.path.exists(gate) and _take(gate, os.path.join(control, f"gate-held-{os.getpid()}")):
            deadline = time.monotonic() + 90
            while not os.path.exists(os.path.join(control, "gate-go")) and time.monotonic() < deadline:
                time.sleep(0.05)
        fail = None
        arm = os.path.join(control, "fail-arm")
        ctx = TaskContext.get()
        if ctx is not None and ctx.attemptNumber() == 0 and os.path.exists(arm):
            taken = os.path.join(control, f"fail-taken-{os.getpid()}")
            if _take(arm, taken):
                with open(taken) as f:
                    fail = f.read().strip() or "after"
        if fail == "before":
            raise RuntimeError(f"nemesis: injected failure of key {key} before its state writes (attempt 0)")
        rids = [int(r) for r in rows["rid"]]
        count = state.value(COUNT)
        n = (count.get() or 0) + len(rows)
        count.update(n)
        if fail == "mid":
            raise RuntimeError(f"nemesis: injected failure of key {key} between its state writes (attempt 0)")
        recent = state.list(RECENT)
        recent.extend(rids)
        m = len(recent.get())
        total = state.value(TOTAL)
        t = (total.get() or 0) + int(rows["v"].sum())
        total.update(t)
        if fail == "after":
            raise RuntimeError(f"nemesis: injected failure of key {key} after its state writes (attempt 0)")
        size, now = len(rows), processing_time(state)
        vs = [int(v) for v in rows["v"]]
        if size % 2:   # both of the per-key form's outputs, the same in every attempt: rows, or a DataFrame
            return [(rid, key, v, n, m, t, now) for rid, v in zip(rids, vs)]
        return pd.DataFrame({"rid": rids, "k": [key] * size, "v": vs, "n": [n] * size,
                             "m": [m] * size, "t": [t] * size, "now": [now] * size})

    return fn


def write_sink(control: Path, app: int, out, cid: int) -> None:
    """One file per checkpoint id, staged and renamed; an id written before is skipped."""
    rows = [r.asDict() for r in out.collect()]
    sink = control / "sink"
    path = sink / f"{cid:06d}.json"
    if path.exists():
        event(control, app, f"sink {cid} skipped {len(rows)}")
    else:
        tmp = sink / f".{cid:06d}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        event(control, app, f"sink {cid} wrote {len(rows)}")
    kill = control / "kill-after-sink"
    try:
        wanted = int(kill.read_text())
    except (OSError, ValueError):
        return
    if wanted == cid and _take(str(kill), str(control / f"kill-after-sink.taken-{app}")):
        event(control, app, f"killing after sink {cid}")
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", required=True)
    ap.add_argument("--app", type=int, required=True)
    ap.add_argument("--parallelism", type=int, required=True)
    ap.add_argument("--alignment", choices=("aligned", "unaligned"), required=True)
    ap.add_argument("--timeout", type=float, default=0.2, help="aligned_checkpoint_timeout (unaligned)")
    args = ap.parse_args()
    control = Path(args.control)
    cfg = json.loads((control / "config.json").read_text())
    app = args.app

    from datetime import timedelta

    import sparksteward
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import SparkSession
    from sparksteward import Steward, list_state, value_state

    builder = (SparkSession.builder.master("local-cluster[2,1,1024]").appName(f"steward-nemesis-{app}")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "1g")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.task.maxFailures", "4")
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(cfg["records_per_batch"])))
    for key, value in cfg["steward_conf"].items():
        builder = builder.config(key, value)
    spark = sparksteward.configure(builder).getOrCreate()
    ttl = timedelta(seconds=cfg["ttl_s"])
    align = {"alignment": "unaligned", "aligned_checkpoint_timeout": args.timeout} if args.alignment == "unaligned" \
        else {"alignment": "aligned"}
    ks = Steward.get(spark).keyed_state(
        cfg["name"], key="k", parallelism=args.parallelism, max_parallelism=cfg["max_parallelism"],
        checkpoint_dir=cfg["state_chk"], num_retained=cfg["num_retained"],
        file_merging={"enabled": True, "max_file_size": cfg["merge_max_file_size"]},
        states=[value_state(COUNT, "bigint", ttl=ttl), list_state(RECENT, "bigint", ttl=ttl),
                value_state(TOTAL, "bigint")], **align)
    run = ks.process(nemesis_fn(str(control)), OUT_SCHEMA, sink=lambda out, cid: write_sink(control, app, out, cid),
                     wait=90)

    def each(batch_df, batch_id):
        event(control, app, f"begin {batch_id}")
        run(batch_df, batch_id)
        event(control, app, f"committed {batch_id} {ks.last_checkpoint_id}")

    def start():
        events = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(cfg["source"])
        return (events.writeStream.foreachBatch(each).option("checkpointLocation", cfg["spark_chk"])
                .trigger(processingTime="250 milliseconds").start())

    stop_file = control / f"stop-{app}"
    event(control, app, f"started p={args.parallelism} {args.alignment} timeout={args.timeout} pid={os.getpid()}")
    failures = 0
    while True:
        query = start()
        failed = None
        try:
            while not query.awaitTermination(0.3):
                if stop_file.exists():
                    break
        except StreamingQueryException as exc:
            failed = exc
        if failed is not None:
            first = next((line for line in str(failed).splitlines() if line.strip()), type(failed).__name__)
            refused = re.search(r"Run this batch at parallelism (\d+)", str(failed))
            if refused:   # a re-delivery at another parallelism that cannot cut as the first delivery did
                event(control, app, f"refused-parallelism {refused.group(1)}")
            event(control, app, f"query-failed {failures} {first[:400]}")
            resume = control / f"resume-{app}-{failures}"
            while not resume.exists() and not stop_file.exists():
                time.sleep(0.1)
            failures += 1
            if not stop_file.exists():
                continue
        query.stop()
        if stop_file.read_text().strip() == "drain":
            cid = ks.drain()
            event(control, app, f"drained {cid}")
        event(control, app, "stopped")
        spark.stop()
        return


if __name__ == "__main__":
    main()
