"""A fake clock that tests advance by hand (the protocol and the system clock are in the core).

Components that wait or expire things take a :class:`sparksteward.clock.Clock`, so tests can move
time without sleeping.
"""

from __future__ import annotations

import threading

__all__ = ["FakeClock"]


class FakeClock:
    """A clock that only moves when told to. ``sleep`` advances it instead of waiting.

    Thread-safe. ``sleeps`` records every requested sleep, so tests can check backoff sequences.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.sleeps: list[float] = []

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self._now += max(0.0, seconds)

