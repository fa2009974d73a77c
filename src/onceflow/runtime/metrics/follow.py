"""Events other processes append (the sink's commit process, the supervisor, earlier drivers),
brought into a :class:`JobMetrics` by a background thread, never by a scrape.

The thread reads the whole log once when the driver starts serving (so counters span restarts
and takeovers), then tails it: woken by each batch this driver records (the sink's commit
record is written before Spark reports the batch), at most every ``min_s`` seconds (1 s on a
local filesystem, 15 s on object stores, where a tail is a listing), and at least every
``idle_s`` seconds. Events the driver applied as it appended them are skipped
(:meth:`JobMetrics.apply_logged`).
"""

from __future__ import annotations

import logging
import threading

from onceflow.checkpoint.eventlog import EventLog, Offset
from onceflow.runtime.metrics.state import JobMetrics
from onceflow.settings import setting

log = logging.getLogger("onceflow.metrics")

#: minimum seconds between two tails of the event log (default: 1 local, 15 object stores)
TAIL_ENV = "ONCEFLOW_METRICS_TAIL_S"


class Follower:
    """Tails ``log`` into ``metrics`` in a daemon thread; :meth:`wake` asks for a tail soon."""

    def __init__(self, log_: EventLog, metrics: JobMetrics, min_s: float | None = None, idle_s: float = 60.0):
        self.log, self.metrics = log_, metrics
        default = 1.0 if log_.local else 15.0
        self.min_s = float(setting(TAIL_ENV, str(default))) if min_s is None else min_s
        self.idle_s = max(idle_s, self.min_s)
        self.offset: Offset = 0
        self.tails = 0  # how many times the log was read (for tests)
        self._wake, self._stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="onceflow-metrics-follower", daemon=True)

    def start(self) -> Follower:
        self.thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def step(self) -> int:
        """One tail: apply the events new in the log; returns how many were read."""
        events, self.offset = self.log.tail(self.offset)
        self.tails += 1
        for e in events:
            self.metrics.apply_logged(e)
        return len(events)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - an unreachable store: figures wait, job runs
                log.debug("metrics: event log %s not read: %s", self.log.url, e)
            self._wake.wait(self.idle_s)
            self._wake.clear()
            if self._stop.wait(self.min_s):
                return
