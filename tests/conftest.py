"""Shared test setup: isolated state, the Python for workers and agents, the fixtures more than one
module uses, and a leak check at the end. Helpers (no fixtures) are in tests/helpers/.

Spark sessions are module-scoped (one per test module, since a process can hold one SparkContext at a
time); use :func:`tests.helpers.spark_session` from a module fixture.
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
from tests.helpers import MARKER, REPO, SESSION, agent_processes
from tests.helpers.s3 import clear_delays, new_bucket

_STATE = tempfile.mkdtemp(prefix="steward-test-state-")

os.environ[MARKER] = SESSION
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["XDG_STATE_HOME"] = _STATE  # embedded defaults land here, not in the user's home
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Python workers of local-cluster executors import task functions from this package by reference
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


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
    return request.getfixturevalue("s3").url(f"chk-{uuid.uuid4().hex[:8]}")


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
