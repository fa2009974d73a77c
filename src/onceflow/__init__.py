"""onceflow: exactly-once effects for PySpark Structured Streaming.

Public API: :class:`Job`, :class:`CheckpointConfig`, the sinks (:class:`DeltaSink`,
``PostgresSink``, ``KafkaSink``, ``IcebergSink``), sources and the restart strategies.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Job": "onceflow.job",
    "CheckpointConfig": "onceflow.job",
    "RestoreContext": "onceflow.runtime.context",
    "DeltaSink": "onceflow.sinks.delta",
    "PostgresSink": "onceflow.sinks.postgres",
    "KafkaSink": "onceflow.sinks.kafka",
    "IcebergSink": "onceflow.sinks.iceberg",
    "KafkaSource": "onceflow.sources.kafka",
    "KinesisSource": "onceflow.sources.kinesis",
    "RestartStrategy": "onceflow.runtime.restart",
    "fixed_delay": "onceflow.runtime.restart",
    "exponential_delay": "onceflow.runtime.restart",
    "failure_rate": "onceflow.runtime.restart",
    "no_restart": "onceflow.runtime.restart",
    "get_spark": "onceflow.spark",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    """Import lazily so ``import onceflow`` stays cheap and optional extras stay optional."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'onceflow' has no attribute {name!r}")
