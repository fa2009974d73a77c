"""Restart strategies: Flink semantics, driven with explicit ``now`` (no sleeping, no clocks)."""

from __future__ import annotations

import random

import pytest

from onceflow.errors import ConfigError
from onceflow.runtime.restart import (
    ExponentialDelay,
    FailureRate,
    FixedDelay,
    NoRestart,
    exponential_delay,
    failure_rate,
    fixed_delay,
    no_restart,
    parse,
)


def test_fixed_delay_allows_exactly_attempts_restarts():
    s = fixed_delay(attempts=2, delay="500 ms")
    assert [s.on_failure(t) for t in (0, 100, 10_000, 10_001)] == [0.5, 0.5, None, None]


def test_fixed_delay_zero_attempts_never_restarts():
    assert fixed_delay(attempts=0).on_failure(0) is None


def test_exponential_delay_grows_and_caps_without_jitter():
    s = exponential_delay(initial_backoff=1, max_backoff=10, backoff_multiplier=2, jitter_factor=0)
    # failures right after each restart (well within the 1 h reset threshold)
    now, delays = 0.0, []
    for _ in range(6):
        d = s.on_failure(now)
        delays.append(d)
        now += d + 0.1
    assert delays == [1, 2, 4, 8, 10, 10]


def test_exponential_delay_resets_after_quiet_period():
    s = exponential_delay(initial_backoff=1, max_backoff=100, backoff_multiplier=2,
                          reset_backoff_threshold="1 min", jitter_factor=0)
    assert s.on_failure(0) == 1  # restart due at t=1
    assert s.on_failure(2) == 2  # ran 1 s: keeps growing; restart due at t=4
    assert s.on_failure(63.9) == 4  # ran 59.9 s < 60 s
    # restart due at 67.9; running 60 s from then resets the backoff and the attempt count
    assert s.on_failure(127.9) == 1
    assert s.attempt == 1


def test_exponential_delay_gives_up_after_consecutive_attempts_and_counts_again_after_reset():
    s = exponential_delay(initial_backoff=1, max_backoff=100, backoff_multiplier=2,
                          reset_backoff_threshold=50, jitter_factor=0, attempts_before_reset_backoff=2)
    assert s.on_failure(0) == 1
    assert s.on_failure(1.5) == 2
    assert s.on_failure(4) is None
    fresh = exponential_delay(initial_backoff=1, reset_backoff_threshold=50, jitter_factor=0,
                              attempts_before_reset_backoff=2)
    assert fresh.on_failure(0) == 1
    assert fresh.on_failure(100) == 1  # quiet for 99 s: attempt count starts over
    assert fresh.on_failure(101.5) is not None
    assert fresh.on_failure(103) is None


def test_exponential_delay_jitter_is_bounded_and_reproducible_with_a_seeded_rng():
    def run(seed: int) -> list[float]:
        s = exponential_delay(initial_backoff=10, max_backoff=1000, backoff_multiplier=2,
                              jitter_factor=0.25, rng=random.Random(seed))
        out, now = [], 0.0
        for _ in range(5):
            out.append(s.on_failure(now))
            now += out[-1] + 1
        return out

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c
    for delay, base in zip(a, [10, 20, 40, 80, 160], strict=True):
        assert max(10, base * 0.75) <= delay <= base * 1.25
    assert any(d != base for d, base in zip(a, [10, 20, 40, 80, 160], strict=True))


def test_exponential_delay_jitter_never_leaves_initial_and_max_bounds():
    s = exponential_delay(initial_backoff=1, max_backoff=2, backoff_multiplier=4,
                          jitter_factor=1, rng=random.Random(3))
    now = 0.0
    for _ in range(50):
        d = s.on_failure(now)
        assert 1 <= d <= 2
        now += d + 0.01


def test_exponential_delay_defaults_are_flinks():
    s = ExponentialDelay()
    assert (s.initial_backoff, s.max_backoff, s.backoff_multiplier, s.reset_backoff_threshold,
            s.jitter_factor, s.attempts_before_reset_backoff) == (1, 60, 1.5, 3600, 0.1, None)


def test_failure_rate_gives_up_when_more_than_max_failures_fall_in_the_interval():
    s = failure_rate(max_failures_per_interval=2, failure_rate_interval="10 s", delay=3)
    assert s.on_failure(0) == 3
    assert s.on_failure(5) == 3
    assert s.on_failure(10.5) == 3  # the failure at 0 slid out of the window (5, 10.5)
    assert s.on_failure(15) is None  # 5, 10.5, 15: three within 10 s


def test_failure_rate_window_includes_its_edge():
    s = failure_rate(max_failures_per_interval=1, failure_rate_interval=10, delay=0)
    assert s.on_failure(0) == 0
    assert s.on_failure(10) is None  # exactly one interval apart still counts (as in Flink)
    t = failure_rate(max_failures_per_interval=1, failure_rate_interval=10, delay=0)
    assert t.on_failure(0) == 0
    assert t.on_failure(10.001) == 0


def test_no_restart():
    assert no_restart().on_failure(0) is None
    assert no_restart().describe() == "none"


