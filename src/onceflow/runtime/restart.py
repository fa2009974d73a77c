"""Restart strategies: Flink's four, with Flink's parameter names in snake_case.

A strategy is a small state machine fed one failure at a time: ``on_failure(now)`` returns the
delay in seconds before the next attempt, or None to give up. Given the same ``now`` values
(and, for jitter, the same seeded ``random.Random``) it returns the same answers: no clocks or
randomness are read behind the caller's back except the defaults (``time.monotonic()``, an
unseeded ``Random``). ``now`` may come from any clock the caller uses consistently.

One strategy instance counts the failures of one scope: the driver process counts query
failures (in-process restarts), the supervisor counts process crashes (process restarts).

``parse("fixed_delay:attempts=5,delay=2s")`` builds one from a CLI spec; ``describe()`` prints
the same form, so a logged strategy can be pasted back into ``--restart-strategy``.

The default (:func:`default_strategy`, ``Job.restart_strategy`` and ``--restart-strategy
default``) is Flink's ``exponential-delay`` with Flink's defaults: delays grow from 1 s to at
most 1 min, and the count starts over after the job ran 1 h without failing, so failures months
apart never add up to an end. ``fixed_delay`` keeps Flink's semantics: its count never resets.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import ClassVar

from onceflow.durations import seconds
from onceflow.errors import ConfigError

Duration = float | int | str
INFINITE = ("inf", "infinite", "unlimited")


class RestartStrategy(ABC):
    """Decides whether and when a failed job restarts."""

    @abstractmethod
    def on_failure(self, now: float | None = None) -> float | None:
        """Record one failure; return the delay in seconds before restarting, or None to give up."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and ``onceflow doctor``."""

    def __repr__(self) -> str:
        return self.describe()


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else float(now)


def _duration(value: Duration, what: str, *, positive: bool = False) -> float:
    s = seconds(value, what)
    if s is None or s < 0 or (positive and s == 0):
        raise ConfigError(f"{what} must be a duration {'> 0' if positive else '>= 0'}, got {value!r}")
    return s


def _count(value: int | None, what: str, minimum: int, *, infinite_ok: bool = False) -> int | None:
    if value is None and infinite_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be a whole number >= {minimum}, got {value!r}")
    return value


def _fmt(value: object) -> str:
    """Format a parameter value the way :func:`parse` reads it back."""
    if value is None:
        return "infinite"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class _Builtin(RestartStrategy):
    """Shared ``describe()`` for the four built-ins: ``name:param=value,...``."""

    name: ClassVar[str]
    #: parameter name -> kind ("int", "count", "float", "duration"), in Flink's order
    params: ClassVar[dict[str, str]] = {}

    def describe(self) -> str:
        parts = []
        for p, kind in self.params.items():
            v = getattr(self, p)
            parts.append(f"{p}={_fmt(v)}{'s' if kind == 'duration' else ''}")
        return f"{self.name}:{','.join(parts)}" if parts else self.name


class FixedDelay(_Builtin):
    """Flink ``fixed-delay``: up to ``attempts`` restarts in total, each after ``delay``.

    Failures are counted over the strategy's whole life and never reset; failure number
    ``attempts + 1`` gives up.
    """

    name = "fixed_delay"
    params = {"attempts": "int", "delay": "duration"}

    def __init__(self, attempts: int = 3, delay: Duration = 1.0):
        self.attempts = _count(attempts, "fixed_delay.attempts", 0)
        self.delay = _duration(delay, "fixed_delay.delay")
        self.failures = 0

    def on_failure(self, now: float | None = None) -> float | None:
        self.failures += 1
        return self.delay if self.failures <= self.attempts else None


