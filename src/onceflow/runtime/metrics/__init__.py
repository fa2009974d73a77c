"""Prometheus metrics of the active driver (``onceflow run --metrics-port N``); every metric, its
type, unit and the Flink-name mapping are in docs/metrics.md.

State is kept in memory and a scrape reads only memory:

* the driver's own events (committed batches with their duration, source lag and state size,
  failed batches, query restarts, a lost lease) update :class:`JobMetrics` as the runner
  appends them (:func:`event_log` gives the runner a log that does both);
* other processes' events (the sink's commit records, written by Spark's commit process; the
  supervisor's process restarts; earlier drivers' history) come from a
  :class:`~onceflow.runtime.metrics.follow.Follower` thread: one full read when serving starts,
  then a tail after each batch, rate-limited (never per scrape). It skips the events the runner
  applied when appending them.

Only the active driver serves them; a promoted standby starts serving when it takes over.
"""

from __future__ import annotations

import threading

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.runtime.metrics.collector import Collector
from onceflow.runtime.metrics.follow import Follower
from onceflow.runtime.metrics.progress import (
    StateSize,
    checkpoint_state_bytes,
    newest_event_ts,
    source_lag,
    source_lag_ms,
    state_operators,
)
from onceflow.runtime.metrics.state import JobMetrics

__all__ = ["PORT_ENV", "Collector", "Follower", "JobMetrics", "ObservedEventLog", "StateSize",
           "checkpoint_state_bytes", "event_log", "newest_event_ts", "serve", "source_lag", "source_lag_ms",
           "state_operators"]

PORT_ENV = "ONCEFLOW_METRICS_PORT"

#: jobs served by this process, by checkpoint URL: (their metrics, their follower)
_SERVED: dict[str, tuple[JobMetrics, Follower]] = {}
_SERVED_LOCK = threading.Lock()


class ObservedEventLog(EventLog):
    """An event log whose appends also update the served job's :class:`JobMetrics`."""

    def __init__(self, checkpoint: CheckpointDir | str, metrics: JobMetrics, follower: Follower | None = None):
        super().__init__(checkpoint)
        self.metrics, self.follower = metrics, follower

    def append(self, event: str, **fields) -> dict:
        with self.metrics.appending:  # the follower may read the line before it is applied here
            record = super().append(event, **fields)
            self.metrics.applied_on_append(record)
        if event == "batch" and self.follower is not None:
            self.follower.wake()  # the sink's commit record of this batch is in the log now
        return record


def event_log(checkpoint: CheckpointDir | str) -> EventLog:
    """The event log the runner appends to: observed when this process serves its metrics."""
    url = CheckpointDir.of(checkpoint).url
    with _SERVED_LOCK:
        served = _SERVED.get(url)
    return EventLog(checkpoint) if served is None else ObservedEventLog(checkpoint, *served)


def serve(port: int, checkpoint_url: str, job: str, started: float | None = None) -> JobMetrics:
    """Start the HTTP endpoint (``/metrics``) in a daemon thread and the event-log follower;
    returns the job's in-memory metrics."""
    from prometheus_client import CollectorRegistry, start_http_server

    metrics = JobMetrics(job, started)
    registry = CollectorRegistry()
    registry.register(Collector(metrics))
    start_http_server(port, registry=registry)
    follower = Follower(EventLog(checkpoint_url), metrics).start()
    with _SERVED_LOCK:
        _SERVED[CheckpointDir.of(checkpoint_url).url] = (metrics, follower)
    return metrics
