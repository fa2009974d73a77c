"""Replayable sources whose offsets live only in Spark's checkpoint."""

from __future__ import annotations

from typing import Any

__all__ = ["LAG_MS_KEY", "KafkaSource", "KinesisSource"]

#: the key of a source's ``reportLatestOffset`` that carries its lag in milliseconds per stream
#: and shard (sources whose positions are not numbers: Kinesis), read by the runner's metrics
LAG_MS_KEY = "lagMillis"


def __getattr__(name: str) -> Any:
    if name == "KafkaSource":  # lazy: confluent-kafka is an optional dependency
        from onceflow.sources.kafka import KafkaSource

        return KafkaSource
    if name == "KinesisSource":  # lazy: boto3 is an optional dependency
        from onceflow.sources.kinesis import KinesisSource

        return KinesisSource
    raise AttributeError(name)