class ExponentialDelay(_Builtin):
    """Flink ``exponential-delay`` (1.19+ semantics).

    The first failure waits ``initial_backoff``; each further one multiplies the backoff by
    ``backoff_multiplier``, capped at ``max_backoff``. A random ``± jitter_factor * backoff``
    is added, and the result is kept within ``[initial_backoff, max_backoff]``. When the job
    ran at least ``reset_backoff_threshold`` since its last restart, backoff and attempt count
    start over. More than ``attempts_before_reset_backoff`` consecutive failures (None:
    infinite) give up.
    """

    name = "exponential_delay"
    params = {
        "initial_backoff": "duration",
        "max_backoff": "duration",
        "backoff_multiplier": "float",
        "reset_backoff_threshold": "duration",
        "jitter_factor": "float",
        "attempts_before_reset_backoff": "count",
    }

    def __init__(
        self,
        initial_backoff: Duration = 1.0,
        max_backoff: Duration = "1 min",
        backoff_multiplier: float = 1.5,
        reset_backoff_threshold: Duration = "1 h",
        jitter_factor: float = 0.1,
        attempts_before_reset_backoff: int | None = None,
        rng: random.Random | None = None,
    ):
        self.initial_backoff = _duration(initial_backoff, "exponential_delay.initial_backoff", positive=True)
        self.max_backoff = _duration(max_backoff, "exponential_delay.max_backoff", positive=True)
        if self.initial_backoff > self.max_backoff:
            raise ConfigError("exponential_delay: initial_backoff cannot be higher than max_backoff")
        self.backoff_multiplier = float(backoff_multiplier)
        if self.backoff_multiplier < 1:
            raise ConfigError(f"exponential_delay.backoff_multiplier must be >= 1, got {backoff_multiplier!r}")
        self.reset_backoff_threshold = _duration(
            reset_backoff_threshold, "exponential_delay.reset_backoff_threshold", positive=True
        )
        self.jitter_factor = float(jitter_factor)
        if not 0 <= self.jitter_factor <= 1:
            raise ConfigError(f"exponential_delay.jitter_factor must be within [0, 1], got {jitter_factor!r}")
        self.attempts_before_reset_backoff = _count(
            attempts_before_reset_backoff, "exponential_delay.attempts_before_reset_backoff", 1,
            infinite_ok=True,
        )
        self.rng = rng or random.Random()
        self.attempt = 0  # consecutive failures since the last reset
        self._backoff = self.initial_backoff  # un-jittered backoff of the latest attempt
        self._restart_at: float | None = None  # when the latest restart was due

    def on_failure(self, now: float | None = None) -> float | None:
        now = _now(now)
        if self._restart_at is None or now - self._restart_at >= self.reset_backoff_threshold:
            self.attempt, self._backoff = 0, self.initial_backoff
        else:
            self._backoff = min(self._backoff * self.backoff_multiplier, self.max_backoff)
        self.attempt += 1
        limit = self.attempts_before_reset_backoff
        if limit is not None and self.attempt > limit:
            return None
        spread = self._backoff * self.jitter_factor
        jitter = self.rng.uniform(-spread, spread) if spread else 0.0
        delay = max(self.initial_backoff, min(self._backoff + jitter, self.max_backoff))
        self._restart_at = now + delay
        return delay


class FailureRate(_Builtin):
    """Flink ``failure-rate``: restart after ``delay`` unless more than
    ``max_failures_per_interval`` failures fall within the sliding ``failure_rate_interval``
    (a failure exactly ``failure_rate_interval`` ago still counts)."""

    name = "failure_rate"
    params = {"max_failures_per_interval": "int", "failure_rate_interval": "duration", "delay": "duration"}

    def __init__(
        self,
        max_failures_per_interval: int = 1,
        failure_rate_interval: Duration = "1 min",
        delay: Duration = 1.0,
    ):
        self.max_failures_per_interval = _count(
            max_failures_per_interval, "failure_rate.max_failures_per_interval", 1
        )
        self.failure_rate_interval = _duration(
            failure_rate_interval, "failure_rate.failure_rate_interval", positive=True
        )
        self.delay = _duration(delay, "failure_rate.delay")
        self._failures: deque[float] = deque()

    def on_failure(self, now: float | None = None) -> float | None:
        now = _now(now)
        self._failures.append(now)
        while now - self._failures[0] > self.failure_rate_interval:
            self._failures.popleft()
        return None if len(self._failures) > self.max_failures_per_interval else self.delay


class NoRestart(_Builtin):
    """Flink ``none``: the first failure is final."""

    name = "none"

    def on_failure(self, now: float | None = None) -> float | None:
        return None


def fixed_delay(attempts: int = 3, delay: Duration = 1.0) -> FixedDelay:
    """Restart up to ``attempts`` times in total, ``delay`` apart; the count never resets (Flink)."""
    return FixedDelay(attempts, delay)


