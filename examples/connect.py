"""spark-steward from a Spark Connect client (decision 0030).

    make example-connect        (or: python examples/connect.py [sc://host:port])

Without a URL it starts a Spark Connect server with the plugin on this machine (``steward connect-server
--port P -- --master local[2]``), uses it from this process, which never starts a JVM, and stops it. With a
URL it uses that server, which must run with the plugin. The client needs ``pip install
'spark-steward[connect]'``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import sparksteward
from pyspark.sql import SparkSession
from pyspark.sql import functions as F


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A Connect server with the plugin on a free port of 127.0.0.1, stopped at exit; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="steward-connect-")
    cmd = [sys.executable, "-m", "sparksteward", "connect-server", "--port", str(port), "--", "--master", "local[2]",
           "--conf", "spark.connect.grpc.binding.address=127.0.0.1", "--conf", "spark.ui.enabled=false"]
    with open(os.path.join(work, "server.log"), "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"the Connect server exited with {server.returncode}; see {log.name}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"the Connect server did not listen within 120 s; see {log.name}")
                time.sleep(0.5)
            print(f"Spark Connect server with spark-steward on sc://127.0.0.1:{port} (log: {log.name})")
            yield f"sc://127.0.0.1:{port}"
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)


def main(url: str) -> None:
    spark = SparkSession.builder.remote(url).getOrCreate()
    st = sparksteward.Steward.get(spark)   # the agent's endpoint and secret come over Connect
    print(f"driver agent {st.health()['pid']} serves this Connect client")

    # BLOB service: 16 MB from the client to the server once; every task reads it zero-copy
    table = np.arange(2 << 20, dtype=np.float64)
    h = st.broadcast(table)

    @F.udf("double")
    def partial_sum(i):
        return float(h.value[i::4].sum())

    sums = [r.s for r in spark.range(0, 4, 1, 4).select(partial_sum("id").alias("s")).collect()]
    print(f"broadcast {h.key[:12]}... -> partial sums {sums}, total equal to the client's: {sum(sums) == table.sum()}")

    # JobResultStore: a job id runs once, across client sessions and restarts of this script
    job_id = f"connect-example-{spark.conf.get('spark.app.id')}"
    first = st.run_once(job_id, lambda: {"rows": spark.range(1000).count()})
    again = st.run_once(job_id, lambda: {"rows": -1})
    print(f"run_once({job_id!r}): {first}, then the stored payload without running again: {again}")

    # keyed state: each batch applied from the client, its checkpoint committed by the server's driver agent
    ks = st.keyed_state("connect-clicks", key="user", parallelism=2,
                        checkpoint_dir=tempfile.mkdtemp(prefix="steward-connect-chk-"),
                        states=[sparksteward.value_state("clicks", "bigint")])

    def count(key, rows, state):
        clicks = state.value("clicks")
        n = (clicks.get() or 0) + len(rows)
        clicks.update(n)
        return key, n

    for batch in range(2):
        df = spark.createDataFrame([(f"user-{i % 3}", i) for i in range(batch * 6, batch * 6 + 6)], "user string, v long")
        rows = sorted(tuple(r) for r in ks.apply(df, count, "user string, clicks long", checkpoint_id=batch).collect())
        ks.commit(batch, wait=60)
        print(f"batch {batch}: clicks per user {rows}")

    # (ks.process(...) works as a Connect foreachBatch function too: tests/connect/test_connect.py)
    # what does not work on Connect yet is refused by name, saying what to do instead
    try:
        st.read_state("clicks")
    except sparksteward.errors.ConnectNotSupportedError as exc:
        print(f"refused on Connect: {exc}")
    spark.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with local_server() as server_url:
            main(server_url)
