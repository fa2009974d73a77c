"""onceflow: exactly-once effects for PySpark Structured Streaming.

Public API: :class:`Job`, :class:`CheckpointConfig`, the sinks (:class:`DeltaSink`,
``PostgresSink``, ``KafkaSink``, ``IcebergSink``), sources and the restart strategies.

Names are imported on first use (``import onceflow`` stays cheap and optional extras stay
optional); the ``TYPE_CHECKING`` block below shows the same names to type checkers and IDEs,
which never run ``__getattr__``. ``__version__`` is the package's one version source
(``pyproject.toml`` reads it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # keep in step with _EXPORTS (tests/test_package.py checks)
    from onceflow.checkpoint.config import CheckpointConfig
    from onceflow.job import Job
    from onceflow.runtime.restart import (
        RestartStrategy,
        default_strategy,
        exponential_delay,
        failure_rate,
        fixed_delay,
        no_restart,
    )
    from onceflow.savepoint.context import RestoreContext
    from onceflow.sinks.delta import DeltaSink
    from onceflow.sinks.iceberg import IcebergSink
    from onceflow.sinks.kafka import KafkaSink
    from onceflow.sinks.postgres import PostgresSink
    from onceflow.sources.kafka import KafkaSource
    from onceflow.sources.kinesis import KinesisSource
    from onceflow.spark import get_spark

_EXPORTS = {
    "Job": "onceflow.job",
    "CheckpointConfig": "onceflow.checkpoint.config",
    "RestoreContext": "onceflow.savepoint.context",
    "DeltaSink": "onceflow.sinks.delta",
    "PostgresSink": "onceflow.sinks.postgres",
    "KafkaSink": "onceflow.sinks.kafka",
    "IcebergSink": "onceflow.sinks.iceberg",
    "KafkaSource": "onceflow.sources.kafka",
    "KinesisSource": "onceflow.sources.kinesis",
    "RestartStrategy": "onceflow.runtime.restart",
    "default_strategy": "onceflow.runtime.restart",
    "fixed_delay": "onceflow.runtime.restart",
    "exponential_delay": "onceflow.runtime.restart",
    "failure_rate": "onceflow.runtime.restart",
    "no_restart": "onceflow.runtime.restart",
    "get_spark": "onceflow.spark",
}

__all__ = [
    "CheckpointConfig",
    "DeltaSink",
    "IcebergSink",
    "Job",
    "KafkaSink",
    "KafkaSource",
    "KinesisSource",
    "PostgresSink",
    "RestartStrategy",
    "RestoreContext",
    "__version__",
    "default_strategy",
    "exponential_delay",
    "failure_rate",
    "fixed_delay",
    "get_spark",
    "no_restart",
]


def __getattr__(name: str) -> Any:
    """Import lazily so ``import onceflow`` stays cheap and optional extras stay optional."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'onceflow' has no attribute {name!r}")
