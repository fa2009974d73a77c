"""Registry of onceflow sink data sources (``df.writeStream.format(name)``)."""

from __future__ import annotations

import importlib

# format name -> "module:ClassName"; imported lazily so optional extras stay optional.
SINKS: dict[str, str] = {
    "onceflow-delta": "onceflow.sinks.delta:DeltaDataSource",
    "onceflow-postgres": "onceflow.sinks.postgres:PostgresDataSource",
    "onceflow-kafka-sink": "onceflow.sinks.kafka.sink:KafkaSinkDataSource",
    "onceflow-iceberg": "onceflow.sinks.iceberg:IcebergDataSource",
}


def _load(ref: str):
    module, cls = ref.split(":")
    return getattr(importlib.import_module(module), cls)


def data_sources() -> list[type]:
    """Every sink class whose module (and optional dependency) imports."""
    out = []
    for ref in SINKS.values():
        try:
            out.append(_load(ref))
        except (ImportError, AttributeError):
            continue
    return out
