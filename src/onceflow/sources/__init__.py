"""Replayable sources whose offsets live only in Spark's checkpoint."""

from __future__ import annotations

from typing import Any

__all__ = ["KafkaSource", "KinesisSource"]


def __getattr__(name: str) -> Any:
    if name == "KafkaSource":  # lazy: confluent-kafka is an optional dependency
        from onceflow.sources.kafka import KafkaSource

        return KafkaSource
    if name == "KinesisSource":  # lazy: boto3 is an optional dependency
        from onceflow.sources.kinesis import KinesisSource

        return KinesisSource
    raise AttributeError(name)
