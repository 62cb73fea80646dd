"""Spark Connect clients (issue 40, decision 0030).

A Connect session has no JVM and no ``SparkContext``; the plugin runs in the Connect server, an
ordinary Spark driver started with ``--conf spark.plugins=... --jars <shim>``. A client finds the driver
agent's endpoint in the server's conf and the application's secret through one task on an executor,
both over the Connect channel (only a client the server accepted can ask), then talks to the agent over
our authenticated socket as a classic driver does. What still needs the driver's JVM is refused here by name, with what to do instead.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from sparksteward.errors import ConnectNotSupportedError

__all__ = ["ConnectConf", "application_secret", "is_connect", "is_connect_builder", "refuse", "warn_connect_builder"]


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (checked by its class, so pyspark's Connect client
    packages are never imported for a classic session)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def is_connect_builder(builder: Any) -> bool:
    """Whether ``builder`` will build a Connect session: ``builder.remote(url)``, ``spark.remote`` or
    ``SPARK_REMOTE`` (PySpark's own rules, without importing its Connect client)."""
    options = getattr(builder, "_options", None) or {}
    if "spark.remote" in options or options.get("spark.api.mode") == "connect":
        return True
    return bool(os.environ.get("SPARK_REMOTE")) and "spark.master" not in options


class ConnectConf:
    """The server's conf as a Connect client sees it (``spark.conf``), with the two methods of a
    ``SparkConf`` the client reads: ``get`` and ``getAll``."""

    def __init__(self, spark: Any) -> None:
        self._spark = spark

    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value as a string, else ``default`` (as ``SparkConf.get``)."""
        value = self._spark.conf.get(key, None)
        return default if value is None else str(value)

    def getAll(self) -> list[tuple[str, str]]:   # noqa: N802 - SparkConf's name
        return [(k, str(v)) for k, v in self._spark.conf.getAll.items()]


def application_secret(spark: Any) -> str:
    """The application's secret, read by one task on an executor (the executor agent's rendezvous) and
    returned over the Connect channel. Spark Connect hides the secret's conf key from its clients, as it
    should; a client the server accepted can run Python on the executors anyway, so it learns nothing
    this way that its UDFs could not read, and a client the server refused learns nothing."""
    rows = spark.range(0, 1, 1, 1).mapInArrow(_read_secret, "secret string").collect()
    if not rows or not rows[0].secret:
        raise ConnectNotSupportedError("Steward.get on Spark Connect: the executor's agent gave no secret; is "
                                       "spark-steward installed where the server's executors run?")
    return str(rows[0].secret)


def _read_secret(batches: Any) -> Any:
    """In a Python worker of the server's executor: the secret its agent's rendezvous holds."""
    import pyarrow as pa

    from sparksteward.worker import agent_secret

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist([{"secret": agent_secret()}], schema=pa.schema([("secret", pa.string())]))


def refuse(call: str, why: str, instead: str) -> ConnectNotSupportedError:
    """The error of ``Steward.<call>`` on a Connect session."""
    return ConnectNotSupportedError(f"Steward.{call} is not available on Spark Connect: {why}. {instead}")


_SERVER_SIDE = ("spark.plugins", "spark.jars", "spark.python.daemon.module")


def warn_connect_builder(jar: str, server_conf: dict[str, str]) -> None:
    """``configure()`` on a Connect builder: nothing it sets would reach the server, so say what the
    server needs instead: ``--jars jar`` and ``server_conf``."""
    confs = " ".join(f"--conf {k}={v}" for k, v in server_conf.items())
    warnings.warn(
        f"sparksteward.configure: this builder makes a Spark Connect client: configure() set nothing on it. "
        f"{', '.join(_SERVER_SIDE)} are the Connect server's static configuration; start the server with "
        f"{confs} --jars {jar} (and its spark.steward.* settings), then use Steward.get(spark) on this session "
        f"(docs/decisions/0030-spark-connect-clients.md)", UserWarning, stacklevel=3)
