"""Switching the plugin on from Python: :func:`configure` for a ``SparkSession.builder``.

Like delta's ``configure_spark_with_delta_pip``, it appends to what the user already set instead of
overwriting it: the shim jar is added to ``spark.jars`` and the plugin class to ``spark.plugins``, and
``spark.hadoop.fs.steward.impl`` names the shim's ``steward://`` FileSystem unless already set, and
``spark.hadoop.fs.steward.ha.storage-path`` hands it the HA blob store (``spark.steward.blob.ha.storage-path``)
for where no agent runs yet, as when spark-submit downloads ``--jars`` before the SparkContext starts.
It must run before the first SparkSession of the process starts its JVM, since jars on the driver
class path cannot be added later.

It first checks the installed pyspark: a major.minor version outside
:data:`~sparksteward.config.TESTED_SPARK_VERSIONS` is refused with a :class:`~sparksteward.errors.ConfigError`
unless the builder sets ``spark.steward.spark-version-check=false``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sparksteward.config import OPTIONS, TESTED_SPARK_VERSIONS
from sparksteward.errors import ConfigError
from sparksteward.shim_protocol import PLUGIN_CLASS

__all__ = ["FS_CLASS", "FS_HA_KEY", "FS_IMPL_KEY", "PLUGIN_CLASS", "VERSION_CHECK_KEY", "configure"]

#: The shim's read-only Hadoop FileSystem for ``steward://`` URLs, and the setting that enables it.
FS_CLASS = "sparksteward.shim.StewardFileSystem"
FS_IMPL_KEY = "spark.hadoop.fs.steward.impl"
#: The HA blob store the FileSystem reads ``steward blobs put`` URLs from where no agent runs yet.
FS_HA_KEY = "spark.hadoop.fs.steward.ha.storage-path"
#: The builder setting that lets :func:`configure` run on a pyspark version we do not test.
VERSION_CHECK_KEY = "spark.steward.spark-version-check"


def _append(existing: str | None, item: str) -> str:
    parts = [p.strip() for p in (existing or "").split(",") if p.strip()]
    return ",".join(parts if item in parts else [*parts, item])


def _check_spark_version(options: Mapping[str, str]) -> None:
    """Refuse a pyspark whose major.minor is not tested, unless ``options`` turn the check off."""
    opt = next(o for o in OPTIONS if o.key == VERSION_CHECK_KEY)
    if not opt.parse(str(options.get(opt.key, opt.default))):
        return
    import pyspark

    found = str(pyspark.__version__)
    m = re.match(r"(\d+)\.(\d+)", found)
    if m and f"{m[1]}.{m[2]}" in TESTED_SPARK_VERSIONS:
        return
    raise ConfigError(
        f"pyspark {found} (in {os.path.dirname(pyspark.__file__ or '')}) is not a version spark-steward is tested "
        f"on; tested are {', '.join(TESTED_SPARK_VERSIONS)}. Install one of them "
        f"(pip install 'pyspark=={TESTED_SPARK_VERSIONS[-1]}.*'), or set {VERSION_CHECK_KEY}=false on the builder "
        f"(.config(\"{VERSION_CHECK_KEY}\", \"false\") before configure()) to run on {found} anyway.")


def configure(builder: Any, *, jar: str | os.PathLike[str] | None = None) -> Any:
    """Enable spark-steward on ``builder`` and return it.

    Parameters
    ----------
    builder : pyspark.sql.SparkSession.Builder
        The builder to configure; settings already on it are kept.
    jar : path, optional
        The shim jar. Default: ``steward jar`` (built once from the installed pyspark's Scala).

    Raises
    ------
    ConfigError
        The installed pyspark's major.minor version is not one of
        :data:`~sparksteward.config.TESTED_SPARK_VERSIONS` and the builder does not set
        ``spark.steward.spark-version-check=false``, or that setting is not a boolean.

    Notes
    -----
    If no Python was chosen for the workers (``spark.pyspark.python`` or ``PYSPARK_PYTHON``), this sets
    ``PYSPARK_PYTHON`` in this process so that workers and agents run with this process's Python, which has spark-steward installed. Workers are forked
    from ``sparksteward.daemon`` (``spark.python.daemon.module``) unless another daemon was chosen, so
    that libraries added with ``Steward.add_library`` are importable.
    """
    from sparksteward.connect import is_connect_builder, warn_connect_builder
    from sparksteward.jar import shim_jar

    options: dict[str, str] = getattr(builder, "_options", {})
    if is_connect_builder(builder):   # the plugin is the Connect server's configuration (decision 0030)
        warn_connect_builder(str(jar) if jar else '"$(steward jar)"', SERVER_CONF)
        return builder
    _check_spark_version(options)
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


#: what a Spark Connect server (or any spark-submit) needs besides ``--jars <shim>``: configure()'s settings
SERVER_CONF = {"spark.plugins": PLUGIN_CLASS, "spark.python.daemon.module": "sparksteward.daemon",
               FS_IMPL_KEY: FS_CLASS}
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def connect_server_command(*, port: int | None = None, extra: Sequence[str] = (), jar: str | None = None) -> list[str]:
    """The ``spark-submit`` command line of a Spark Connect server with spark-steward (``steward
    connect-server``, decision 0030): the shim jar, :data:`SERVER_CONF`, ``port`` as
    ``spark.connect.grpc.binding.port`` and ``extra`` spark-submit arguments (``--master``, ``--conf``...)
    before the server's resource. The workers' and agents' Python is this one unless ``extra`` sets it."""
    import shutil

    from sparksteward.jar import shim_jar

    submit = shutil.which("spark-submit", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if submit is None:
        raise ConfigError("steward connect-server: no spark-submit next to this Python or on PATH: install pyspark "
                          "here, or set PATH to a Spark distribution's bin/")
    conf = dict(SERVER_CONF)
    if port is not None:
        conf["spark.connect.grpc.binding.port"] = str(port)
    if not any(a.startswith("spark.pyspark.python=") for a in extra) and not os.environ.get("PYSPARK_PYTHON"):
        conf["spark.pyspark.python"] = sys.executable
    args = [submit, "--class", CONNECT_SERVER_CLASS, "--jars", str(jar or shim_jar())]
    for key, value in conf.items():
        args += ["--conf", f"{key}={value}"]
    return [*args, *extra, "spark-internal"]
