"""Restart strategies (Flink's four, same parameter names). Placeholder API; filled in by runtime work."""

from __future__ import annotations

from abc import ABC, abstractmethod


class RestartStrategy(ABC):
    """Decides whether and when a failed job restarts."""

    @abstractmethod
    def on_failure(self, now: float | None = None) -> float | None:
        """Record one failure; return the delay in seconds before restarting, or None to give up."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and ``onceflow doctor``."""


class FixedDelay(RestartStrategy):
    def __init__(self, attempts: int = 3, delay: float = 1.0):
        self.attempts, self.delay, self.failures = attempts, float(delay), 0

    def on_failure(self, now: float | None = None) -> float | None:
        self.failures += 1
        return self.delay if self.failures <= self.attempts else None

    def describe(self) -> str:
        return f"fixed_delay(attempts={self.attempts}, delay={self.delay}s)"


def fixed_delay(attempts: int = 3, delay: float = 1.0) -> FixedDelay:
    return FixedDelay(attempts, delay)
