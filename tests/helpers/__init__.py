"""What test modules share: waiting, Spark sessions, the agents of this test session.

The rest of this package holds the helpers of one area each (``tests.helpers.checkpoint``, ``.blob``,
...) and the scripts some tests run as child processes. Fixtures live in the conftest.py files; test
modules never import each other.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
MARKER = "SPARK_STEWARD_TEST_SESSION"  # conftest.py sets it to SESSION; agents inherit it
SESSION = uuid.uuid4().hex


def agent_processes() -> list[psutil.Process]:
    """Agent processes started by this test session (found through the inherited marker)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (any("sparksteward.agents" in part for part in proc.info["cmdline"] or ())
                    and proc.environ().get(MARKER) == SESSION):
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
    """A SparkSession with spark-steward enabled, of this block alone; stopped at exit. The shared
    session (:func:`shared_spark`), if one runs, stops first: a process holds one SparkContext at a time."""
    stop_shared_spark()
    with _session(master, conf) as spark:
        yield spark


_shared: dict = {}   # the shared session: its key (master and conf), its context manager, the session


def shared_spark(master: str, **conf: str):
    """The session of every module that asks for the same ``master`` and ``conf`` (conftest.py's
    ``spark`` and ``cluster_spark``): started on first use and kept until someone needs another."""
    key = (master, tuple(sorted(conf.items())))
    if _shared.get("key") != key:
        stop_shared_spark()
        cm = _session(master, conf)
        _shared.update(key=key, cm=cm, session=cm.__enter__())
    return _shared["session"]


def stop_shared_spark() -> None:
    """Stop the shared session, if one runs, and wait for its agents to exit."""
    cm = _shared.pop("cm", None)
    _shared.clear()
    if cm is not None:
        cm.__exit__(None, None, None)
        wait_until(lambda: not agent_processes(), timeout=20, what="agents to exit after spark.stop()")


@contextlib.contextmanager
def _session(master: str, conf: dict[str, str]) -> Iterator[object]:
    import sparksteward
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession
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
