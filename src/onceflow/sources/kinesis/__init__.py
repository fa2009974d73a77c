"""Kinesis source for Structured Streaming on PySpark's Python Data Source API (boto3).

Guarantees:
- Shards are the partitions. Positions live only in Spark's checkpoint, as
  ``{"stream": {"shardId-000000000000": "<sequence number>"}}`` (the last record read per
  shard); no KCL lease table, no DynamoDB, nothing stored in AWS. Batch N reads exactly the
  records after ``offsets/N-1`` up to and including ``offsets/N`` on every replay
  (a savepoint or rollback rewinds the source with the state and the sink's decisions).
- ``startingPosition`` (TRIM_HORIZON, LATEST, AT_TIMESTAMP, per-shard sequence numbers) only
  decides where a new checkpoint starts; it is pinned to concrete positions once (and kept
  in the checkpoint under a onceflow Job), and a restored query always continues from its
  checkpointed positions.
- Resharding: a child shard is read only once all its parents are read to their end
  (``SHARD_END``) in an earlier batch; shards that appear are read from TRIM_HORIZON.
- Throttling is retried with back-off and counted (WARNING lines, ``source_throttled``
  events); records lost before they were read (retention, stream re-created) fail the query
  unless ``failOnDataLoss=false``, and are counted as ``source_data_loss`` events either way.
- AWS credentials come from options or boto3's chain and are never printed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from onceflow.kafka_client import redact
from onceflow.sources.kinesis.fetch import KinesisInputPartition, read_range
from onceflow.sources.kinesis.options import (
    NAME,
    SCHEMA,
    KinesisDataLossError,
    Settings,
    parse_options,
)
from onceflow.sources.kinesis.reader import KinesisStreamReader

__all__ = ["NAME", "SCHEMA", "KinesisDataLossError", "KinesisInputPartition", "KinesisSource",
           "KinesisSourceDataSource", "KinesisStreamReader", "Settings", "parse_options", "read_range"]

log = logging.getLogger("onceflow.sources.kinesis")


class KinesisSourceDataSource(DataSource):
    """``spark.readStream.format("onceflow-kinesis")`` (options: ``kinesis.options.OPTIONS``)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        parse_options(self.options)  # bad options fail at load(), not at the first batch
        return SCHEMA

    def streamReader(self, schema: StructType) -> KinesisStreamReader:
        reader = KinesisStreamReader(parse_options(self.options), schema)
        reader.check()
        return reader


@dataclass
class KinesisSource:
    """User-facing configuration of the Kinesis source; ``load(spark)`` returns the stream.

    ``load`` validates everything it can before Spark starts: options, credentials, the
    endpoint, the streams and any shards named in ``starting_position`` (ConfigError; an
    unreachable endpoint is a SourceError, an outage retried by restarts)."""

    streams: str | list[str]
    starting_position: str | Mapping[str, Mapping[str, str]] = "LATEST"
    starting_timestamp: int | str | None = None
    max_records_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    region: str | None = None
    endpoint_url: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    profile_name: str | None = None
    poll_timeout_ms: int = 120_000
    request_timeout_ms: int = 10_000
    max_retries: int = 10
    event_log: str | None = None

    def __repr__(self) -> str:  # credentials are never printed (as KafkaSource's SASL secrets)
        shown = redact({f: getattr(self, f) for f in self.__dataclass_fields__})
        if shown["aws_access_key_id"]:
            shown["aws_access_key_id"] = "***"
        return f"KinesisSource({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def options(self) -> dict[str, str]:
        """The Spark options this configuration stands for."""
        opts = {"streams": self.streams if isinstance(self.streams, str) else ",".join(self.streams),
                "startingPosition": (self.starting_position if isinstance(self.starting_position, str)
                                     else json.dumps(self.starting_position)),
                "failOnDataLoss": str(self.fail_on_data_loss).lower(),
                "pollTimeoutMs": str(self.poll_timeout_ms),
                "requestTimeoutMs": str(self.request_timeout_ms),
                "maxRetries": str(self.max_retries)}
        for name, value in (("startingTimestamp", self.starting_timestamp),
                            ("maxRecordsPerTrigger", self.max_records_per_trigger),
                            ("region", self.region), ("endpointUrl", self.endpoint_url),
                            ("awsAccessKeyId", self.aws_access_key_id),
                            ("awsSecretAccessKey", self.aws_secret_access_key),
                            ("awsSessionToken", self.aws_session_token),
                            ("profileName", self.profile_name), ("eventLog", self.event_log)):
            if value is not None:
                opts[name] = str(value)
        return opts

    def validate(self) -> Settings:
        """Check options, credentials, endpoint and streams now; raise with what to fix."""
        settings = parse_options(self.options())
        KinesisStreamReader(settings, SCHEMA).check()
        return settings

    def load(self, spark):
        """Validate, then ``spark.readStream.format("onceflow-kinesis").options(...).load()``.

        Under a onceflow Job, ``event_log`` defaults to the job's checkpoint directory."""
        self.validate()
        opts = self.options()
        if self.event_log is None:
            ckpt = spark.conf.get("spark.onceflow.checkpointLocation", None)
            if ckpt:
                opts["eventLog"] = ckpt
        return spark.readStream.format(NAME).options(**opts).load()
