"""The retry policy of failed cleanup steps and commits: :class:`RetryPolicy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparksteward.errors import InvalidRecordError

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to retry a failed step.

    ``exponential`` (the default): ``initial * 2**(failures-1)``, capped at ``maximum`` (1 s, 2 s,
    4 s, ... up to 1 h). ``fixed``: always ``initial``. ``attempts`` is the number of attempts per
    step in one run before giving up (0 = unlimited).
    """

    initial: float = 1.0
    maximum: float = 3600.0
    attempts: int = 0
    strategy: str = "exponential"

    def __post_init__(self) -> None:
        if self.strategy not in ("exponential", "fixed"):
            raise InvalidRecordError(f"retry strategy {self.strategy!r} is not 'exponential' or 'fixed'")
        if not self.initial > 0 or not self.maximum >= self.initial:
            raise InvalidRecordError(f"retry delays must satisfy 0 < initial <= maximum, not "
                                     f"initial={self.initial!r}, maximum={self.maximum!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 0:
            raise InvalidRecordError(f"retry attempts must be an integer >= 0 (0 = unlimited), not {self.attempts!r}")

    @classmethod
    def exponential(cls, initial: float = 1.0, maximum: float = 3600.0, attempts: int = 0) -> RetryPolicy:
        return cls(initial, maximum, attempts, "exponential")

    @classmethod
    def fixed(cls, delay: float = 60.0, attempts: int = 0) -> RetryPolicy:
        return cls(delay, delay, attempts, "fixed")

    @classmethod
    def from_config(cls, cfg: Any) -> RetryPolicy:
        """From ``spark.steward.cleanup.{initial-backoff,max-backoff,max-attempts}``."""
        return cls.exponential(cfg.cleanup_initial_backoff, max(cfg.cleanup_max_backoff, cfg.cleanup_initial_backoff),
                               cfg.cleanup_max_attempts)

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        if self.strategy == "fixed":
            return self.initial
        return min(self.initial * (2.0 ** min(max(0, failures - 1), 64)), self.maximum)

    def exhausted(self, attempts: int) -> bool:
        return self.attempts > 0 and attempts >= self.attempts
