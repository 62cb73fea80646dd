"""A Spark Connect client in a process of its own (tests/connect/test_connect.py): it connects to the
server at ``argv[1]`` (``sc://host:port``), runs the scenario ``argv[2]`` and prints one JSON line per
result. It never starts a JVM: it is what a notebook on another machine would be."""

from __future__ import annotations

import json
import os
import sys
import traceback


def out(**fields: object) -> None:
    print(json.dumps(fields, default=str), flush=True)


def refused(call, *args, **kwargs) -> str:
    """The message of the error ``call`` raises (the scenario fails if it raises none)."""
    try:
        call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any error is the answer; its type is printed too
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{getattr(call, '__name__', call)} was not refused on Spark Connect")


def main(url: str, scenario: str, *args: str) -> None:
    import numpy as np
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from sparksteward import Steward

    spark = SparkSession.builder.remote(url).getOrCreate()
    assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
    st = Steward.get(spark)
    if scenario == "broadcast":
        table = np.arange(100_000, dtype=np.int64) * 3
        handle = st.broadcast({"table": table, "name": "triples"})

        @F.udf("long")
        def lookup(i):
            return int(handle.value["table"][i])

        rows = spark.range(0, 100_000, 9_999, 4).select("id", lookup("id").alias("v")).collect()
        out(rows=[[r.id, r.v] for r in rows], driver_value=handle.value["name"], key=handle.key)
    elif scenario == "run_once":
        calls = []

        def load():
            calls.append(1)
            return {"answer": int(args[1]), "rows": spark.range(0, 1000, 1, 2).count()}   # a Spark job in the job

        payload = st.run_once(args[0], load)
        entry = st.job_results.get(args[0])
        out(payload=payload, ran=len(calls), status=entry.status.value,
            spark_jobs=[j.outcome for j in entry.result.spark_jobs])
    elif scenario == "library":
        key = st.add_library(args[0])   # a .py from the client's disk, importable in the server's workers

        @F.udf("long")
        def use(i):
            import steward_connect_lib

            return steward_connect_lib.triple(i)

        out(key=key, rows=[r.v for r in spark.range(0, 5, 1, 2).select(use("id").alias("v")).collect()])
    elif scenario == "keyed":
        # batches through apply + commit from the client; a second client session goes on from the first's
        from sparksteward import value_state

        def count(key, rows, state):
            c = state.value("n")
            n = (c.get() or 0) + len(rows)
            c.update(n)
            return key, n

        ks = st.keyed_state("connect-clicks", key="k", parallelism=2, checkpoint_dir=args[0],
                            states=[value_state("n", "bigint")])
        seen = []
        for batch in range(int(args[1]), int(args[1]) + 2):
            df = spark.createDataFrame([(f"u{i % 3}", i) for i in range(batch * 10, batch * 10 + 10)], "k string, v long")
            rows = ks.apply(df, count, "k string, n long", checkpoint_id=batch).collect()
            ks.commit(batch, wait=60)
            seen.append(sorted([r.k, r.n] for r in rows))
        out(batches=seen)
    elif scenario == "stream":
        # a file-source stream through ks.process in foreachBatch, run to the end of its input (availableNow);
        # a later client process runs it again over more files: the stream and the state go on
        from sparksteward import value_state

        indir, outdir, chk, qchk = args[0], args[1], args[2], args[3]

        def count(key, rows, state):
            c = state.value("n")
            n = (c.get() or 0) + len(rows)
            c.update(n)
            return key, n

        ks = st.keyed_state("connect-stream", key="k", parallelism=2, checkpoint_dir=chk,
                            states=[value_state("n", "bigint")])
        run = ks.process(count, "k string, n long",
                         sink=lambda out, batch_id: out.withColumn("batch", F.lit(batch_id)).write.mode("append")
                         .json(outdir))
        q = (spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).json(indir)
             .writeStream.foreachBatch(run).option("checkpointLocation", qchk).trigger(availableNow=True).start())
        q.awaitTermination(180)
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
        rows = spark.read.json(outdir).collect()
        out(rows=sorted([r.batch, r.k, r.n] for r in rows))
    elif scenario == "add":
        # a file added from the client: tasks of this session read it with SparkFiles.get
        from pyspark import SparkFiles

        text = args[0]
        name = os.path.basename(text)
        file_url = st.add_file(text)
        jar_url = st.add_jar(args[1])

        @F.udf("string")
        def read(_):
            with open(SparkFiles.get(name)) as f:
                return f.read()

        files = {r[0] for r in spark.range(4, numPartitions=4).select(read("id")).collect()}
        spark.udf.registerJavaFunction("exec_udf", "stewardtest.ExecUdf", "string")
        udf_rows = sorted(r[0].split(":")[1] for r in spark.range(4, numPartitions=4).selectExpr("exec_udf(id)").collect())
        out(file_url=file_url, jar_url=jar_url, files=sorted(files), udf=udf_rows)
    elif scenario == "refused":
        ks = st.keyed_state("connect-refused", key="user", parallelism=2, checkpoint_dir=args[1])
        out(messages={
            "keyed_state(...).process(idle_timers=...)": refused(ks.process, lambda k, r, s: None, "user string",
                                                                 lambda o, i: None, idle_timers=5.0),
            "read_state": refused(st.read_state, "clicks"),
        })
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    spark.stop()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        raise