@pytest.mark.parametrize(
    ("spec", "cls", "attrs"),
    [
        ("fixed_delay:attempts=5,delay=2s", FixedDelay, {"attempts": 5, "delay": 2.0}),
        ("fixed-delay: attempts = 5 , delay = 1 min", FixedDelay, {"attempts": 5, "delay": 60.0}),
        ("exponential_delay", ExponentialDelay, {"initial_backoff": 1.0, "max_backoff": 60.0}),
        ("exponential-delay:initial-backoff=500ms,backoff_multiplier=2,attempts_before_reset_backoff=4",
         ExponentialDelay, {"initial_backoff": 0.5, "backoff_multiplier": 2.0,
                            "attempts_before_reset_backoff": 4}),
        ("failure_rate:max_failures_per_interval=3,failure_rate_interval=5min,delay=10s", FailureRate,
         {"max_failures_per_interval": 3, "failure_rate_interval": 300.0, "delay": 10.0}),
        ("none", NoRestart, {}),
        ("off", NoRestart, {}),
    ],
)
def test_parse_good_specs(spec, cls, attrs):
    s = parse(spec)
    assert type(s) is cls
    for k, v in attrs.items():
        assert getattr(s, k) == v


@pytest.mark.parametrize(
    "strategy",
    [fixed_delay(4, 0.25), exponential_delay(2, "3 min", 2.5, "10 min", 0.3, 7), exponential_delay(),
     failure_rate(3, "5 min", "10 s"), no_restart()],
)
def test_describe_round_trips_through_parse(strategy):
    again = parse(strategy.describe())
    assert type(again) is type(strategy) and again.describe() == strategy.describe()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fixed", "unknown restart strategy 'fixed'"),
        ("", "unknown restart strategy ''"),
        ("fixed_delay:tries=3", "has no parameter 'tries' (known: attempts, delay)"),
        ("fixed_delay:attempts", "expected param=value"),
        ("fixed_delay:attempts=three", "fixed_delay.attempts: cannot read 'three'"),
        ("fixed_delay:delay=soon", "cannot read 'soon' as a duration"),
        ("fixed_delay:attempts=1,attempts=2", "attempts given twice"),
        ("exponential_delay:jitter_factor=2", "jitter_factor must be within [0, 1]"),
        ("exponential_delay:initial_backoff=2min,max_backoff=1min", "initial_backoff cannot be higher"),
        ("failure_rate:max_failures_per_interval=0", "must be a whole number >= 1"),
        ("none:attempts=1", "has no parameter 'attempts'"),
    ],
)
def test_parse_bad_specs(spec, message):
    with pytest.raises(ConfigError) as e:
        parse(spec)
    assert message in str(e.value)


def test_unknown_name_lists_valid_strategies_and_parameters():
    with pytest.raises(ConfigError) as e:
        parse("exponential")
    text = str(e.value)
    for part in ("fixed_delay:attempts=<int>,delay=<duration>", "exponential_delay:initial_backoff=",
                 "attempts_before_reset_backoff=<int|infinite>", "failure_rate:max_failures_per_interval=",
                 "none"):
        assert part in text


def test_job_module_still_exposes_the_duration_parser():
    from onceflow.job import seconds

    assert seconds("1 min", "x") == 60 and seconds("500ms", "x") == 0.5


# ---- the default: resets after a quiet period (issue 28, point 14) ---------------------

MONTH = 30 * 24 * 3600.0


def test_the_default_survives_failures_months_apart():
    """Four outages a season apart: the old default (fixed_delay(3), counting over the whole
    life) gave up on the 4th; the default now starts over after each quiet hour."""
    from onceflow.job import CheckpointConfig, Job

    job = Job("j", source=lambda spark: None, sink=object(), checkpoint=CheckpointConfig("/tmp/x"))
    strategy = job.restart_strategy
    delays = [strategy.on_failure(t) for t in (0.0, 3 * MONTH, 6 * MONTH, 9 * MONTH, 12 * MONTH)]
    assert None not in delays, f"{strategy.describe()} ended the job: {delays}"
    assert all(1 <= d <= 1.1 for d in delays)  # each one the first of its own series
    # fixed_delay keeps Flink's semantics (documented): its count never resets
    old = fixed_delay(attempts=3, delay=1)
    assert [old.on_failure(t) for t in (0.0, 3 * MONTH, 6 * MONTH, 9 * MONTH)] == [1, 1, 1, None]


def test_the_default_resets_only_after_a_quiet_hour():
    s = parse("default")
    s.jitter_factor = 0  # exact delays; the reset rule is what is checked
    now, delays = 0.0, []
    for _ in range(4):  # a burst: each failure soon after its restart
        delays.append(s.on_failure(now))
        now += delays[-1] + 60
    assert delays == [1, 1.5, 2.25, 3.375] and s.attempt == 4
    restart_due = now - 60
    assert s.on_failure(restart_due + 3599) == 3.375 * 1.5  # ran 59:59: still the same series
    restart_due += 3599 + 3.375 * 1.5
    assert s.on_failure(restart_due + 3600) == 1 and s.attempt == 1  # ran a full hour: reset


def test_the_default_spec_is_the_jobs_default_and_takes_no_parameters():
    from onceflow.runtime.restart import default_strategy

    assert parse("default").describe() == default_strategy().describe() == ExponentialDelay().describe()
    with pytest.raises(ConfigError, match="takes no parameters"):
        parse("default:initial_backoff=2s")
