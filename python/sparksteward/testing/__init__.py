"""Test doubles and fixtures shipped with spark-steward: a fake clock and a local S3 server.

Nothing here is used at run time by the agents.
"""

from sparksteward.testing.clock import FakeClock

__all__ = ["FakeClock"]
