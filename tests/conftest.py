"""Shared test setup: isolated state, the Python for workers and agents, the fixtures more than one
module uses, and a leak check at the end. Helpers (no fixtures) are in tests/helpers/.

Spark: a process holds one SparkContext at a time. Modules that need nothing but a state dir share one
session, ``spark`` (local[2]) or ``cluster_spark`` (local-cluster[2,1,1024]), and run one after another
(:func:`pytest_collection_modifyitems`); a module that needs other settings defines its own ``spark``
with :func:`tests.helpers.spark_session`, which stops the shared session first.

``make test`` runs the suite in two processes (pytest-xdist, ``-n 2 --dist loadfile``): each takes whole
modules, has its own shared sessions, state dir (``XDG_STATE_HOME``), S3 server and ``SESSION`` marker,
so the leak check at the end counts only its own agents. A test starts Spark only through these helpers,
which launch the process's JVM with the shim jar on its class path (a plain ``getOrCreate`` first would
leave every later session of that process without the plugin).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from sparksteward.testing.s3 import local_s3

from tests.helpers import MARKER, REPO, SESSION, agent_processes, shared_spark, stop_shared_spark, wait_until
from tests.helpers.s3 import clear_delays, new_bucket

_STATE = tempfile.mkdtemp(prefix="steward-test-state-")

os.environ[MARKER] = SESSION
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["XDG_STATE_HOME"] = _STATE  # embedded defaults land here, not in the user's home
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Python workers of local-cluster executors import task functions from this package by reference
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _own_spark_home() -> str:
    """Under pytest-xdist, a SPARK_HOME of this worker's own (a dir of its own under /tmp, not under the
    state dir, which the cross-host worker must not see): links to pyspark's files, and a ``work/`` of
    its own. A local-cluster application's executors run in ``$SPARK_HOME/work/<app id>/<n>``, and app
    ids are ``app-<second>-0000`` per cluster: two workers' clusters started in the same second shared
    those dirs, so one executor agent's rendezvous file replaced the other's, and went with it."""
    import pyspark

    home = tempfile.mkdtemp(prefix="steward-test-spark-home-")
    for entry in Path(pyspark.__file__).resolve().parent.iterdir():
        if entry.name != "work":
            (Path(home) / entry.name).symlink_to(entry)
    os.environ["SPARK_HOME"] = home
    return home


_SPARK_HOME = _own_spark_home() if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture()
def guarded_rmtree(tmp_path, monkeypatch):
    """Use in a module (``pytestmark = pytest.mark.usefixtures("guarded_rmtree")``) to make every
    ``shutil.rmtree`` outside ``tmp_path`` fail its tests, and to put ``tempfile``'s scratch dirs under
    it: code that deletes can never reach anything else."""
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        p = Path(path).resolve()
        if p != tmp_path.resolve() and tmp_path.resolve() not in p.parents:
            raise AssertionError(f"rmtree outside tmp_path: {p}")
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback, one for the whole session; modules use buckets of their own (``s3``).
    It exports ``AWS_ENDPOINT_URL`` and dummy credentials from its start to the end of the session."""
    with local_s3() as server:
        yield server


@pytest.fixture(scope="module")
def s3(s3_server):
    """A bucket of this module's own on the session's S3 server (:func:`tests.helpers.s3.new_bucket`).
    A module whose tests stop the endpoint overrides this with a server of its own."""
    bucket = new_bucket(s3_server)
    yield bucket
    left = clear_delays(s3_server)  # LocalS3.slow(...) restores itself; this catches any other way
    if left:
        pytest.fail(f"the S3 server still answered {left} late after the tests of {bucket.bucket}")


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path):
    """A fresh checkpoint-dir URL on each store: the storage suites run on file:// and on moto's S3."""
    if request.param == "file":
        return str(tmp_path / "checkpoints")
    # not chk-<digits>, which restore_from reads as a checkpoint's own dir (8 hex digits are all decimal
    # one time in 43)
    return request.getfixturevalue("s3").url(f"checkpoints-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def _shared_spark_dirs(tmp_path_factory):
    yield tmp_path_factory.mktemp("shared-spark")
    stop_shared_spark()


@pytest.fixture(scope="module")
def _local_spark(_shared_spark_dirs):
    state = _shared_spark_dirs / "local-state"
    return shared_spark("local[2]", **{"spark.steward.state-dir": str(state)}), state


@pytest.fixture(scope="module")
def spark(_local_spark):
    """local[2] with spark-steward and a state dir (``spark_state``), shared by the modules that take it."""
    return _local_spark[0]


@pytest.fixture(scope="module")
def spark_state(_local_spark):
    """The state dir of the shared ``spark``."""
    return _local_spark[1]


@pytest.fixture(scope="module")
def cluster_spark(_shared_spark_dirs):
    """local-cluster[2,1,1024] with 1 GB executors and a state dir, shared by the modules that take it;
    both executors registered."""
    session = shared_spark("local-cluster[2,1,1024]", **{
        "spark.executor.memory": "1g", "spark.steward.state-dir": str(_shared_spark_dirs / "cluster-state")})
    status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
    wait_until(lambda: status().size() >= 3, timeout=90, what="both executors to register")  # + the driver
    return session


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Run the modules of one shared Spark session one after another, where the first of them is: any
    other session in between would stop it. The rest keeps its order."""
    def shared(item) -> str | None:
        names = item.fixturenames
        return "local" if "_local_spark" in names else "cluster" if "cluster_spark" in names else None

    modules: dict[object, list] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    group_of = {path: next(filter(None, map(shared, its)), None) for path, its in modules.items()}
    ordered, emitted = [], set()
    for path in modules:
        group = group_of[path]
        if group is None:
            ordered.extend(modules[path])
        elif group not in emitted:
            emitted.add(group)
            for other, its in modules.items():
                if group_of[other] == group:
                    ordered.extend(its)
    items[:] = ordered


def pytest_sessionfinish(session, exitstatus):
    deadline = time.monotonic() + 15
    while agent_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = agent_processes()
    if left:
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        session.exitstatus = 1
        print(f"\nLEAK: {len(left)} spark-steward agent process(es) outlived the test session: "
              f"{[p.pid for p in left]}", file=sys.stderr)
    shutil.rmtree(_STATE, ignore_errors=True)  # this session's XDG_STATE_HOME (embedded defaults)
    if _SPARK_HOME is not None:
        shutil.rmtree(_SPARK_HOME, ignore_errors=True)   # its links (never followed) and its work/
