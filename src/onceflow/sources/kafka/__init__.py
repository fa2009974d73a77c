"""Kafka source for Structured Streaming on PySpark's Python Data Source API (confluent-kafka).

Guarantees:
- Offsets live only in Spark's checkpoint, as Spark's own Kafka source writes them:
  ``{"topic": {"0": 42}}`` = next offset to read per partition. Batch N reads exactly the
  ranges ``[offsets/N-1, offsets/N)`` on every replay; nothing is read back from Kafka's
  consumer groups (a savepoint/rollback must be able to rewind the source).
- ``startingOffsets`` / ``startingTimestamp`` only decide the very first batch of a new
  checkpoint; a restored query always continues from its checkpointed offsets.
- ``read_committed`` by default. Transaction markers leave offset gaps; a range ends when the
  consumer's position reaches its end offset, so gaps are never mistaken for data loss.
- Records removed before they were read (retention, topic re-created) fail the query with the
  topic, partition and offset range, unless ``failOnDataLoss=false``: then they are skipped,
  logged (WARNING, with a running count) and counted as ``source_data_loss`` events in the
  job's event log (``eventLog`` option; set automatically under a onceflow Job).
- Partitions that appear while running (new partitions, new topics matching the pattern) are
  read from offset 0; a partition whose log no longer starts at 0 then counts as data loss.
- ``groupId`` commits processed offsets after each batch for lag dashboards only.
"""


from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from onceflow.kafka_client import redact
from onceflow.sources.kafka.cluster import KafkaCluster
from onceflow.sources.kafka.fetch import KafkaInputPartition, read_range
from onceflow.sources.kafka.options import (
    NAME,
    SCHEMA,
    KafkaDataLossError,
    Offsets,
    Settings,
    cap_offsets,
    parse_options,
)
from onceflow.sources.kafka.reader import KafkaStreamReader

__all__ = ["NAME", "SCHEMA", "KafkaCluster", "KafkaDataLossError", "KafkaInputPartition", "KafkaSource",
           "KafkaSourceDataSource", "KafkaStreamReader", "Offsets", "Settings", "cap_offsets",
           "parse_options", "read_range"]

log = logging.getLogger("onceflow.sources.kafka")


class KafkaSourceDataSource(DataSource):
    """``spark.readStream.format("onceflow-kafka")`` with Spark's Kafka option names."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        parse_options(self.options)  # bad options fail at load(), not at the first batch
        return SCHEMA

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        settings = parse_options(self.options)
        reader = KafkaStreamReader(settings, schema)
        reader.cluster.check()
        return reader


@dataclass
class KafkaSource:
    """User-facing configuration of the Kafka source; ``load(spark)`` returns the stream.

    ``load`` validates everything it can before Spark starts (options, reachability of the
    brokers within ``metadata_timeout_ms``, existence of the topics) and raises ConfigError
    (SourceError when the brokers cannot be reached: an outage, retried by restarts).
    """

    bootstrap_servers: str
    topics: str | Sequence[str] | None = None
    pattern: str | None = None
    starting_offsets: str | Mapping[str, Mapping[str, int]] = "latest"
    starting_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    isolation_level: str = "read_committed"
    fail_on_data_loss: bool = True
    group_id: str | None = None
    consumer_options: Mapping[str, str] = field(default_factory=dict)
    poll_timeout_ms: int = 120_000
    metadata_timeout_ms: int = 10_000
    event_log: str | None = None

    def __repr__(self) -> str:  # consumer_options may hold credentials (sasl.password, ...)
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        fields["consumer_options"] = redact(self.consumer_options)
        return f"KafkaSource({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def options(self) -> dict[str, str]:
        """The Spark options this configuration stands for."""
        opts = {f"kafka.{k}": str(v) for k, v in self.consumer_options.items()}
        opts["kafka.bootstrap.servers"] = self.bootstrap_servers
        opts["kafka.isolation.level"] = self.isolation_level
        if self.topics:
            opts["subscribe"] = self.topics if isinstance(self.topics, str) else ",".join(self.topics)
        if self.pattern:
            opts["subscribePattern"] = self.pattern
        opts["startingOffsets"] = (self.starting_offsets if isinstance(self.starting_offsets, str)
                                   else json.dumps(self.starting_offsets))
        opts["failOnDataLoss"] = str(self.fail_on_data_loss).lower()
        opts["pollTimeoutMs"] = str(self.poll_timeout_ms)
        opts["metadataTimeoutMs"] = str(self.metadata_timeout_ms)
        for name, value in (("startingTimestamp", self.starting_timestamp),
                            ("maxOffsetsPerTrigger", self.max_offsets_per_trigger),
                            ("groupId", self.group_id), ("eventLog", self.event_log)):
            if value is not None:
                opts[name] = str(value)
        return opts

    def validate(self) -> Settings:
        """Check options and the cluster now; raise ConfigError with what to fix."""
        settings = parse_options(self.options())
        KafkaCluster(settings).check()
        return settings

    def load(self, spark):
        """Validate, then ``spark.readStream.format("onceflow-kafka").options(...).load()``.

        Under a onceflow Job, ``event_log`` defaults to the job's checkpoint directory."""
        self.validate()
        opts = self.options()
        if self.event_log is None:
            ckpt = spark.conf.get("spark.onceflow.checkpointLocation", None)
            if ckpt:
                opts["eventLog"] = ckpt
        return spark.readStream.format(NAME).options(**opts).load()

