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
from sparksteward.lazy import lazy_face
from sparksteward.session import PLUGIN_CLASS, configure

__version__ = "0.1.0"

_DECLARATIONS = ("list_state", "map_state", "value_state")


#: value_state, list_state and map_state (state declarations), imported on first use: they need pyarrow,
#: which the agents and the CLI do not always load
__getattr__, __dir__ = lazy_face(__name__, dict.fromkeys(_DECLARATIONS, "state.declared"), globals())

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
    "list_state",
    "map_state",
    "value_state",
]
