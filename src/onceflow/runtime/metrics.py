"""Prometheus metrics of the active driver (``onceflow run --metrics-port N``).

Computed from the checkpoint's event log, which every driver, commit process and restart of
the job appends to, so the figures span restarts and driver takeovers. Flink's names where
Flink has the metric (one micro-batch is one checkpoint), prefixed ``onceflow_job_``:

- ``numberOfCompletedCheckpoints``: micro-batches committed;
- ``numberOfFailedCheckpoints``: micro-batches that failed (each leads to a restart);
- ``lastCheckpointDuration`` (ms) and ``lastCheckpointSize`` (state bytes) of the last batch;
- ``numRestarts``; ``uptime`` (ms since this driver started);
- ``numRecordsIn``: records the query processed, replays after restarts included (counted
  when the driver records the batch's progress, up to a second after the sink's commit);
- ``numRecordsOut``: records the sink committed.

And the exactly-once figures no peer exports: ``onceflow_job_replayedRecordsSkipped`` (records of
batches replayed after a restart whose effects the sink had already committed, so skipped) and
``onceflow_job_replayedBatchesSkipped``. ``numRecordsIn - numRecordsOut`` is the work replays
cost. Only the active driver serves them; a promoted standby starts serving when it takes over.
"""

from __future__ import annotations

import threading
import time

from onceflow.checkpoint.eventlog import EventLog

PORT_ENV = "ONCEFLOW_METRICS_PORT"


class EventLogCollector:
    """A prometheus_client collector that tails the event log at every scrape."""

    def __init__(self, checkpoint_url: str, job: str, started: float | None = None):
        self.log, self.job = EventLog(checkpoint_url), job
        self.started = started or time.time()
        self._offset, self._lock = 0, threading.Lock()
        self.completed = self.failed = self.restarts = 0
        self.last_duration_ms = self.last_state_bytes = 0
        self.records_in = self.records_out = 0
        self.replay_batches = self.replay_records = 0
        self._batch_rows: dict[int, int] = {}  # recent batches' input rows, for skipped replays

    def update(self) -> None:
        with self._lock:
            events, self._offset = self.log.tail(self._offset)
            for e in events:
                kind = e.get("event")
                if kind == "batch":
                    self.completed += 1
                    rows = int(e.get("input_rows") or 0)
                    self.records_in += rows
                    self.last_duration_ms = int(e.get("duration_ms") or 0)
                    self.last_state_bytes = int(e.get("state_bytes") or 0)
                    if e.get("batch") is not None:
                        self._batch_rows[int(e["batch"])] = rows
                        if len(self._batch_rows) > 1000:
                            self._batch_rows.pop(min(self._batch_rows))
                elif kind == "restart":
                    self.restarts += 1
                    self.failed += 1
                elif kind == "sink_commit":
                    if e.get("replay"):
                        self.replay_batches += 1
                        self.replay_records += self._batch_rows.get(int(e.get("batch", -1)), 0)
                    else:
                        self.records_out += int(e.get("rows") or 0)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.update()
        labels = ["job"]

        def metric(cls, name: str, doc: str, value: float):
            m = cls(f"onceflow_job_{name}", doc, labels=labels)
            m.add_metric([self.job], value)
            return m

        yield metric(GaugeMetricFamily, "numberOfCompletedCheckpoints", "micro-batches committed", self.completed)
        yield metric(GaugeMetricFamily, "numberOfFailedCheckpoints", "micro-batches that failed", self.failed)
        yield metric(GaugeMetricFamily, "lastCheckpointDuration", "last micro-batch duration (ms)", self.last_duration_ms)
        yield metric(GaugeMetricFamily, "lastCheckpointSize", "state bytes after the last micro-batch", self.last_state_bytes)
        yield metric(GaugeMetricFamily, "numRestarts", "restarts (query and driver process)", self.restarts)
        yield metric(GaugeMetricFamily, "uptime", "ms since this driver started", int((time.time() - self.started) * 1000))
        yield metric(CounterMetricFamily, "numRecordsIn", "records processed, replays included", self.records_in)
        yield metric(CounterMetricFamily, "numRecordsOut", "records the sink committed", self.records_out)
        yield metric(CounterMetricFamily, "replayedRecordsSkipped",
                     "records of replayed batches the sink had already committed (skipped)", self.replay_records)
        yield metric(CounterMetricFamily, "replayedBatchesSkipped",
                     "replayed batches the sink had already committed (skipped)", self.replay_batches)


def serve(port: int, checkpoint_url: str, job: str, started: float | None = None):
    """Start the HTTP endpoint (``/metrics``) in a daemon thread; returns the collector."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    collector = EventLogCollector(checkpoint_url, job, started)
    registry.register(collector)
    start_http_server(port, registry=registry)
    return collector
