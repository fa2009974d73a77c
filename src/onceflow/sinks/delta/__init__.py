"""Exactly-once Delta Lake sink (docs/delta-sink.md).

Two write paths, one commit protocol: ``arrow`` (the ``onceflow-delta`` Python data source:
tasks write Parquet with pyarrow) and ``jvm`` (Spark's Parquet writer per micro-batch through
``foreachBatch``, :mod:`onceflow.sinks.delta.jvm`). Either way the driver commits one Delta
version per batch carrying the add actions and the app transaction ``onceflow-<sink>-<lineage>``
= batch id, on top of a snapshot whose fencing epoch is its own (:mod:`.source`).
"""

from onceflow.extras import require

require("delta", "onceflow's Delta sink (DeltaSink)")  # one line, before any deltalake import

from onceflow.sinks.delta.files import _FILE, to_arrow_schema  # noqa: E402
from onceflow.sinks.delta.sink import DeltaSink  # noqa: E402
from onceflow.sinks.delta.source import DeltaDataSource  # noqa: E402

__all__ = ["_FILE", "DeltaDataSource", "DeltaSink", "to_arrow_schema"]
