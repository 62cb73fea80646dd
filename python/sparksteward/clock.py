"""Clocks: what every component that waits, retries or expires things is handed.

A clock has ``now()`` (seconds since the epoch, float) and ``sleep(seconds)``. Production code uses
:class:`SystemClock`; tests pass :class:`sparksteward.testing.clock.FakeClock` and move time by hand.

Test-only: in the driver agent process (``python -m sparksteward.agents.driver``), when
``SPARK_STEWARD_TEST_CLOCK_OFFSET_FILE`` names a file, :meth:`SystemClock.now` adds the seconds written
in it (a float, read at every call; a missing or unreadable file counts 0). The nemesis soak
(tests/checkpoint/test_nemesis.py) steps the driver's clock back by rewriting that file.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock"]

OFFSET_FILE_ENV = "SPARK_STEWARD_TEST_CLOCK_OFFSET_FILE"


@runtime_checkable
class Clock(Protocol):
    """What a component needs of time."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall-clock time. Stateless and thread-safe."""

    def now(self) -> float:
        return time.time() + _test_offset()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


def _test_offset() -> float:
    """The test-only clock offset of this process (see the module docstring): 0 unless this is the driver
    agent and the environment names an offset file."""
    path = os.environ.get(OFFSET_FILE_ENV)
    if not path or getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) != \
            "sparksteward.agents.driver":
        return 0.0
    try:
        with open(path, "rb") as f:
            return float(f.read())
    except (OSError, ValueError):
        return 0.0
