"""Exactly-once Apache Iceberg sink on pyiceberg (docs/iceberg-sink.md).

Tasks write Parquet files into the table's ``data/`` directory; the driver commits one snapshot
per batch that adds them and carries (lineage, batch, epoch) in its summary, with the catalog's
conditional commit (:mod:`.source`). A replay, a zombie or a lost commit reply finds the batch
in the table's metadata and commits nothing.
"""

from onceflow.sinks.iceberg.sink import IcebergSink
from onceflow.sinks.iceberg.source import IcebergDataSource

__all__ = ["IcebergDataSource", "IcebergSink"]
