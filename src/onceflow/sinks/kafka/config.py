"""The Kafka sink as users configure it: :class:`KafkaSink` (its options for ``writeStream``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from onceflow.kafka_client import redact
from onceflow.sinks.base import Sink
from onceflow.sinks.kafka.common import DEFAULT_TRANSACTION_TIMEOUT, FORMAT, MARKER_TOPIC
from onceflow.sinks.kafka.start import DEFAULT_STEP

#: the options of ``format("onceflow-kafka-sink")`` (shown by ``onceflow doctor`` and in errors)
OPTIONS_DOC = {
    "bootstrap_servers": "host:port[,host:port] of the Kafka cluster (required)",
    "topic": "topic to write to (else each row's topic column)",
    "key_column": "column holding the record key (default 'key'; optional in the input)",
    "value_column": "column holding the record value (default 'value')",
    "topic_column": "column holding a per-row topic (default 'topic'; used if present)",
    "mode": "exactly_once (default; transactions + markers) or at_least_once (explicit)",
    "producer_config": "JSON object of extra librdkafka producer properties (security, ...)",
    "sink_id": "name of this sink in the job, part of transactional ids and markers (default 'kafka')",
    "marker_topic": f"topic for markers (default {MARKER_TOPIC}; created compacted if missing)",
    "marker_partitions": ("partition count that routes a lineage's markers (default: the marker "
                          "topic's); pin it when partitions were added to the marker topic"),
    "marker_start_step": (f"offsets a lineage's marker start must move before the driver records "
                          f"it in the checkpoint, where new readers start (default {DEFAULT_STEP})"),
    "timeout": "seconds for metadata, flush, init_transactions, commit and marker reads (default 60)",
    "transaction_timeout": ("seconds a Kafka transaction may stay open, i.e. the longest a task "
                            "may take to produce its partition (transaction.timeout.ms; default "
                            f"{DEFAULT_TRANSACTION_TIMEOUT:g}; at most the broker's "
                            "transaction.max.timeout.ms)"),
    "skip_broker_probe": ("tests only: do not check that the broker hides aborted records; "
                          "exactly-once is then NOT verified (warning logged, event "
                          "'guarantee_unverified' in the job's event log)"),
    "serialize_commits": ("auto (default: true with skip_broker_probe), true or false: this "
                          "host's transaction ends on the broker take turns, for brokers that "
                          "wedge a partition when two end at once (tansu 0.6)"),
}


@dataclass
class KafkaSink(Sink):
    """Kafka sink for a :class:`~onceflow.Job` (or ``writeStream``).

    Input rows carry ``value`` (binary/string), optionally ``key``, ``topic``, ``partition``
    and ``headers``, as for Spark's Kafka sink. ``mode``: ``exactly_once`` (default;
    transactional producer per (lineage, partition) + markers, decisions fenced by driver
    epochs; refused on brokers whose read_committed shows aborted records) or
    ``at_least_once`` (explicit; no transactions). ``producer_config``: extra librdkafka
    properties (security, compression, ...). ``timeout``: seconds for each broker operation;
    ``transaction_timeout``: seconds a task's transaction may stay open (its produce time).
    """

    bootstrap_servers: str
    topic: str | None = None
    key_column: str = "key"
    value_column: str = "value"
    topic_column: str = "topic"
    mode: Literal["exactly_once", "at_least_once"] = "exactly_once"
    producer_config: Mapping[str, Any] = field(default_factory=dict)
    sink_id: str = "kafka"
    marker_topic: str = MARKER_TOPIC
    timeout: float = 60.0
    transaction_timeout: float = DEFAULT_TRANSACTION_TIMEOUT
    serialize_commits: bool | None = None
    #: partition count that routes markers (pin it after partitions were added to the topic)
    marker_partitions: int | None = None
    #: offsets a lineage's marker start moves before the driver records it (None: 1000)
    marker_start_step: int | None = None

    format_name = FORMAT

    def __repr__(self) -> str:
        return (f"KafkaSink({self.bootstrap_servers!r}, topic={self.topic!r}, mode={self.mode!r}, "
                f"sink_id={self.sink_id!r}, producer_config={redact(self.producer_config)!r})")

    def options(self) -> dict[str, str]:
        opts = {
            "bootstrap_servers": self.bootstrap_servers, "key_column": self.key_column,
            "value_column": self.value_column, "topic_column": self.topic_column,
            "mode": self.mode, "sink_id": self.sink_id, "marker_topic": self.marker_topic,
            "timeout": str(self.timeout),
        }
        if "transaction.timeout.ms" not in self.producer_config:
            opts["transaction_timeout"] = str(self.transaction_timeout)
        if self.topic:
            opts["topic"] = self.topic
        if self.marker_partitions is not None:
            opts["marker_partitions"] = str(self.marker_partitions)
        if self.marker_start_step is not None:
            opts["marker_start_step"] = str(self.marker_start_step)
        if self.serialize_commits is not None:
            opts["serialize_commits"] = str(self.serialize_commits).lower()
        if self.producer_config:
            opts["producer_config"] = json.dumps(dict(self.producer_config))
        return opts
