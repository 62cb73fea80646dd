"""The cross-host suites' Spark standalone cluster, whose worker runs in its own mount namespace
(:mod:`sparksteward.testing.standalone`), and a session on it: one of each for the whole folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from sparksteward.testing.standalone import isolation_unavailable, standalone_cluster

from tests.helpers import spark_session
from tests.helpers.s3 import new_bucket


def _hidden_dirs() -> list[str]:
    dirs = [os.environ["XDG_STATE_HOME"]]
    home_state = Path.home() / ".local" / "state" / "spark-steward"
    if home_state.is_dir():
        dirs.append(str(home_state))
    return dirs


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    reason = isolation_unavailable()
    if reason:
        pytest.skip(f"cross-host test: the worker cannot get its own mount namespace here: {reason}")
    with standalone_cluster(tmp_path_factory.mktemp("standalone"), hide=_hidden_dirs(),
                            worker_env={"PYTHONPATH": os.environ["PYTHONPATH"], "PYSPARK_PYTHON": sys.executable},
                            ) as c:
        yield c


@pytest.fixture(scope="package")
def driver_clock(tmp_path_factory):
    """The file of the driver agent's test clock offset (seconds; sparksteward/clock.py), set before the
    session's JVM starts so that every driver agent it starts, restarted ones too, reads it."""
    from sparksteward.clock import OFFSET_FILE_ENV

    path = tmp_path_factory.mktemp("driver-clock") / "offset"
    path.write_text("0")
    old = os.environ.get(OFFSET_FILE_ENV)
    os.environ[OFFSET_FILE_ENV] = str(path)
    yield path
    path.write_text("0")
    if old is None:
        os.environ.pop(OFFSET_FILE_ENV, None)
    else:
        os.environ[OFFSET_FILE_ENV] = old


# a session on the standalone cluster, whose worker is another "host"
@pytest.fixture(scope="package")
def spark(cluster, s3, driver_clock):
    with spark_session(cluster.master_url, **{
            "spark.executor.cores": "1", "spark.cores.max": "1", "spark.executor.memory": "512m",
            "spark.pyspark.python": sys.executable, "spark.executorEnv.PYTHONPATH": os.environ["PYTHONPATH"],
            "spark.steward.agent.python": sys.executable,
            # every batch's WAL is folded, and a snapshot of a few KB may be compacted (decision 0019)
            "spark.steward.state.wal-flush-size": "1k", "spark.steward.state.compaction.min-size": "1k",
            "spark.steward.storage.options": s3.storage_options()}) as session:
        yield session


@pytest.fixture(scope="package")
def s3(s3_server):
    """A bucket of this folder's own on the session's S3 server (the session here outlives a module)."""
    return new_bucket(s3_server)
