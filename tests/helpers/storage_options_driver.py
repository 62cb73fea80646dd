"""The driver of tests/checkpoint/test_storage_options.py, run as a child process
(``python -m tests.helpers.storage_options_driver <result.json> <checkpoint dir> <state dir>``) whose
environment names no S3 endpoint: the endpoint reaches it only through
``spark.steward.storage.options`` (the environment variable ``STEWARD_TEST_STORAGE_OPTIONS``, read
here and set as that key). A new JVM, a local-cluster[1,1,1024] executor and its Python workers all
start from that environment.

It applies two batches of ``count_sum`` to a keyed state checkpointed on S3, commits both and reads
the state back on the driver and distributed, then writes the executor's endpoint variables and both
reads as JSON to ``<result.json>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson

from tests.helpers import spark_session
from tests.helpers.keyed import SCHEMA, count_sum, make_batches

CLUSTER = "so"
NAME = "opts"
SEED = 22


def endpoint_vars() -> list[str]:
    """The names of the S3 endpoint variables in this process's environment."""
    return sorted(k for k in os.environ if k.startswith("AWS_ENDPOINT_URL"))


def _rows(df) -> dict[str, list[int]]:
    out = {}
    for r in df.collect():
        v = orjson.loads(r.value)
        out[r.key] = [v["n"], v["s"]]
    return out


def main(result: str, checkpoint_dir: str, state_dir: str) -> None:
    from sparksteward import Steward

    assert not endpoint_vars(), endpoint_vars()
    conf = {"spark.executor.memory": "1g", "spark.steward.state-dir": state_dir, "spark.steward.cluster-id": CLUSTER,
            "spark.steward.storage.options": os.environ.pop("STEWARD_TEST_STORAGE_OPTIONS")}
    with spark_session("local-cluster[1,1,1024]", **conf) as spark:
        executor_env = spark.sparkContext.parallelize([0], 1).map(lambda _: endpoint_vars()).collect()[0]
        ks = Steward.get(spark).keyed_state(NAME, key="k", parallelism=2, max_parallelism=8,
                                            checkpoint_dir=checkpoint_dir)
        for i, batch in enumerate(make_batches(SEED, count=2, rows=200, keys=20)):
            ks.apply(spark.createDataFrame(batch), count_sum, SCHEMA, checkpoint_id=i).collect()
            ks.commit(i, wait=60)
        out = {"executor_env": executor_env, "local": _rows(ks.read()), "distributed": _rows(ks.read(distributed=True))}
    Path(result).write_bytes(orjson.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
