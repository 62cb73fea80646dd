"""Shared test setup: isolated state, the Python for workers and agents, a leak check at the end.

Spark sessions are module-scoped (one per test module, since a process can hold one SparkContext at a
time); use :func:`spark_session` from a module fixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import psutil

MARKER = "SPARK_STEWARD_TEST_SESSION"
_SESSION = uuid.uuid4().hex
_STATE = tempfile.mkdtemp(prefix="steward-test-state-")

os.environ[MARKER] = _SESSION
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["XDG_STATE_HOME"] = _STATE  # embedded defaults land here, not in the user's home
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Python workers of local-cluster executors import task functions from this package by reference
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))


def agent_processes() -> list[psutil.Process]:
    """Agent processes started by this test session (found through the inherited marker)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any("sparksteward.agents" in part for part in proc.info["cmdline"] or ()):
                if proc.environ().get(MARKER) == _SESSION:
                    found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def spark_session(master: str = "local[2]", **conf: str) -> Iterator[object]:
    """A SparkSession with spark-steward enabled; stopped (and checked for leftovers) at exit."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    import sparksteward
    from sparksteward.jar import shim_jar

    # Launch the JVM with only the jar on its class path: spark-submit turns the first session's
    # settings into JVM system properties, which would leak into every later session of this process.
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).set("spark.jars", str(shim_jar())))
    builder = SparkSession.builder.master(master).appName(f"steward-test-{master}")
    for key, value in {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
                       "spark.executor.memory": "512m", **conf}.items():
        builder = builder.config(key, value)
    spark = sparksteward.configure(builder).getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()


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
