"""Registry of onceflow source data sources (``spark.readStream.format(name)``)."""

from __future__ import annotations

import importlib

SOURCES: dict[str, str] = {
    "onceflow-sequence": "onceflow.sources.sequence:SequenceDataSource",
    "onceflow-kafka": "onceflow.sources.kafka:KafkaSourceDataSource",
    "onceflow-kinesis": "onceflow.sources.kinesis:KinesisSourceDataSource",
}


def data_sources() -> list[type]:
    out = []
    for ref in SOURCES.values():
        module, cls = ref.split(":")
        try:
            out.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError):
            continue
    return out
