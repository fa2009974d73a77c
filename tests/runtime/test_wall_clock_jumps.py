"""The runner's idle and batch timers run on the monotonic clock: a wall clock that jumps by
minutes (NTP step, VM resume, a skewed host) neither ends a job as "idle" nor times out a batch.

Found while building ``onceflow verify``'s clock_skew fault, by reading the runner (no verify
run has shown it yet): ``stop_when_idle`` and ``batch_timeout_s`` compared ``time.time()``
readings, so a forward jump of 300 s during a moment without data made the job stop as if its
source were exhausted (exit 0, the rest of the stream never read), and one during a batch
timed the batch out.
"""

from __future__ import annotations

import threading
import time
import types

from onceflow.runtime import runner as runner_mod
from onceflow.runtime.runner import JobRunner


class _IdleQuery:
    """A streaming query between two triggers: no batch ran, the source reports no data."""

    def __init__(self):
        self.stopped = threading.Event()
        self.status = {"isTriggerActive": False, "isDataAvailable": False}
        self.recentProgress: list = []
        self.lastProgress = object()

    def awaitTermination(self, timeout: float) -> bool:
        return self.stopped.wait(timeout)

    def exception(self):
        return None

    def stop(self) -> None:
        self.stopped.set()


class _Clock:
    """``time`` with a wall clock that jumps ``offset`` seconds; monotonic clocks stay real."""

    def __init__(self):
        self.offset = 0.0

    def module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(time=lambda: time.time() + self.offset, monotonic=time.monotonic,
                                     sleep=time.sleep, perf_counter=time.perf_counter)


def _runner(idle_s: float, batch_timeout_s: float | None) -> JobRunner:
    r = JobRunner.__new__(JobRunner)
    r.job = types.SimpleNamespace(name="j", stop_when_idle=idle_s,
                                  checkpoint=types.SimpleNamespace(batch_timeout_s=batch_timeout_s))
    r.stop = threading.Event()
    r.events = types.SimpleNamespace(append=lambda *a, **k: None)
    return r


def test_a_wall_clock_jump_does_not_end_a_job_as_idle(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runner_mod, "time", clock.module())
    r, query = _runner(idle_s=60.0, batch_timeout_s=None), _IdleQuery()
    errors: list[BaseException] = []

    def monitor() -> None:
        try:
            r._monitor(query, time.time())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    time.sleep(0.8)  # idle since the first poll
    clock.offset = 300.0  # the host's clock steps 5 minutes ahead
    time.sleep(1.5)
    assert not query.stopped.is_set(), "the job was stopped as idle after 2 s of a 60 s idle timeout"
    r.stop.set()  # a requested stop still ends it
    t.join(5)
    assert query.stopped.is_set() and not t.is_alive() and not errors


def test_a_wall_clock_jump_does_not_time_out_a_running_batch(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runner_mod, "time", clock.module())
    r, query = _runner(idle_s=60.0, batch_timeout_s=120.0), _IdleQuery()
    query.status = {"isTriggerActive": True, "isDataAvailable": True}  # a batch is running
    errors: list[BaseException] = []

    def monitor() -> None:
        try:
            r._monitor(query, time.time())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    time.sleep(0.8)
    clock.offset = 300.0
    time.sleep(1.5)
    assert not errors and not query.stopped.is_set(), f"the batch was timed out after 2 s: {errors}"
    query.status = {"isTriggerActive": False, "isDataAvailable": False}
    r.stop.set()
    t.join(5)
    assert query.stopped.is_set() and not errors