def exponential_delay(
    initial_backoff: Duration = 1.0,
    max_backoff: Duration = "1 min",
    backoff_multiplier: float = 1.5,
    reset_backoff_threshold: Duration = "1 h",
    jitter_factor: float = 0.1,
    attempts_before_reset_backoff: int | None = None,
    rng: random.Random | None = None,
) -> ExponentialDelay:
    """Growing delays with jitter, reset after a quiet period (defaults are Flink's)."""
    return ExponentialDelay(
        initial_backoff, max_backoff, backoff_multiplier, reset_backoff_threshold,
        jitter_factor, attempts_before_reset_backoff, rng,
    )


def default_strategy() -> ExponentialDelay:
    """onceflow's default: :func:`exponential_delay` with Flink's defaults (1 s growing by 1.5×
    to 1 min, ±10 % jitter, reset after 1 h without a failure, no limit on attempts). A job
    with a lasting fault keeps retrying at most once a minute, logging each retry, and
    never ends on failures spread over its life; errors a restart cannot fix (configuration,
    fencing) still stop it at once."""
    return ExponentialDelay()


def failure_rate(
    max_failures_per_interval: int = 1, failure_rate_interval: Duration = "1 min", delay: Duration = 1.0
) -> FailureRate:
    """Give up when failures come faster than ``max_failures_per_interval`` per interval."""
    return FailureRate(max_failures_per_interval, failure_rate_interval, delay)


def no_restart() -> NoRestart:
    """Never restart."""
    return NoRestart()


# ---- CLI specs -------------------------------------------------------------------------

STRATEGIES: dict[str, type[_Builtin]] = {
    c.name: c for c in (FixedDelay, ExponentialDelay, FailureRate, NoRestart)
}
# Flink's spellings (restart-strategy.type) are accepted too.
DEFAULT_SPEC = "default"  # ``--restart-strategy default``: :func:`default_strategy`
_ALIASES = {"fixeddelay": "fixed_delay", "exponentialdelay": "exponential_delay",
            "failurerate": "failure_rate", "off": "none", "disable": "none", "no_restart": "none"}
_KIND_HINT = {"int": "<int>", "count": "<int|infinite>", "float": "<number>", "duration": "<duration>"}


def _usage() -> str:
    forms = []
    for name, cls in STRATEGIES.items():
        args = ",".join(f"{p}={_KIND_HINT[k]}" for p, k in cls.params.items())
        forms.append(f"{name}:{args}" if args else name)
    return ("valid: " + "; ".join(forms) + f"; {DEFAULT_SPEC} (every parameter is optional; "
            "durations like 10s, 1min)")


def _convert(value: str, kind: str, what: str) -> object:
    try:
        if kind == "int":
            return int(value)
        if kind == "count":
            return None if value.lower() in INFINITE else int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        raise ConfigError(f"{what}: cannot read {value!r} as {_KIND_HINT[kind]}") from None
    return value  # durations are parsed (and checked) by the constructor


def parse(spec: str) -> RestartStrategy:
    """Build a strategy from ``name[:param=value,...]``, e.g. ``fixed_delay:attempts=5,delay=2s``.

    Names and parameters may use Flink's dashes (``fixed-delay``, ``failure-rate-interval``);
    ``default`` is :func:`default_strategy`. Raises ConfigError, listing the valid names and
    parameters, for anything it cannot read.
    """
    head, _, body = (spec or "").strip().partition(":")
    key = head.strip().lower().replace("-", "_")
    if key == DEFAULT_SPEC:
        if body.strip():
            raise ConfigError(f"restart strategy {DEFAULT_SPEC!r} takes no parameters; give "
                              f"'exponential_delay:...' to change them; {_usage()}")
        return default_strategy()
    key = _ALIASES.get(key, key)
    cls = STRATEGIES.get(key)
    if cls is None:
        raise ConfigError(f"unknown restart strategy {head.strip()!r}; {_usage()}")
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        param, eq, value = item.partition("=")
        param = param.strip().lower().replace("-", "_")
        if not eq or not value.strip():
            raise ConfigError(f"restart strategy {cls.name}: expected param=value, got {item!r}; {_usage()}")
        if param not in cls.params:
            known = ", ".join(cls.params) or "none"
            raise ConfigError(f"restart strategy {cls.name} has no parameter {param!r} (known: {known})")
        if param in kwargs:
            raise ConfigError(f"restart strategy {cls.name}: {param} given twice")
        kwargs[param] = _convert(value.strip(), cls.params[param], f"{cls.name}.{param}")
    return cls(**kwargs)
