"""The Delta table as the sink reads it: options, the latest snapshot, partitioning and schema.

:class:`DeltaTableAccess` is the base of :class:`~onceflow.sinks.delta.source.DeltaDataSource`:
it parses the sink's options and gives the protocol its views of the table, a delta-rs table
kept up to date incrementally per process or, for local tables, :mod:`.log`'s constant-cost
snapshot, and the write plan (partition columns and file schema) a batch must follow.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError
from onceflow.sinks.base import TwoPhaseCommitSink
from onceflow.sinks.delta.evolution import SCHEMA_MODES, arrow_of, plan
from onceflow.sinks.delta.files import to_arrow_schema
from onceflow.sinks.delta.log import LocalLog, LogSnapshot, local_log, store_log
from onceflow.sinks.delta.partitions import check_columns, parse_partition_by
from onceflow.sinks.delta.txns import TrackedTable
from onceflow.sinks.delta.upsert import UpsertSpec
from onceflow.storage import as_options, delta_target, normalize_url, scheme_of, url_to_fs

log = logging.getLogger(__name__)

#: delta-rs options that choose how it commits on S3 (then onceflow leaves the commits to it)
_OTHER_COMMIT_KEYS = {"AWS_S3_LOCKING_PROVIDER", "DELTA_DYNAMO_TABLE_NAME", "AWS_S3_ALLOW_UNSAFE_RENAME",
                      "AWS_CONDITIONAL_PUT", "CONDITIONAL_PUT"}
_TABLES: dict[tuple[str, str], tuple[DeltaTable, Any]] = {}  # per process: see DeltaTableAccess._table
_TABLES_LOCK = threading.Lock()


class DeltaTableAccess(TwoPhaseCommitSink):
    """Options and table views shared by the Delta sink's protocol steps."""

    def __init__(self, options):
        super().__init__(options)
        self.table_url = normalize_url(self.opts["path"].rstrip("/"))
        self.storage_options = as_options(self.opts.get("storage_options") or None,
                                          "onceflow-delta: option storage_options")
        self._delta_url, self._delta_opts = delta_target(self.table_url, self.storage_options)
        self.sink_id = self.opts.get("sink_id", "delta")
        mode = self.opts.get("mode") or None
        if mode not in (None, "append", "complete"):
            raise ConfigError(f"onceflow-delta: mode={mode!r}; use 'append' or 'complete'")
        self.mode = mode
        self.writer = self.opts.get("writer") or "arrow"
        if self.writer not in ("arrow", "jvm"):
            raise ConfigError(f"onceflow-delta: writer={self.writer!r}; use 'arrow' or 'jvm'")
        try:
            self.row_group_rows = int(self.opts.get("row_group_rows", 1_000_000))
        except ValueError:
            raise ConfigError("onceflow-delta: row_group_rows must be a whole number") from None
        self.partition_by = parse_partition_by(self.opts.get("partition_by"))
        self.schema_mode = self.opts.get("schema_mode") or "strict"
        if self.schema_mode not in SCHEMA_MODES:
            raise ConfigError(f"onceflow-delta: schema_mode={self.schema_mode!r}; use 'strict' or 'merge'")
        self.upsert = UpsertSpec.from_options(self.opts)

    def app_id(self, lineage: str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}"

    def epoch_app_id(self, lineage: str) -> str:
        return f"onceflow-{self.sink_id}-{lineage}-epoch"

    def _table(self) -> DeltaTable | None:
        """The table at its latest version, or None when it does not exist yet.

        Loaded once per process and then brought up to date incrementally (only the log
        entries since the last look are read), as long as the log entry of the version it
        holds is still the one it read (same file for local tables: a table deleted and
        created again is noticed even when its log is as long); otherwise loaded afresh.
        Every decision is still checked against, and committed on top of, the snapshot this
        returns (see :meth:`decide`)."""
        key = (self._delta_url, json.dumps(self._delta_opts, sort_keys=True, default=str))
        local = scheme_of(self.table_url) in ("", "file")
        with _TABLES_LOCK:
            held = _TABLES.get(key)
            if held is not None:
                table, mark = held
                try:
                    if self._log_mark(table.version()) == mark:
                        table.update_incremental()
                        # on an object store the mark is the entry's existence: delta-rs just read it
                        _TABLES[key] = (table, self._log_mark(table.version()) if local else True)
                        return table
                except Exception:  # noqa: BLE001 - any doubt: load it afresh
                    pass
                _TABLES.pop(key, None)
            try:
                fs, path = self._fs()
                table = TrackedTable(self._delta_url, self._delta_opts, fs, f"{path}/_delta_log")
            except TableNotFoundError:
                return None
            _TABLES[key] = (table, self._log_mark(table.version()))
            return table

    def _log_mark(self, version: int) -> Any:
        """What identifies the log entry of ``version``: (inode, mtime) of a local file,
        else whether it exists (None: it does not)."""
        fs, path = self._fs()
        entry = f"{path}/_delta_log/{version:020d}.json"
        if scheme_of(self.table_url) in ("", "file"):
            try:
                st = os.stat(entry)
            except FileNotFoundError:
                return None
            return st.st_ino, st.st_mtime_ns
        return fs.exists(entry) or None

    def _fs(self):
        return url_to_fs(self.table_url, self.storage_options)

    def _local_log(self) -> LocalLog | None:
        """The constant-cost log of a local table (:mod:`onceflow.sinks.delta.log`), else None."""
        if scheme_of(self.table_url) not in ("", "file"):
            return None
        root = self.__dict__.get("_local_root")
        if root is None:
            root = self.__dict__["_local_root"] = self._fs()[1]
        return local_log(root)

    def _commit_log(self) -> LocalLog | None:
        """The log a decision appends to itself: a local table's :class:`LocalLog`, an S3
        table's :class:`StoreLog`; None elsewhere (delta-rs commits), and on S3 when the
        options name another way for delta-rs to commit safely (a locking provider such as
        DynamoDB, or unsafe renames), which the store's conditional create would bypass."""
        if scheme_of(self.table_url) != "s3":
            return self._local_log()
        if any(k.upper() in _OTHER_COMMIT_KEYS for k in self._delta_opts):
            return None
        fs, root = self._fs()
        return store_log(fs, root, f"{self.table_url} {json.dumps(self._delta_opts, sort_keys=True, default=str)}")

    def _view(self, lineage: str, fast: bool = True, log: LocalLog | None = None,
              latest: bool = True) -> LogSnapshot | DeltaTable | None:
        """The latest state for the decision checks of ``lineage`` (None: no table yet).

        ``fast``: a :class:`LogSnapshot` of ``log`` (default: a local table's
        :class:`LocalLog`) when onceflow can append to it, at the cost of two ``stat`` calls
        (two HEAD requests on S3) while no one else commits, one with ``latest=False`` (see
        :meth:`LocalLog.snapshot`); otherwise (and for commits that delta-rs must make) the
        delta-rs table, brought up to date."""
        apps = (self.app_id(lineage), self.epoch_app_id(lineage))
        local = (log or self._local_log()) if fast else None
        if local is not None:
            snap = local.snapshot(apps, latest)
            if snap is not None:
                return snap
        table = self._table()
        if table is not None and local is not None:
            return local.sync(table, apps) or table
        return table

    def task_options(self, lineage: str) -> dict[str, str]:
        """On S3, the log state after ``open()`` as ``log_seed`` (:meth:`LocalLog.seed`): the
        first batch's fresh Python workers read forward from it instead of loading the table."""
        store = self._commit_log()
        if store is None or not store.remote:
            return {}
        lineage = self.opts.get("lineage") or lineage
        try:
            self._view(lineage, log=store)  # held first-hand: recovery just loaded the table
        except Exception as e:  # noqa: BLE001 - advisory: the tasks load the table themselves
            log.debug("onceflow-delta: no log seed for the tasks: %s", e)
            return {}
        seed = store.seed((self.app_id(lineage), self.epoch_app_id(lineage)))
        return {"log_seed": seed} if seed else {}

    def _forward_view(self, lineage: str) -> LogSnapshot | DeltaTable | None:
        """What a task writes for: the table's log read forward from what this process saw
        last (:meth:`LocalLog.advance`: one read per new entry, ``verified=False``), else
        :meth:`_view`. The decision checks the task's partitioning and schema again."""
        log = self._commit_log()
        if log is not None:
            if self.opts.get("log_seed"):
                log.take_seed(self.opts["log_seed"])
            ahead = log.advance((self.app_id(lineage), self.epoch_app_id(lineage)))
            if ahead is not None:
                return ahead
        return self._view(lineage, log=log)

    def _checkpoint_log(self, local: LocalLog, version: int) -> None:
        """Every ``delta.checkpointInterval`` versions appended by :class:`LocalLog`: a
        checkpoint and expired-entry clean-up by delta-rs (its post-commit hook's work)."""
        if version % local.interval:
            return
        try:
            table = self._table()
            if table is not None:
                table.create_checkpoint()
                if local.cleanup:
                    table.cleanup_metadata()
        except Exception as e:  # noqa: BLE001 - an optimisation for readers; the commit stands
            log.warning("onceflow-delta: checkpoint of %s at version %d failed (retried in %d "
                        "versions): %s", self.table_url, version, local.interval, e)

    # ---- partitioning and schema ------------------------------------------------------

    @staticmethod
    def _shape(view: LogSnapshot | DeltaTable | None) -> tuple[tuple[str, ...], str] | None:
        """(partition columns, Delta schema string) of the table at ``view``; None: no table."""
        if view is None:
            return None
        if isinstance(view, LogSnapshot):
            return view.partition_columns, view.schema_json
        return tuple(view.metadata().partition_columns), view.schema().to_json()

    def write_plan(self, view: LogSnapshot | DeltaTable | None, schema: StructType
                   ) -> tuple[tuple[str, ...], pa.Schema, list[str]]:
        """(partition columns, schema of the files, stream columns the table lacks) for a
        write of ``schema`` to the table at ``view``: the existing table's partitioning (a
        different ``partition_by`` is refused), else ``partition_by``."""
        stream = to_arrow_schema(schema)
        shape = self._shape(view)
        if shape is None:
            parts = self.partition_by or ()
            check_columns(stream, parts, "onceflow-delta")
            return parts, stream, []
        parts, schema_json = shape
        if self.partition_by is not None and tuple(self.partition_by) != parts:
            raise ConfigError(
                f"onceflow-delta: partition_by={list(self.partition_by)} but table {self.table_url} "
                f"is partitioned by {list(parts)}; leave partition_by out (the table's is used) or use a new table")
        target, new = plan(stream, arrow_of(schema_json), self.schema_mode, "onceflow-delta", self.table_url)
        check_columns(target, parts, "onceflow-delta")
        return parts, target, new

    def _table_struct(self, schema: StructType) -> StructType:
        """The stream's schema as the table holds it (an upsert's delete column is not written)."""
        if self.upsert is None or not self.upsert.delete_column:
            return schema
        return StructType([f for f in schema.fields if f.name != self.upsert.delete_column])
