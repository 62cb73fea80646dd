"""spark-steward: Apache Flink's runtime services (BLOB service, JobResultStore, guaranteed cleanup)
for PySpark, as a Spark plugin.

Switch it on with :func:`configure` on a ``SparkSession.builder`` (or ``spark-submit --conf
spark.plugins=sparksteward.shim.StewardPlugin --jars "$(steward jar)"``), then use
:meth:`Steward.get` in the driver.
"""

from sparksteward.client import Steward
from sparksteward.errors import (
    AgentUnavailableError,
    BlobNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    CorruptRecordError,
    InvalidIdError,
    JobAlreadyCompleted,
    StewardError,
)
from sparksteward.session import PLUGIN_CLASS, configure

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_CLASS",
    "AgentUnavailableError",
    "BlobNotFoundError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptRecordError",
    "InvalidIdError",
    "JobAlreadyCompleted",
    "Steward",
    "StewardError",
    "__version__",
    "configure",
]
