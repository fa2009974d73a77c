"""Exactly-once Delta Lake sink (docs/delta-sink.md).

Two write paths, one commit protocol: ``arrow`` (the ``onceflow-delta`` Python data source:
tasks write Parquet with pyarrow) and ``jvm`` (Spark's Parquet writer per micro-batch through
``foreachBatch``, :mod:`onceflow.sinks.delta.jvm`). Either way the driver commits one Delta
version per batch carrying the add actions and the app transaction ``onceflow-<sink>-<lineage>``
= batch id, on top of a snapshot whose fencing epoch is its own (:mod:`.source`).
"""

from onceflow.sinks.delta.files import _FILE, to_arrow_schema
from onceflow.sinks.delta.sink import DeltaSink
from onceflow.sinks.delta.source import DeltaDataSource

__all__ = ["_FILE", "DeltaDataSource", "DeltaSink", "to_arrow_schema"]
