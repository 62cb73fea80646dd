"""Keyed state with Flink-style checkpoints in a streaming query (FLIP-428), on local[2].

    make example-state        (or: python examples/keyed_state_stream.py)

A file source delivers click events; ``clicks.process`` is the ``foreachBatch`` function: it applies the
per-user counter to each micro-batch, writes the output with the sink and completes checkpoint
``batch_id``. The query is then stopped and started again with another parallelism: the state continues
from its latest completed checkpoint, rescaled from 4 to 2 subtasks. Finally a savepoint is taken and
restored under another name.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import sparksteward
from pyspark.sql import SparkSession


def update(key, rows: pd.DataFrame, state) -> tuple[str, int]:
    n = (state.get() or 0) + len(rows)  # ValueState: get() / update(v) / clear()
    state.update(n)
    return key, n  # one output row (user, clicks); a list of rows or a DataFrame also do


def write_events(src: Path, batch: int, users: list[str]) -> None:
    tmp = src.parent / f".events-{batch}.json"
    tmp.write_text("\n".join(json.dumps({"user": u, "page": f"/p{i % 3}"}) for i, u in enumerate(users)))
    tmp.rename(src / f"events-{batch}.json")  # the file source sees whole files only


def run_query(spark, st, src: Path, chk: Path, out: Path, parallelism: int):
    clicks = st.keyed_state("clicks", key="user", parallelism=parallelism, max_parallelism=128,
                            checkpoint_dir=str(chk / "state"))
    events = spark.readStream.schema("user string, page string").option("maxFilesPerTrigger", 1).json(str(src))
    query = (events.writeStream
             .foreachBatch(clicks.process(update, "user string, clicks long",
                                          sink=lambda df, batch_id: df.write.mode("append").parquet(str(out))))
             .option("checkpointLocation", str(chk / "query"))
             .start())
    query.processAllAvailable()
    query.stop()
    return clicks


def main() -> None:
    spark = sparksteward.configure(
        SparkSession.builder.master("local[2]").appName("steward-keyed-state").config("spark.ui.enabled", "false")
    ).getOrCreate()
    st = sparksteward.Steward.get(spark)
    work = Path(tempfile.mkdtemp(prefix="keyed-state-example-"))
    src, chk, out = work / "events", work / "chk", work / "out"
    src.mkdir()
    try:
        write_events(src, 0, ["ann", "bob", "ann", "cid"])
        write_events(src, 1, ["bob", "bob", "dee"])
        clicks = run_query(spark, st, src, chk, out, parallelism=4)
        print("after 2 batches, parallelism 4:", sorted((r.key, r.value) for r in clicks.read().collect()))

        # restart with another parallelism: the state continues from its latest checkpoint, rescaled
        write_events(src, 2, ["ann", "eve", "eve"])
        clicks = run_query(spark, st, src, chk, out, parallelism=2)
        info = clicks.info()
        print(f"after 3 batches, parallelism 2: {sorted((r.key, r.value) for r in clicks.read().collect())}; "
              f"last completed checkpoint {info['last_completed']}, retained {info['retained']}")
        print("sink rows:", spark.read.parquet(str(out)).count())

        # a savepoint is self-contained: restore it under another name (NO_CLAIM: files copied by the store)
        savepoint = clicks.savepoint(str(work / "savepoints" / "clicks-1"))
        copy = st.keyed_state("clicks-copy", key="user", parallelism=2, max_parallelism=128,
                              checkpoint_dir=str(chk / "state"), restore_from=savepoint)
        print("restored from", savepoint, "->", copy.restore_info)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("keyed state example finished")


if __name__ == "__main__":
    main()
