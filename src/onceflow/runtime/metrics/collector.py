"""The Prometheus collector: turns a :class:`JobMetrics` into metric families at scrape time,
reading memory only. Names follow Prometheus' conventions (``onceflow_`` prefix, ``_total``
counters, ``_seconds``/``_bytes`` units) and carry the onceflow job's name as ``job_name``
(as Flink's reporter does: Prometheus' ``job`` is the scrape job's); Flink's names (``onceflow_job_<flinkName>``) are
exported too unless ``ONCEFLOW_METRICS_FLINK_NAMES=0`` (see docs/metrics.md for the mapping)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from onceflow.runtime.metrics.state import Histogram, JobMetrics
from onceflow.settings import setting

FLINK_NAMES_ENV = "ONCEFLOW_METRICS_FLINK_NAMES"


class Collector:
    """A prometheus_client collector over one job's in-memory metrics."""

    def __init__(self, metrics: JobMetrics, flink_names: bool | None = None):
        self.m = metrics
        self.flink = setting(FLINK_NAMES_ENV, "1") != "0" if flink_names is None else flink_names

    def collect(self) -> Iterator[Any]:
        m = self.m
        with m.lock:
            yield from self._standard(m)
            if self.flink:
                yield from self._flink(m)

    def describe(self) -> list:
        return []  # families vary (labels per operator and partition): no registration-time check

    def _standard(self, m: JobMetrics) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        job = [m.job]

        def one(cls, name: str, doc: str, value: float | None, unit: str = ""):
            fam = cls(f"onceflow_{name}", doc, labels=["job_name"], unit=unit)
            if value is not None:
                fam.add_metric(job, value)
            return fam

        def hist(name: str, doc: str, h: Histogram):
            fam = HistogramMetricFamily(f"onceflow_{name}", doc, labels=["job_name"], unit="seconds")
            fam.add_metric(job, h.buckets(), h.total)
            return fam

        yield one(CounterMetricFamily, "batches", "micro-batches committed (replays included)", m.batches)
        yield one(CounterMetricFamily, "batches_failed",
                  "micro-batches that failed while running (the query failed or timed out)", m.batches_failed)
        restarts = CounterMetricFamily("onceflow_restarts", "restarts: query (in the driver) or process "
                                       "(the driver process, by onceflow run)", labels=["job_name", "scope"])
        for scope, n in sorted(m.restarts.items()):
            restarts.add_metric([m.job, scope], n)
        yield restarts
        yield one(CounterMetricFamily, "lease_lost", "times a driver lost the job's lease to another "
                  "(LeaseLost or fenced)", m.lease_lost)
        yield one(CounterMetricFamily, "records_in", "records the query processed, replays included", m.records_in)
        yield one(CounterMetricFamily, "records_out", "records the sink committed", m.records_out)
        yield one(CounterMetricFamily, "replayed_batches_skipped",
                  "replayed batches the sink had already committed (skipped)", m.replay_batches)
        yield one(CounterMetricFamily, "replayed_records_skipped",
                  "records of replayed batches the sink had already committed (skipped)", m.replay_records)
        yield hist("batch_duration", "micro-batch duration (Spark's triggerExecution)", m.batch_seconds)
        yield hist("commit_duration", "sink commit duration (decision record and commit)", m.commit_seconds)
        yield one(GaugeMetricFamily, "last_commit_timestamp", "wall time of the last committed batch "
                  "(epoch seconds)", m.last_commit_ts, unit="seconds")
        yield one(GaugeMetricFamily, "last_commit_age", "seconds since the last committed batch "
                  "(at scrape time)", m.commit_age_s(), unit="seconds")
        yield one(GaugeMetricFamily, "newest_event_timestamp", "event time of the newest event a committed "
                  "batch read (Job.event_time; epoch seconds)", m.newest_event_ts, unit="seconds")
        yield one(GaugeMetricFamily, "newest_event_age", "seconds from the newest committed event's time to "
                  "now (at scrape time): exactly-once freshness", m.event_age_s(), unit="seconds")
        yield one(GaugeMetricFamily, "last_batch_id", "id of the last batch committed", m.last_batch)
        yield one(GaugeMetricFamily, "uptime", "seconds since this driver started",
                  time.time() - m.started, unit="seconds")
        lag = GaugeMetricFamily("onceflow_source_lag_records", "records the source has beyond the last "
                                "batch, per topic and partition (as of that batch's planning)",
                                labels=["job_name", "topic", "partition"])
        for (topic, part), n in sorted(m.lag.items()):
            lag.add_metric([m.job, topic, part], n)
        yield lag
        behind = GaugeMetricFamily("onceflow_source_lag_seconds", "seconds the last batch ends behind the "
                                   "source's tip, per stream and shard (Kinesis: 0 at the tip, else the "
                                   "age of the last record planned)", labels=["job_name", "stream", "shard"])
        for (stream, shard), ms in sorted(m.lag_ms.items()):
            behind.add_metric([m.job, stream, shard], ms / 1000)
        yield behind
        on_ckpt = GaugeMetricFamily("onceflow_state_checkpoint_bytes", "state bytes on the checkpoint per "
                                    "operator (files Spark reads to load the last measured version)",
                                    labels=["job_name", "operator", "name"])
        rows = GaugeMetricFamily("onceflow_state_rows", "keys (rows) in each operator's state store",
                                 labels=["job_name", "operator", "name"])
        memory = GaugeMetricFamily("onceflow_state_memory_bytes", "the state store's in-memory estimate "
                                   "(Spark's memoryUsedBytes)", labels=["job_name", "operator", "name"])
        for op, o in sorted(m.operators.items()):
            labels = [m.job, str(op), o.name]
            for fam, v in ((on_ckpt, o.checkpoint_bytes), (rows, o.rows), (memory, o.memory_bytes)):
                if v is not None:
                    fam.add_metric(labels, v)
        yield from (on_ckpt, rows, memory)

    def _flink(self, m: JobMetrics) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def metric(cls, name: str, doc: str, value: float):
            fam = cls(f"onceflow_job_{name}", doc, labels=["job"])
            fam.add_metric([m.job], value)
            return fam

        yield metric(GaugeMetricFamily, "numberOfCompletedCheckpoints", "Flink name of onceflow_batches_total",
                     m.batches)
        yield metric(GaugeMetricFamily, "numberOfFailedCheckpoints",
                     "Flink name of onceflow_batches_failed_total", m.batches_failed)
        yield metric(GaugeMetricFamily, "lastCheckpointDuration", "last micro-batch duration (ms)",
                     m.last_duration_ms)
        yield metric(GaugeMetricFamily, "lastCheckpointSize", "state bytes on the checkpoint, all operators",
                     m.state_bytes or 0)
        yield metric(GaugeMetricFamily, "numRestarts", "Flink name of sum(onceflow_restarts_total)",
                     sum(m.restarts.values()))
        yield metric(GaugeMetricFamily, "uptime", "ms since this driver started", int((time.time() - m.started) * 1000))
        yield metric(CounterMetricFamily, "numRecordsIn", "Flink name of onceflow_records_in_total", m.records_in)
        yield metric(CounterMetricFamily, "numRecordsOut", "Flink name of onceflow_records_out_total", m.records_out)
        yield metric(CounterMetricFamily, "replayedRecordsSkipped",
                     "old name of onceflow_replayed_records_skipped_total", m.replay_records)
        yield metric(CounterMetricFamily, "replayedBatchesSkipped",
                     "old name of onceflow_replayed_batches_skipped_total", m.replay_batches)
