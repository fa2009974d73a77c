"""``IcebergSink``: the Iceberg sink's configuration for a :class:`~onceflow.Job`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from onceflow.errors import ConfigError
from onceflow.sinks.base import Sink
from onceflow.sinks.files import parquet_codec
from onceflow.sinks.iceberg.catalog import catalog_spec
from onceflow.sinks.iceberg.fileio import with_storage
from onceflow.sinks.upserts import check_fields, wire_options, with_delete_flag
from onceflow.storage import as_options, in_effect


@dataclass
class IcebergSink(Sink):
    """Exactly-once Apache Iceberg sink (pyiceberg; ``pip install 'onceflow[iceberg]'``).

    ``catalog``: a SQLAlchemy URL of a pyiceberg SQL catalog, ``sqlite:///path/catalog.db``
    (embedded: one file, nothing to run) or ``postgresql+psycopg://user:pw@host/db``; or a dict
    of pyiceberg catalog properties (``{"type": "rest", "uri": ...}``). ``table``:
    ``namespace.name``, created from the stream's schema when the job starts if missing.
    ``warehouse``: where new tables' files go (SQLite default: ``warehouse/`` beside the
    database; required for PostgreSQL). ``sink_id`` distinguishes two Iceberg sinks of one job
    writing the same table. ``storage_options``: object-store options for the warehouse (as
    for ``DeltaSink``; default: the job's, else ``ONCEFLOW_STORAGE_OPTIONS``), used by the
    tasks' fsspec writes and, translated to ``s3.*``/``adls.*`` properties, by pyiceberg's
    FileIO (catalog properties you give win). ``mode``: ``append`` (the only output mode). Every driver and
    executor must reach the catalog and the warehouse. ``compression``: the data files' Parquet
    codec, ``zstd`` (Iceberg's default) or ``snappy`` (faster to write, larger), ``lz4``,
    ``gzip``, ``brotli``, ``none``.
    ``write``: ``append`` (default) or ``upsert``: each batch is one snapshot replacing the rows
    of its ``keys`` (the last event per key in the batch wins: the largest ``order_by`` value,
    ties broken by the batch's order); ``delete_when``, a SQL predicate over the stream's
    columns (for example ``"op = 'd'"``), makes a winning event delete its key. Exactly-once as
    appends: a batch is applied once (docs/iceberg-sink.md, "Upserts and deletes").
    """

    catalog: str | Mapping[str, Any]
    table: str
    warehouse: str | None = None
    sink_id: str = "iceberg"
    mode: str | None = None
    catalog_name: str = "onceflow"
    storage_options: Mapping[str, Any] | None = None
    write: Literal["append", "upsert"] = "append"
    keys: Sequence[str] | None = None
    delete_when: str | None = None
    order_by: str | None = None
    compression: str = "zstd"

    format_name = "onceflow-iceberg"

    def __post_init__(self) -> None:
        if isinstance(self.catalog, Mapping):  # its repr hides s3.secret-access-key and the like
            self.catalog = as_options(self.catalog, "IcebergSink.catalog")
        if self.mode not in (None, "append"):
            raise ConfigError(f"IcebergSink.mode={self.mode!r} is not supported; use 'append' (complete "
                              "is not implemented; for upserts give write='upsert' and keys)")
        self.keys = check_fields("IcebergSink", self.write, self.keys, self.delete_when, self.order_by)
        self.storage_options = as_options(self.storage_options, "IcebergSink.storage_options")
        self.compression = parquet_codec(self.compression, "IcebergSink.compression")
        with_storage(catalog_spec(self.catalog, self.warehouse, self.catalog_name),
                     self.storage_options)  # ConfigError early: the catalog, options pyiceberg cannot take

    def options(self) -> dict[str, str]:
        catalog = self.catalog if isinstance(self.catalog, str) else json.dumps(dict(self.catalog))
        opts = {"catalog": catalog, "table": self.table, "sink_id": self.sink_id,
                "catalog_name": self.catalog_name}
        if self.warehouse:
            opts["warehouse"] = str(self.warehouse)
        if self.mode:
            opts["mode"] = self.mode
        if self.compression != "zstd":
            opts["compression"] = self.compression
        shipped = in_effect(self.storage_options)  # executors have no job: its options travel along
        if shipped:
            opts["storage_options"] = json.dumps(dict(shipped))
        opts.update(wire_options(self.write, self.keys, self.order_by, self.delete_when))
        return opts

    def prepare(self, df: Any) -> Any:
        """With ``delete_when``: the stream plus its boolean delete flag, computed by Spark
        (never written to the table)."""
        return with_delete_flag(df, self.delete_when, "IcebergSink")
