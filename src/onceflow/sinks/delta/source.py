"""The Delta sink's data source: decision, fencing, recovery; the Arrow write path's tasks.

Tasks (Arrow path) write Parquet files into the table directory (invisible: not in the Delta
log); the JVM path (:mod:`onceflow.sinks.delta.jvm`) has Spark write a per-attempt directory
instead. The driver commits one Delta version with every add action and an app transaction
``onceflow-<sink>-<lineage>`` at version = batch id: decision and commit are one atomic
log write, so the crash windows "after decide" and "mid-commit" cannot occur. A replayed
batch finds the app transaction and writes nothing. Files and directories of failed or
speculative attempts are deleted after the batch commits and on recovery.

Fencing: the epoch of (sink, lineage) is a second app transaction
``onceflow-<sink>-<lineage>-epoch`` in the same Delta log. :meth:`DeltaDataSource.acquire_epoch`
commits epoch+1 (creating the table if needed). :meth:`DeltaDataSource.decide` commits on top
of exactly the snapshot it checked (Delta's put-if-absent of the next log version is the
compare-and-swap: :mod:`onceflow.sinks.delta.log` for appends to local tables, delta-rs with
``max_commit_retries=0`` otherwise), and that snapshot must show the caller's epoch as the
latest and batch N undecided. A driver paused anywhere and resumed after a successor opened the
sink therefore commits nothing: its snapshot is stale (the commit fails) or shows the newer
epoch (FencedError). Task files and attempt directories carry their writer's epoch in their
name; recovery deletes only orphans of older epochs, so a zombie never deletes a successor's.

Modes: ``append`` adds the batch's rows; ``complete`` replaces the table's contents with the
batch's result in the same single commit. Guarantee for both: exactly-once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction, create_table_with_add_actions
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, TaskInfo, TwoPhaseCommitSink, fenced
from onceflow.sinks.delta.files import (
    commit_meta,
    compatible,
    delta_schema,
    dictionary_columns,
    file_name,
    parse_unit,
    remove_units,
    to_arrow_schema,
    unit,
)
from onceflow.sinks.delta.log import LocalLog, LogSnapshot, local_log
from onceflow.storage import as_options, delta_target, normalize_url, scheme_of, url_to_fs

log = logging.getLogger(__name__)

_DECIDED: dict[tuple[str, str, int | None], OrderedDict[int, frozenset[str]]] = {}  # _decided_here
_TABLES: dict[tuple[str, str], tuple[DeltaTable, Any]] = {}  # per process: see DeltaDataSource._table
_TABLES_LOCK = threading.Lock()
_DECIDED_KEPT = 1000  # batches whose files a late writer's orphans are checked against
#: Conditional commits lost to other writers of the table before giving up (SinkError).
_MAX_CONFLICTS = 100


class DeltaDataSource(TwoPhaseCommitSink):
    """``df.writeStream.format("onceflow-delta").option("path", URL)``."""

    format_name = "onceflow-delta"
    atomic_decide_commit = True
    required_options = ("path",)
    options_doc = {
        "path": "table URL (created on the first commit if it does not exist)",
        "sink_id": "name of this sink within the job, part of the app id (default 'delta')",
        "mode": "append or complete (replace the table each batch); default: the query's output mode",
        "row_group_rows": "rows per Parquet row group (default 1000000)",
        "storage_options": "JSON object of object-store options, fsspec or delta-rs keys "
                           "(default: the job's, else ONCEFLOW_STORAGE_OPTIONS; docs/object-stores.md)",
        "writer": "arrow (default) or jvm (Spark's Parquet writer per batch; DeltaSink in a Job only)",
    }

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
        with _TABLES_LOCK:
            held = _TABLES.get(key)
            if held is not None:
                table, mark = held
                try:
                    if self._log_mark(table.version()) == mark:
                        table.update_incremental()
                        _TABLES[key] = (table, self._log_mark(table.version()))
                        return table
                except Exception:  # noqa: BLE001 - any doubt: load it afresh
                    pass
                _TABLES.pop(key, None)
            try:
                table = DeltaTable(self._delta_url, storage_options=self._delta_opts)
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

    def _view(self, lineage: str, fast: bool = True) -> LogSnapshot | DeltaTable | None:
        """The latest state for the decision checks of ``lineage`` (None: no table yet).

        ``fast``: a :class:`LogSnapshot` when the table is local and onceflow can append to its
        log, at the cost of two ``stat`` calls while no one else commits; otherwise (and for
        commits that delta-rs must make) the delta-rs table, brought up to date."""
        apps = (self.app_id(lineage), self.epoch_app_id(lineage))
        local = self._local_log() if fast else None
        if local is not None:
            snap = local.snapshot(apps)
            if snap is not None:
                return snap
        table = self._table()
        if table is not None and local is not None:
            return local.sync(table, apps) or table
        return table

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

    # ---- validation -----------------------------------------------------------------

    def _mode(self, overwrite: bool) -> str:
        """The effective mode: Spark's complete output mode means complete, else append."""
        return "complete" if overwrite else "append"

    def streamWriter(self, schema: StructType, overwrite: bool):
        """The Arrow path's writer; the JVM path is not a data source (Job API only)."""
        if self.writer == "jvm":
            raise ConfigError("onceflow-delta: writer=jvm is DeltaSink(..., writer='jvm') in a Job "
                              "(it runs as foreachBatch); with writeStream.format('onceflow-delta') "
                              "leave the writer option out")
        return super().streamWriter(schema, overwrite)

    def validate(self, schema: StructType, overwrite: bool) -> None:
        if self.writer == "jvm" and scheme_of(self.table_url) not in ("", "file"):
            raise ConfigError(
                f"onceflow-delta: writer='jvm' writes through Spark's Hadoop filesystem and supports "
                f"local tables only; {self.table_url}: use writer='arrow' (the default)"
            )
        if self.mode is not None and self.mode != self._mode(overwrite):
            raise ConfigError(
                f"onceflow-delta: sink mode {self.mode!r} does not match the query's output mode "
                f"({'complete' if overwrite else 'append/update'}); use DeltaSink(mode="
                f"{self._mode(overwrite)!r}) or leave the mode out to follow the query"
            )
        fs, path = self._fs()
        table = self._table()
        if table is None:
            foreign = [
                n for n in (fs.ls(path, detail=False) if fs.exists(path) else [])
                if not parse_unit(n.rstrip("/").rsplit("/", 1)[-1])
            ]
            if foreign:
                raise ConfigError(
                    f"onceflow-delta: {self.table_url} exists and is not a Delta table (no "
                    "_delta_log); give an empty or new directory, or an existing Delta table"
                )
            try:
                fs.makedirs(path, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"onceflow-delta: cannot create {self.table_url}: {e}") from None
            return
        want = to_arrow_schema(schema)
        have = pa.schema(table.schema().to_arrow())
        want_cols = {f.name: f.type for f in want}
        have_cols = {f.name: pa.field(f.name, f.type).type for f in have}
        if want_cols.keys() != have_cols.keys():
            raise ConfigError(
                f"onceflow-delta: the stream's columns {sorted(want_cols)} do not match table "
                f"{self.table_url} columns {sorted(have_cols)}; select matching columns or use a new table"
            )
        bad = [
            f"{n} ({want_cols[n]} vs table {have_cols[n]})"
            for n in want_cols
            if not compatible(want_cols[n], have_cols[n])
        ]
        if bad:
            raise ConfigError(
                f"onceflow-delta: column types differ from table {self.table_url}: {', '.join(bad)}; "
                "cast them in the transform or use a new table"
            )

    # ---- tasks ----------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        view = self._view(lineage)
        if view is None:
            return False
        version = view.transaction_version(self.app_id(lineage))
        return version is not None and version >= batch_id

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        arrow_schema = to_arrow_schema(schema)
        name = file_name(task, self.epoch)
        fs, path = self._fs()
        rows = 0
        full = f"{path}/{name}"
        fs.makedirs(path, exist_ok=True)
        with fs.open(full, "wb") as f:
            writer = None
            try:
                for batch in batches:
                    if batch.num_rows:
                        batch = batch.cast(arrow_schema) if batch.schema != arrow_schema else batch
                        if writer is None:
                            writer = pq.ParquetWriter(f, arrow_schema, compression="snappy",
                                                      use_dictionary=dictionary_columns(batch))
                        writer.write_batch(batch, row_group_size=self.row_group_rows)
                        rows += batch.num_rows
            finally:
                if writer is None:  # no rows: a valid, empty file (complete mode keeps it)
                    writer = pq.ParquetWriter(f, arrow_schema, compression="snappy")
                writer.close()
        if rows == 0 and not overwrite:
            fs.rm(full)
            return None, 0
        size = fs.size(full)
        handle = {"path": name, "size": size, "rows": rows, "mtime": int(time.time() * 1000)}
        return handle, rows

    # ---- driver ---------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        view = self._view(lineage)
        if view is None:
            return None
        version = view.transaction_version(self.app_id(lineage))
        if version is None or version < batch_id:
            return None
        table = self._table()  # decided: its commit info is in the history
        if table is None:
            return None
        meta = commit_meta(table, lineage, batch_id)
        if meta is None:  # decided, but its commit entry is gone (log cleanup): files unknown
            return Decision(lineage, batch_id, "unknown", handles=None)
        files = meta.get("files", [])
        return Decision(lineage, batch_id, meta.get("fingerprint", "unknown"),
                        [{"path": p} for p in files], meta.get("epoch"))

    def acquire_epoch(self, lineage: str) -> int:
        """Commit epoch+1 of (sink, lineage) as an app transaction; create the table if needed."""
        app = self.epoch_app_id(lineage)
        for _ in range(_MAX_CONFLICTS):
            table = self._table()
            epoch = 1 if table is None else (table.transaction_version(app) or 0) + 1
            props = CommitProperties(
                custom_metadata={"onceflow": json.dumps({"lineage": lineage, "epoch": epoch})},
                app_transactions=[Transaction(app, epoch)], max_commit_retries=0,
            )
            try:
                if table is None:
                    if self.write_schema is None:
                        raise ConfigError(f"onceflow-delta: {self.table_url} does not exist and the "
                                          "stream's schema is unknown; start the query to create it")
                    create_table_with_add_actions(
                        self._delta_url, delta_schema(to_arrow_schema(self.write_schema)), [],
                        mode="append", storage_options=self._delta_opts, commit_properties=props)
                else:
                    table.create_write_transaction([], "append", pa.schema(table.schema().to_arrow()),
                                                   commit_properties=props)
                return epoch
            except CommitFailedError:
                continue  # another commit landed first: read the log again
            except (ConfigError, TableNotFoundError):
                raise
            except Exception as e:  # noqa: BLE001 - delta-rs raises several types
                if table is None and "exist" in str(e).lower():
                    continue  # created by someone else meanwhile
                raise SinkError(f"onceflow-delta: cannot open {self.table_url} for lineage {lineage}: {e}") from e
        raise SinkError(f"onceflow-delta: {self.table_url} changed under every one of {_MAX_CONFLICTS} "
                        "attempts to take an epoch; retried by the restart strategy")

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        """One Delta commit: add actions + app transaction = decision and commit at once.

        Steps, each on the same snapshot, with the fault it survives:
        1. read the latest snapshot;
        2. its epoch must be the caller's (a successor opened the sink: FencedError);
        3. batch N must be undecided there, or decided with this very decision (a retry);
        4. commit exactly on top of that snapshot (``max_commit_retries=0``; for appends to a
           local table, :class:`~onceflow.sinks.delta.log.LocalLog`'s hard link of the next
           log entry): if anything was committed since step 1 (a successor's epoch, a rival
           decision, another writer), the log write fails and we start again at step 1.
        """
        meta = {
            "lineage": decision.lineage, "batch": decision.batch_id, "epoch": decision.epoch,
            "fingerprint": decision.fingerprint, "files": [h["path"] for h in decision.handles],
        }
        app, epoch_app = self.app_id(decision.lineage), self.epoch_app_id(decision.lineage)
        local = None if overwrite else self._local_log()
        what = f"decide batch {decision.batch_id}"
        for _ in range(_MAX_CONFLICTS):
            view = self._view(decision.lineage, fast=local is not None)
            current = None if view is None else view.transaction_version(epoch_app)
            if current != decision.epoch:
                raise fenced(self.format_name, decision.lineage, decision.epoch, current, what)
            decided = view.transaction_version(app)
            if decided is not None and decided >= decision.batch_id:
                stored = self.decision(decision.lineage, decision.batch_id)
                if (stored is not None and stored.handles is not None and stored.epoch == decision.epoch
                        and stored.fingerprint == decision.fingerprint
                        and sorted(h["path"] for h in stored.handles)
                        == sorted(h["path"] for h in decision.handles)):
                    self._remember(decision)
                    return  # our own earlier attempt landed
                raise fenced(self.format_name, decision.lineage, decision.epoch, current,
                             f"{what} (already decided by another commit)")
            try:
                if isinstance(view, LogSnapshot):
                    assert local is not None
                    landed = local.append(view, decision.handles, app, decision.batch_id, meta)
                    if landed is None:
                        continue  # the log moved (or cannot take links): read it again
                    self._remember(decision)
                    self._checkpoint_log(local, landed.version)
                    return
                self._commit_with_delta_rs(view, decision, meta, overwrite, schema)
                self._remember(decision)
                return
            except CommitFailedError:
                continue
            except Exception as e:  # noqa: BLE001 - delta-rs raises several types; say what failed
                raise SinkError(f"onceflow-delta: commit of batch {decision.batch_id} to "
                                f"{self.table_url} failed: {e}") from e
        raise SinkError(f"onceflow-delta: {self.table_url} changed under every one of {_MAX_CONFLICTS} "
                        f"attempts to commit batch {decision.batch_id}; retried by the restart strategy")

    def _commit_with_delta_rs(self, table: DeltaTable, decision: Decision, meta: dict[str, Any],
                              overwrite: bool, schema: StructType) -> None:
        """One delta-rs commit on top of exactly ``table``'s version (CommitFailedError when
        anything landed since)."""
        adds = [
            AddAction(
                path=h["path"], size=h["size"], partition_values={}, modification_time=h["mtime"],
                data_change=True, stats=json.dumps({"numRecords": h["rows"]}),
            )
            for h in decision.handles
        ]
        props = CommitProperties(
            custom_metadata={"onceflow": json.dumps(meta)},
            app_transactions=[Transaction(self.app_id(decision.lineage), decision.batch_id)],
            max_commit_retries=0,
        )
        table.create_write_transaction(adds, "overwrite" if overwrite else "append",
                                       to_arrow_schema(schema), commit_properties=props)

    def _decided_here(self, lineage: str) -> OrderedDict[int, frozenset[str]]:
        """The files of the last :data:`_DECIDED_KEPT` batches decided under this driver's
        epoch in this process. A file of an older epoch for such a batch that the decision does
        not list is an orphan. Kept per process: Spark makes a new data source per commit."""
        return _DECIDED.setdefault((self.table_url, lineage, self.epoch), OrderedDict())

    def _remember(self, decision: Decision) -> None:
        decided = self._decided_here(decision.lineage)
        decided[decision.batch_id] = frozenset(unit(h["path"]) for h in decision.handles)
        while len(decided) > _DECIDED_KEPT:
            decided.popitem(last=False)

    def commit(self, decision: Decision) -> None:
        """Visible since :meth:`decide`; here only remove files of losing attempts.

        Never deletes a file the decision lists, nor one written under a newer epoch than this
        driver's; when the decision's file list is unknown (its log entry was cleaned up)
        nothing is deleted at all. Also removes files that an older epoch's tasks wrote late
        (a paused driver woken after this one took over) for any of the last 1000 batches this
        driver decided: :meth:`recover` ran before they appeared and only looks at undecided
        batches.
        """
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)
        if decision.handles is None:
            return
        keep = {unit(h["path"]) for h in decision.handles}
        mine, decided_here = self.epoch, self._decided_here(decision.lineage)

        def losing(b: int, e: int, name: str) -> bool:
            if b == decision.batch_id:
                return name not in keep and (mine is None or e <= mine)
            return mine is not None and e < mine and b in decided_here and name not in decided_here[b]

        self._remove_files(decision.lineage, losing)

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        fs, path = self._fs()
        for name in {unit(h["path"]) for h in handles if h}:
            if fs.exists(f"{path}/{name}"):
                fs.rm(f"{path}/{name}", recursive=True)

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Delete this lineage's files that no decision references, written under an older epoch.

        Orphans are files of batches after the last decided one, and files of the last decided
        batch that its decision does not list (a crash interrupted :meth:`commit`'s cleanup).
        Files of earlier versions are never touched, so time travel keeps working. Only files of
        epochs older than this driver's are candidates: a file of this or a newer epoch may be
        in flight (and no older epoch can decide any more, so an old orphan stays an orphan).
        """
        table = self._table()
        if table is None:
            return {"orphans_removed": 0}
        mine = self.epoch
        version = table.transaction_version(self.app_id(lineage))
        last = -1 if version is None else version
        keep = {unit(h["path"]) for h in in_flight if h}
        if last >= 0:
            meta = commit_meta(table, lineage, last)
            if meta is None:  # unknown file list: only clean batches after the decided one
                last_files = None
            else:
                last_files = {unit(p) for p in meta.get("files", [])}
        else:
            last_files = set()

        def orphan(b: int, e: int, name: str) -> bool:
            if name in keep or (mine is not None and e >= mine):
                return False
            if b > last:
                return True
            return b == last and last_files is not None and name not in last_files

        return {"orphans_removed": self._remove_files(lineage, orphan)}

    def _remove_files(self, lineage: str, predicate) -> int:
        """Delete this lineage's units (task files, per-batch directories) for which
        ``predicate(batch, epoch, unit_name)`` holds."""
        fs, path = self._fs()
        return remove_units(fs, path, lineage, predicate)
