"""Kafka sink on confluent-kafka: transactional producers per (lineage, partition) with markers,
decisions fenced by driver epochs.

Kafka cannot hold a transaction open across producer sessions (no cross-session prepare in
the client), so the two-phase commit of docs/protocol.md maps onto Kafka like this:

* **epoch** (driver, when the sink opens): the driver's transactional producer
  ``onceflow-<sink_id>-<lineage>-driver`` calls ``init_transactions()``, which fences every
  older driver producer of the lineage and aborts its open transaction, then commits an
  ``epoch`` marker one higher than the latest of (sink, lineage). The runner hands the epoch
  to tasks and to the commit runner (option ``epoch``).
* **pre-commit = commit per task.** Each Spark task (batch N, partition p) uses a transactional
  producer with the stable ``transactional.id`` ``onceflow-<sink_id>-<lineage>-p<p>``;
  ``init_transactions()`` fences every older attempt of the same partition. A task whose epoch
  is older than the latest epoch marker stops (FencedError) before producing. Otherwise, if no
  *partition* marker of (N, p) is committed, it produces the rows and, last, that marker, and
  commits the Kafka transaction: **a batch becomes visible partition by partition, not
  atomically**, to ``read_committed`` consumers. A replay skips committed partitions.
* **decide** (driver) writes a *decision* marker carrying the driver's epoch in a transaction
  of the driver producer, after reading that no newer epoch marker exists and that the batch
  is undecided (or decided with this very decision). A newer driver's ``init_transactions``
  fences that producer, so check and write act as one step: a paused driver that wakes up
  after a successor opened gets FencedError and writes nothing. Readers ignore a decision
  that appears in the log after an epoch marker with a higher epoch.
* **commit** is a no-op (visible since the tasks committed); **abort** cannot un-commit a
  partition that is already visible: the batch is replayed after the restart and its
  committed partitions are skipped.

Guarantees: ``exactly_once`` (default): every output record is committed exactly once per
lineage for ``read_committed`` consumers, with the same conditions as everywhere in onceflow
(replayable source, deterministic transform *and deterministic partitioning* of the batch).
It is only offered when the broker hides aborted transactional records from
``read_committed`` consumers: :func:`probe` checks that before the first query starts and the
sink refuses to start otherwise (tansu, for one, does not filter them). ``at_least_once``
(explicit): idempotent, non-transactional producer; replays write their rows again.

Modules: ``common`` (names, reachability), ``probe`` (probe, doctor), ``markers`` (the marker
topic), ``producers`` (producer caches, produce loop), ``sink`` (the data source), ``config``
(:class:`KafkaSink`); the Kafka client plumbing shared with the source is
:mod:`onceflow.kafka_client`.
"""

from __future__ import annotations

from onceflow.sinks.kafka.common import FORMAT, GUARANTEES, MARKER_TOPIC, PROBE_TOPIC
from onceflow.sinks.kafka.common import ensure_topic as _ensure_topic
from onceflow.sinks.kafka.config import KafkaSink
from onceflow.sinks.kafka.markers import MarkerLog, close_markers, ensure_marker_topic
from onceflow.sinks.kafka.probe import CheckResult, ProbeResult, cached_probe, doctor, probe
from onceflow.sinks.kafka.producers import close_producers
from onceflow.sinks.kafka.sink import KafkaSinkDataSource


def close_all() -> None:
    """Close this process's cached marker readers and producers (tests, short-lived CLIs)."""
    close_markers()
    close_producers()


__all__ = ["FORMAT", "GUARANTEES", "MARKER_TOPIC", "PROBE_TOPIC", "KafkaSink", "KafkaSinkDataSource",
           "ProbeResult", "CheckResult", "probe", "cached_probe", "doctor", "MarkerLog",
           "ensure_marker_topic", "close_all", "_ensure_topic"]
