"""The Delta sink's JVM write path (``DeltaSink(..., writer="jvm")``).

Spark's own Parquet writer writes each micro-batch (``foreachBatch``) into a directory of the
table that is unique to the attempt, ``part-of-<lineage>-e<epoch>-b<batch>-d<uuid>/``; the
driver then commits the files it finds there to the Delta log with exactly the decision,
fingerprint and fencing rules of the Arrow path (:class:`~onceflow.sinks.base.
TwoPhaseCommitWriter.commit`: one Delta version with the add actions and the app transaction,
on top of a snapshot whose epoch is this driver's). No row crosses into Python.

Guarantee (exactly-once), step by step, and what a crash leaves:

1. the first batch after the query (re)started is already decided (the table's app
   transaction is at N or later): a replay. The batch's rows are consumed by Spark's ``noop``
   writer (upstream state commits) and nothing is written; the commit step finds the
   decision, checks the fingerprint and removes attempt directories of N that the decision
   does not list. (Only that batch can be a replay; a later one decided by another driver
   reaches only a zombie, whose commit finds that decision or is fenced, and deletes its
   directory.)
2. ``before_precommit``; this writer creates the fresh attempt directory (with the
   committer's job directories) and Spark writes into it (FileOutputCommitter algorithm 2, no
   ``_SUCCESS``); ``after_precommit``. A crash here leaves an
   undecided directory: invisible (no log entry adds it), deleted by the next driver's
   recovery (older epoch, batch after the last decided one) or by the commit of the batch's
   replay in the same driver (same batch, not in the decision). A replay never reuses it.
3. the directory's Parquet files (sizes from the listing, row counts from their footers)
   become the handles of :meth:`TwoPhaseCommitWriter.commit`, which looks the decision up,
   decides (epoch check and batch-undecided check in the same conditional log write), and
   cleans up. A driver of an older epoch is refused there (FencedError) and commits nothing.
   Before that, the footers' row total must equal the rows Spark wrote (counted during the
   write by an :class:`~pyspark.sql.Observation`, no second pass): a driver that does not see
   every file (executors writing to disks of their own, not shared at the table's path) fails
   the batch with SinkError instead of committing a decision that misses files.

Partitioned tables: Spark's ``partitionBy`` writes Hive-style subdirectories of the attempt
directory; each file's partition values are read back from its path (:mod:`.partitions`), and
the decision checks them against the table's partitioning. Timestamp partition columns need
the session time zone UTC (Spark writes them in that zone). With ``schema_mode="merge"``,
narrower columns are cast to the table's type before the write.

Only through :class:`~onceflow.Job` (the runner opens the sink and holds the epoch) on a
classic Spark session, for tables on the local filesystem (Spark's Hadoop filesystem writes
the files; the Delta log is still written by delta-rs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from py4j.protocol import Py4JJavaError
from pyspark.sql import Observation
from pyspark.sql import functions as F

from onceflow.errors import ConfigError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import PreCommitted, TwoPhaseCommitWriter
from onceflow.sinks.delta.files import dir_name, to_arrow_schema
from onceflow.sinks.delta.partitions import parse_directory

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from onceflow.sinks.delta.source import DeltaDataSource

log = logging.getLogger(__name__)

#: Write options, applied to this write's Hadoop configuration only: task commit moves the
#: files into the attempt directory (no second rename at job commit), no ``_SUCCESS`` marker
#: (the attempt directory is invisible until the Delta commit, which is the atomic step), and
#: Hadoop's raw local filesystem: no ``.crc`` side files, which no Delta reader checks.
WRITE_OPTIONS = {
    "mapreduce.fileoutputcommitter.algorithm.version": "2",
    "mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
}
#: FileOutputCommitter's job attempt directory and the parent of its task attempt directories
#: (application attempt 0: Spark's write jobs have no other), created before the write
COMMITTER_DIRS = "_temporary/0/_temporary"
#: Session settings of the stream's own session (Spark clones the session per query, so the
#: user's session is untouched): Delta readers expect INT64 microsecond timestamps, not INT96.
SESSION_CONF = {"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"}
#: how often (in batches) a column written plain gets a dictionary attempt again
REPROBE_BATCHES = 100
#: seconds to wait for Spark to report the rows a write wrote (it does when the write returns)
ROWS_REPORT_S = 60.0


class JvmBatchWriter:
    """The ``foreachBatch`` function of the JVM path (see the module doc for the guarantee)."""

    def __init__(self, source: DeltaDataSource, schema: StructType, overwrite: bool):
        self.source, self.overwrite = source, overwrite
        self.writer = TwoPhaseCommitWriter(source, schema, overwrite)
        self._lineage: str | None = None
        self._last_batch: int | None = None  # the batch this writer committed last
        #: columns whose last dictionary attempt fell back to plain (see :meth:`_learn_encodings`)
        self._plain: frozenset[str] = frozenset()
        self._batches = 0
        #: seconds of the last batch's steps (write, list, commit), for profiles
        self.last_profile: dict[str, float] = {}
        #: Arrow types of the partition columns of the batch being written
        self._types: dict[str, pa.DataType] = {}

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        src, writer = self.source, self.writer
        if self._lineage is None:
            self._lineage = writer._lineage(writer._checkpoint(), [])
        lineage = self._lineage
        epoch = writer._open_once(lineage, [])  # the runner's epoch (opened before the query)
        t0 = time.perf_counter()
        # Only the first batch of a query (re)start can be a replay of a decided batch; a later
        # one that another driver decided makes this driver a zombie, refused at its decide.
        # Either way the decision lookup in commit() is the authority; this only saves a write.
        first = self._last_batch is None or batch_id != self._last_batch + 1
        if first and src.is_decided(lineage, batch_id):
            self._spark_write(batch_id, lambda: df.write.format("noop").mode("overwrite").save())  # drain
            writer.commit([], batch_id)  # finds the decision: fingerprint check, clean-up
            self._last_batch = batch_id
            return
        maybe_crash("before_precommit", batch_id, None, src.opts)
        name = dir_name(lineage, epoch, batch_id)
        if first:  # the stream's own session (cloned per query): set once
            for key, value in SESSION_CONF.items():
                df.sparkSession.conf.set(key, value)
        parts, df = self._shaped(df, lineage)
        written = Observation()  # rows Spark writes, counted as it writes them
        df = df.observe(written, F.count(F.lit(1)).alias("rows"))
        options = {**WRITE_OPTIONS, **{f"parquet.enable.dictionary#{c}": "false" for c in self._plain}}
        self._make_dirs(name)
        self._spark_write(batch_id, lambda: df.write.options(**options).partitionBy(*parts).mode("append")
                          .parquet(f"{src.table_url}/{name}"))
        t1 = time.perf_counter()
        handles = self._handles(name, parts)
        self._check_rows(batch_id, name, handles, written)
        t2 = time.perf_counter()
        maybe_crash("after_precommit", batch_id, None, src.opts)
        messages = [PreCommitted(lineage, batch_id, i, 0, h["rows"], h) for i, h in enumerate(handles)]
        writer.commit(messages, batch_id)
        self._last_batch = batch_id
        self.last_profile = {"write_s": t1 - t0, "list_s": t2 - t1, "commit_s": time.perf_counter() - t2}
        log.debug("onceflow-delta jvm batch %d: %s", batch_id, self.last_profile)

    @staticmethod
    def _spark_write(batch_id: int, write: Callable[[], None]) -> None:
        """Run one of Spark's writes of this batch; a failure is raised again as a short
        SinkError ending in py4j's own line, ``py4j.protocol.Py4JJavaError: An error occurred
        while calling <call>.`` + newline + ``: <Java exception>``, without the Java stack trace.

        Spark reads that line to tell a query being stopped (``InterruptedException`` in the
        write) from a failure, with a pattern that recurses once per character after it: on
        the stack trace of a cluster job it overflows the stream thread's stack
        (StackOverflowError), and ``onceflow stop`` then waited for a query that never ended.
        A failure other than a stop is logged in full first; the error carries the first line of
        the Java exception (at most 300 characters)."""
        try:
            write()
        except Py4JJavaError as e:
            # its first line, capped: a stage failure's message embeds the task's stack trace
            java = (e.java_exception.toString().splitlines() or [""])[0][:300]
            if "Interrupted" not in java:
                log.error("onceflow-delta: Spark's write of batch %d failed: %s", batch_id, e)
            raise SinkError(f"onceflow-delta: Spark's write of batch {batch_id} failed: "
                            f"py4j.protocol.Py4JJavaError: {e.errmsg}: {java}") from None

    def _check_rows(self, batch_id: int, name: str, handles: list[dict[str, Any]],
                    written: Observation) -> None:
        """Refuse (SinkError, nothing committed) a decision whose files, as this driver lists
        them, do not hold exactly the rows Spark wrote: on a cluster whose executors write to
        disks of their own at the table's ``file://`` path, the driver sees only its own copy
        of the attempt directory, and committing it would silently lose the other rows."""
        future, deadline = written._jo.future(), time.monotonic() + ROWS_REPORT_S  # type: ignore[union-attr]
        while not future.isCompleted() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not future.isCompleted():
            raise SinkError(f"onceflow-delta: Spark did not report how many rows it wrote for batch "
                            f"{batch_id} within {ROWS_REPORT_S:.0f} s; nothing was committed (the "
                            "restart strategy runs the batch again)")
        rows, listed = written.get.get("rows"), sum(h["rows"] for h in handles)
        if rows is None:  # Spark completes an observation it lost from the plan with no values
            raise SinkError(f"onceflow-delta: Spark reported no row count for batch {batch_id}; nothing "
                            "was committed (the restart strategy runs the batch again)")
        if int(rows) != listed:
            raise SinkError(
                f"onceflow-delta: batch {batch_id}: Spark wrote {rows} rows into {self.source.table_url}/"
                f"{name}, but the driver finds {listed} in the files it lists there, so executors wrote "
                "files the driver cannot see (their file:// path is not storage every node shares); "
                "nothing was committed. Put the table on a filesystem mounted at the same path on the "
                "driver and every executor, or use DeltaSink(..., writer='arrow')")

    def _make_dirs(self, name: str) -> None:
        """Create the attempt directory and the committer's job directories in it
        (:data:`COMMITTER_DIRS`) from Python before Spark's write (which then appends into it).

        Without Hadoop's native library, its local filesystem sets the permission of every
        directory it creates by running ``chmod`` in a new process (about 3 ms each); these four
        were created one after another on the driver in every batch. A directory that exists is
        left as it is, so only the task attempt directories and the data files still pay it.
        The attempt directory is unique to this attempt either way, so nothing else changes:
        a crash leaves an orphan unit that recovery or the replay's commit deletes whole."""
        fs, root = self.source._fs()
        fs.makedirs(f"{root}/{name}/{COMMITTER_DIRS}", exist_ok=True)

    def _shaped(self, df: DataFrame, lineage: str) -> tuple[tuple[str, ...], DataFrame]:
        """The table's partition columns (as the Arrow path resolves them) and ``df`` with
        narrower columns cast to the table's types (``schema_mode="merge"``)."""
        from pyspark.sql.pandas.types import from_arrow_type

        parts, target, _ = self.source.write_plan(self.source._view(lineage), df.schema)
        stream = to_arrow_schema(df.schema)
        ts = [c for c in parts if pa.types.is_timestamp(target.field(c).type)]
        zone = df.sparkSession.conf.get("spark.sql.session.timeZone")
        if ts and zone not in ("UTC", "Etc/UTC", "GMT", "Z", "+00:00"):
            raise ConfigError(f"onceflow-delta: writer='jvm' partitions by timestamp column(s) {', '.join(ts)} "
                              f"only with spark.sql.session.timeZone=UTC (it is {zone}); set it, partition "
                              "by a date or string derived in the transform, or use writer='arrow'")
        casts = {f.name: from_arrow_type(f.type) for f in target if stream.field(f.name).type != f.type
                 and not pa.types.is_timestamp(f.type)}
        self._types = {c: target.field(c).type for c in parts}
        return parts, (df.withColumns({c: df[c].cast(t) for c, t in casts.items()}) if casts else df)

    def _handles(self, name: str, parts: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The attempt directory's data files as handles (path relative to the table, size,
        rows, mtime; for a partitioned table the partition values read from the path). Empty
        files are left out in append mode (nothing to add), and always when partitioned."""
        fs, root = self.source._fs()
        now = int(time.time() * 1000)
        handles, footers = [], []
        entries = fs.find(f"{root}/{name}", detail=True).values() if parts else fs.ls(f"{root}/{name}", detail=True)
        for entry in entries:
            rel = entry["name"].rstrip("/")[len(root.rstrip("/")) + len(name) + 2:]
            base = rel.rsplit("/", 1)[-1]
            if (entry.get("type") != "file" or not base.endswith(".parquet")
                    or any(seg.startswith(("_", ".")) for seg in rel.split("/"))):
                continue
            with fs.open(entry["name"], "rb") as f:
                footer = pq.read_metadata(f)
            footers.append(footer)
            if footer.num_rows or (self.overwrite and not parts):
                handle = {"path": f"{name}/{rel}", "size": int(entry["size"]), "rows": footer.num_rows, "mtime": now}
                if parts:
                    handle["partition"] = parse_directory(rel, self._types)
                handles.append(handle)
        self._learn_encodings(footers)
        return sorted(handles, key=lambda h: h["path"])

    def _learn_encodings(self, footers: list[pq.FileMetaData]) -> None:
        """Columns with too many distinct values for a dictionary (Parquet's writer tried one
        and dropped it for plain encoding in every column chunk of this batch) are
        written plain from the next batch on, without the wasted attempt: the Arrow path's
        choice, learned here from the footers instead of the rows. Every
        :data:`REPROBE_BATCHES` batches the writer tries dictionaries again (data changes)."""
        self._batches += 1
        if self._batches % REPROBE_BATCHES == 0:
            self._plain = frozenset()
            return
        tried: dict[str, bool] = {}  # column -> some chunk kept its dictionary
        for footer in footers:
            for g in range(footer.num_row_groups):
                group = footer.row_group(g)
                for c in range(group.num_columns):
                    chunk = group.column(c)
                    if chunk.path_in_schema not in self._plain and chunk.num_values:
                        kept = chunk.has_dictionary_page or any("DICTIONARY" in e for e in chunk.encodings)
                        tried[chunk.path_in_schema] = tried.get(chunk.path_in_schema, False) or kept
        self._plain = self._plain | {column for column, kept in tried.items() if not kept}
