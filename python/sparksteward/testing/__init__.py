"""Test doubles and fixtures shipped with spark-steward: a fake clock, a local S3 server, and
:class:`KeyedStateHarness`, which runs a keyed-state function batch by batch without Spark.

Nothing here is used at run time by the agents.
"""

from typing import Any

from sparksteward.testing.clock import FakeClock

__all__ = ["FakeClock", "KeyedStateHarness"]


def __getattr__(name: str) -> Any:
    if name == "KeyedStateHarness":   # imported on first use: it needs pyarrow and rocksdict
        from sparksteward.testing.harness import KeyedStateHarness

        return KeyedStateHarness
    raise AttributeError(f"module 'sparksteward.testing' has no attribute {name!r}")
