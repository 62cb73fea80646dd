"""Clocks: what every component that waits, retries or expires things is handed.

A clock has ``now()`` (seconds since the epoch, float) and ``sleep(seconds)``. Production code uses
:class:`SystemClock`; tests pass :class:`sparksteward.testing.clock.FakeClock` and move time by hand.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """What a component needs of time."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall-clock time. Stateless and thread-safe."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))
