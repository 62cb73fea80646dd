"""The cross-host suites' Spark standalone cluster, whose worker runs in its own mount namespace
(:mod:`sparksteward.testing.standalone`), and a session on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sparksteward.testing.standalone import isolation_unavailable, standalone_cluster
from tests.helpers import spark_session


def _hidden_dirs() -> list[str]:
    dirs = [os.environ["XDG_STATE_HOME"]]
    home_state = Path.home() / ".local" / "state" / "spark-steward"
    if home_state.is_dir():
        dirs.append(str(home_state))
    return dirs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = isolation_unavailable()
    if reason:
        pytest.skip(f"cross-host test: the worker cannot get its own mount namespace here: {reason}")
    with standalone_cluster(tmp_path_factory.mktemp("standalone"), hide=_hidden_dirs(),
                            worker_env={"PYTHONPATH": os.environ["PYTHONPATH"], "PYSPARK_PYTHON": sys.executable},
                            ) as c:
        yield c


@pytest.fixture(scope="module")
def spark(cluster, s3):
    with spark_session(cluster.master_url, **{
            "spark.executor.cores": "1", "spark.cores.max": "1", "spark.executor.memory": "512m",
            "spark.pyspark.python": sys.executable, "spark.executorEnv.PYTHONPATH": os.environ["PYTHONPATH"],
            "spark.steward.agent.python": sys.executable,
            "spark.steward.storage.options": s3.storage_options()}) as session:
        yield session
