"""``DeltaSink``: the Delta sink's configuration for a :class:`~onceflow.Job`."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from onceflow.errors import ConfigError
from onceflow.sinks.base import Sink, TwoPhaseCommitSink
from onceflow.sinks.upserts import check_fields, wire_options, with_delete_flag
from onceflow.storage import as_options, normalize_url, resolve, scheme_of

log = logging.getLogger(__name__)

WRITERS = ("auto", "arrow", "jvm")


@dataclass
class DeltaSink(Sink):
    """Exactly-once Delta Lake sink for a :class:`~onceflow.Job` (or ``writeStream``).

    ``path``: table URL; ``mode``: ``append`` or ``complete`` (default: follow the query's
    output mode; a mode that contradicts it is refused); ``sink_id`` distinguishes two Delta
    sinks of one job writing the same table. ``storage_options``: object-store options for this
    table (fsspec or delta-rs keys, docs/object-stores.md); default: the job's, else
    ``ONCEFLOW_STORAGE_OPTIONS``. They reach the executors as the ``storage_options`` option
    (JSON; hidden in Spark's UI, plans and Connect statements by the redaction settings
    ``get_spark`` adds, see :func:`onceflow.storage.spark_redaction_conf`).
    ``writer``: ``jvm`` (Spark's own Parquet writer per batch, committed by onceflow; Job API
    on a classic session, local tables), ``arrow`` (a Python data source: any URL, Spark
    Connect, also plain ``writeStream``), or ``auto`` (default: ``jvm`` where it runs, else
    ``arrow``; decided when the job starts). Both exactly-once; docs/delta-sink.md.
    ``partition_by``: partition columns of a table the sink creates (Hive-style directories);
    an existing table keeps its own partitioning and a different ``partition_by`` is refused.
    ``schema_mode``: ``strict`` (default; the stream's columns must be the table's) or
    ``merge`` (new columns are added as nullable, narrower types widened, in the commit of
    the batch that brings them).
    ``write``: ``append`` (default) or ``upsert``: each batch is one MERGE on ``keys`` (the
    last event per key in the batch wins: the largest ``order_by`` value, ties broken by the
    batch's order); ``delete_when``, a SQL predicate over the stream's columns (for example
    ``"op = 'd'"``), makes a winning event delete its key. Exactly-once as appends: a batch
    merged twice changes nothing (docs/delta-sink.md, "Upserts and deletes").
    """

    path: str
    mode: str | None = None
    sink_id: str = "delta"
    storage_options: Mapping[str, Any] | None = None
    writer: Literal["auto", "arrow", "jvm"] = "auto"
    partition_by: Sequence[str] | None = None
    schema_mode: Literal["strict", "merge"] = "strict"
    write: Literal["append", "upsert"] = "append"
    keys: Sequence[str] | None = None
    delete_when: str | None = None
    order_by: str | None = None

    format_name = "onceflow-delta"

    def __post_init__(self) -> None:
        self.storage_options = as_options(self.storage_options, "DeltaSink.storage_options")
        if self.writer not in WRITERS:
            raise ConfigError(f"DeltaSink.writer={self.writer!r}; use 'auto', 'arrow' or 'jvm'")
        if isinstance(self.partition_by, str):
            self.partition_by = [self.partition_by]
        if self.partition_by is not None and not all(isinstance(c, str) and c for c in self.partition_by):
            raise ConfigError(f"DeltaSink.partition_by={self.partition_by!r}; give a list of column names")
        if self.schema_mode not in ("strict", "merge"):
            raise ConfigError(f"DeltaSink.schema_mode={self.schema_mode!r}; use 'strict' or 'merge'")
        self.keys = check_fields("DeltaSink", self.write, self.keys, self.delete_when, self.order_by)
        if self.write == "upsert" and self.writer == "jvm":
            raise ConfigError("DeltaSink(write='upsert') runs on the arrow writer; leave writer out")

    def options(self) -> dict[str, str]:
        opts = {"path": str(self.path), "sink_id": self.sink_id}
        if self.mode:
            opts["mode"] = self.mode
        if self.writer == "jvm":
            opts["writer"] = self.writer
        if self.partition_by is not None:
            opts["partition_by"] = json.dumps(list(self.partition_by))
        if self.schema_mode != "strict":
            opts["schema_mode"] = self.schema_mode
        opts.update(wire_options(self.write, self.keys, self.order_by, self.delete_when))
        resolved = resolve(str(self.path), self.storage_options)  # executors have no job
        if resolved:
            opts["storage_options"] = json.dumps(resolved)
        return opts

    def prepare(self, df: Any) -> Any:
        """With ``delete_when``: the stream plus its boolean delete flag, computed by Spark."""
        return with_delete_flag(df, self.delete_when, "DeltaSink")

    def for_session(self, spark: Any) -> DeltaSink:
        """``writer="auto"`` decided for ``spark``: ``jvm`` on a classic session for a local
        table (appends), else ``arrow``."""
        if self.writer != "auto":
            return self
        from onceflow.spark import is_connect

        local = scheme_of(normalize_url(str(self.path))) in ("", "file")
        why = ("upserts merge on the driver" if self.write == "upsert" else "not a local table" if not local
               else "Spark Connect" if is_connect(spark) else "a local table on a classic session")
        decided = copy.copy(self)  # a copy: a subclass may take other constructor arguments
        decided.writer = "jvm" if why.startswith("a local") else "arrow"
        log.info("onceflow-delta %s: writer=auto runs the %s writer (%s)", self.path, decided.writer, why)
        return decided

    def check_output_mode(self, output_mode: str) -> None:
        """The JVM writer (``foreachBatch``) takes ``update`` too; the arrow writer does not."""
        if self.writer != "jvm":
            super().check_output_mode(output_mode)

    def _update_hint(self) -> str:
        return "; DeltaSink(writer='jvm') takes 'update' (local tables, classic sessions)" + super()._update_hint()

    def stream_writer(self, df: Any, source: TwoPhaseCommitSink, options: Mapping[str, str],
                      overwrite: bool) -> Any:
        """Arrow: the ``onceflow-delta`` data source. JVM: ``foreachBatch`` with
        :class:`~onceflow.sinks.delta.jvm.JvmBatchWriter` over the opened ``source``."""
        if self.writer != "jvm":
            return super().stream_writer(df, source, options, overwrite)
        from onceflow.spark import is_connect

        if is_connect(df.sparkSession):
            raise ConfigError("DeltaSink(writer='jvm') needs a classic Spark session (its foreachBatch "
                              "commits from the driver); over Spark Connect use writer='arrow'")
        from onceflow.sinks.delta.jvm import JvmBatchWriter

        return df.writeStream.foreachBatch(JvmBatchWriter(source, df.schema, overwrite))  # type: ignore[arg-type]
