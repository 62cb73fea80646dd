"""Switching the plugin on from Python: :func:`configure` for a ``SparkSession.builder``.

Like delta's ``configure_spark_with_delta_pip``, it appends to what the user already set instead of
overwriting it: the shim jar is added to ``spark.jars`` and the plugin class to ``spark.plugins``, and
``spark.hadoop.fs.steward.impl`` names the shim's ``steward://`` FileSystem unless already set, and
``spark.hadoop.fs.steward.ha.storage-path`` hands it the HA blob store (``spark.steward.blob.ha.storage-path``)
for where no agent runs yet, as when spark-submit downloads ``--jars`` before the SparkContext starts.
It must run before the first SparkSession of the process starts its JVM, since jars on the driver
class path cannot be added later.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from sparksteward.protocol import PLUGIN_CLASS

__all__ = ["FS_CLASS", "FS_HA_KEY", "FS_IMPL_KEY", "PLUGIN_CLASS", "configure"]

#: The shim's read-only Hadoop FileSystem for ``steward://`` URLs, and the setting that enables it.
FS_CLASS = "sparksteward.shim.StewardFileSystem"
FS_IMPL_KEY = "spark.hadoop.fs.steward.impl"
#: The HA blob store the FileSystem reads ``steward blobs put`` URLs from where no agent runs yet.
FS_HA_KEY = "spark.hadoop.fs.steward.ha.storage-path"


def _append(existing: str | None, item: str) -> str:
    parts = [p.strip() for p in (existing or "").split(",") if p.strip()]
    return ",".join(parts if item in parts else [*parts, item])


def configure(builder: Any, *, jar: str | os.PathLike[str] | None = None) -> Any:
    """Enable spark-steward on ``builder`` and return it.

    Parameters
    ----------
    builder : pyspark.sql.SparkSession.Builder
        The builder to configure; settings already on it are kept.
    jar : path, optional
        The shim jar. Default: ``steward jar`` (built once from the installed pyspark's Scala).

    Notes
    -----
    If no Python was chosen for the workers (``spark.pyspark.python`` or ``PYSPARK_PYTHON``), this sets
    ``PYSPARK_PYTHON`` in this process so that workers and agents run with this process's Python, which has spark-steward installed. Workers are forked
    from ``sparksteward.daemon`` (``spark.python.daemon.module``) unless another daemon was chosen, so
    that libraries added with ``Steward.add_library`` are importable.
    """
    from sparksteward.jar import shim_jar

    options: dict[str, str] = getattr(builder, "_options", {})
    jar_path = str(jar or shim_jar())
    builder = builder.config("spark.jars", _append(options.get("spark.jars"), jar_path))
    builder = builder.config("spark.plugins", _append(options.get("spark.plugins"), PLUGIN_CLASS))
    if not options.get(FS_IMPL_KEY):
        # steward:// URLs (st.add_jar, st.add_file, `steward blobs put`) through the shim's FileSystem
        builder = builder.config(FS_IMPL_KEY, FS_CLASS)
    ha = (options.get("spark.steward.blob.ha.storage-path") or "").strip()
    if ha and ha.lower() != "none" and not options.get(FS_HA_KEY):
        builder = builder.config(FS_HA_KEY, ha)
    if not options.get("spark.python.daemon.module"):
        # workers fork from our daemon, which installs the finder for st.add_library() libraries
        builder = builder.config("spark.python.daemon.module", "sparksteward.daemon")
    if not (options.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")):
        # Python workers, their daemon and the agents must import sparksteward. PySpark's driver picks
        # the workers' Python from $PYSPARK_PYTHON (else `python3`), so point it at this Python.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    return builder
