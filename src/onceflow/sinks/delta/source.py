"""The Delta sink's data source: decision, fencing, recovery; the Arrow write path's tasks.

Tasks (Arrow path) write Parquet files into the table directory (invisible: not in the Delta
log); the JVM path (:mod:`onceflow.sinks.delta.jvm`) has Spark write a per-attempt directory
instead. The driver commits one Delta version with every add action and an app transaction
``onceflow-<sink>-<lineage>`` at version = batch id: decision and commit are one atomic
log write, so the crash windows "after decide" and "mid-commit" cannot occur. A replayed
batch finds the app transaction and writes nothing. Files and directories of failed or
speculative attempts are deleted after the batch commits and on recovery; those finished late,
after their batch committed, by later commits and recovery (:meth:`DeltaDataSource.commit`).

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
batch's result in the same single commit; ``write=upsert`` (:mod:`.upsert`) merges the batch's
staged rows, the last event per key, in one MERGE that carries the same app transaction.
Guarantee for all three: exactly-once.

Partitioning (:mod:`.partitions`) and schema (:mod:`.evolution`) are those of the snapshot the
decision commits on: every add must carry exactly that snapshot's partition columns and the
stream's columns must fit its schema (or, with ``schema_mode=merge``, the commit adds them by a
metaData action), else nothing is committed. So a table whose partitioning or schema changed
between the tasks' writes and the decision never gets files of the other shape.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction, create_table_with_add_actions
from pyspark.sql.types import StructType

from onceflow.errors import ConfigError, OnceflowError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, TaskInfo, fenced
from onceflow.sinks.delta.access import DeltaTableAccess
from onceflow.sinks.delta.evolution import arrow_of, merged_schema_json
from onceflow.sinks.delta.files import (
    add_files,
    commit_meta,
    delta_schema,
    dir_name,
    file_name,
    losing_rule,
    orphan_rule,
    parse_unit,
    recent_decisions,
    remove_units,
    sweep_prefixes,
    to_arrow_schema,
    unit,
)
from onceflow.sinks.delta.log import LogSnapshot
from onceflow.sinks.delta.tasks import write_file, write_partitioned
from onceflow.sinks.delta.upsert import merge, read_staged, staged_rule
from onceflow.sinks.upserts import last_per_key
from onceflow.storage import is_local, scheme_of

log = logging.getLogger(__name__)

_DECIDED: dict[tuple[str, str, int | None], OrderedDict[int, frozenset[str]]] = {}  # _decided_here
_DECIDED_KEPT = 1000  # batches whose files a late writer's orphans are checked against
#: log versions whose decisions recovery reads to sweep late files of earlier batches
_SWEEP_VERSIONS = 256
#: Conditional commits lost to other writers of the table before giving up (SinkError).
_MAX_CONFLICTS = 100


class DeltaDataSource(DeltaTableAccess):
    """``df.writeStream.format("onceflow-delta").option("path", URL)``."""

    format_name = "onceflow-delta"
    atomic_decide_commit = True
    required_options = ("path",)
    options_doc = {
        "path": "table URL (created on the first commit if it does not exist)",
        "sink_id": "name of this sink within the job, part of the app id (default 'delta')",
        "mode": "append or complete (replace the table each batch); default: the query's output mode",
        "row_group_rows": "rows per Parquet row group (default 1000000)",
        "log_seed": "the table log's state after open(), for the tasks (set by Job.run and write_stream on S3)",
        "storage_options": "JSON object of object-store options, fsspec or delta-rs keys "
                           "(default: the job's, else ONCEFLOW_STORAGE_OPTIONS; docs/object-stores.md)",
        "writer": "arrow (default) or jvm (Spark's Parquet writer per batch; DeltaSink in a Job only)",
        "partition_by": "partition columns of a new table, a JSON list or comma-separated (default: "
                        "the existing table's; a different one is refused)",
        "schema_mode": "strict (default: the stream's columns are the table's) or merge (add new "
                       "nullable columns, widen narrower types, in the batch's own commit)",
        "write": "append (default) or upsert (one MERGE per batch on keys; the last event per key wins)",
        "keys": "upsert: the columns that identify a row, a JSON list or comma-separated",
        "order_by": "upsert: a column ordering a key's events within a batch (largest wins; default: "
                    "the batch's order)",
        "delete_column": "upsert: a boolean column; a winning event where it is true deletes the key "
                         "(DeltaSink(delete_when=SQL) computes it)",
    }

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

    def validate(self, schema: StructType, overwrite: bool, create: bool = True) -> None:
        """Options, target and schema; an absent table's directory is created (not with
        ``create=False``: ``onceflow run --dry-run`` writes nothing)."""
        if self.upsert is not None:
            if overwrite or self.mode == "complete":
                raise ConfigError("onceflow-delta: write='upsert' merges each batch into the table; "
                                  "complete mode replaces it: use one or the other")
            if self.writer == "jvm":
                raise ConfigError("onceflow-delta: write='upsert' runs on the arrow writer; leave "
                                  "writer out (auto) or use writer='arrow'")
            self.upsert.check(to_arrow_schema(schema), "onceflow-delta")
            schema = self._table_struct(schema)
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
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in (fs.ls(path, detail=False) if fs.exists(path) else [])]
            # a _delta_log without a version yet: another writer is creating the table right now
            foreign = [n for n in names if not parse_unit(n) and n != "_delta_log"]
            if foreign:
                raise ConfigError(
                    f"onceflow-delta: {self.table_url} exists and is not a Delta table (no "
                    "_delta_log); give an empty or new directory, or an existing Delta table"
                )
            self.write_plan(None, schema)
            if not create:
                return
            try:
                fs.makedirs(path, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"onceflow-delta: cannot create {self.table_url}: {e}") from None
            return
        _, _, new = self.write_plan(table, schema)
        if new and not overwrite and self.upsert is None:  # a MERGE adds columns itself
            protocol = table.protocol()
            if scheme_of(self.table_url) not in ("", "file") or protocol.min_writer_version > 2 \
                    or protocol.writer_features:
                raise ConfigError(
                    f"onceflow-delta: schema_mode='merge' adds columns {', '.join(new)} in the batch's "
                    f"own commit, supported so far for appends to local tables of writer version 2 "
                    f"(not {self.table_url}); add them with ALTER TABLE first, or use complete mode")

    # ---- tasks ----------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        """On a view read forward (:meth:`_forward_view`), "decided" is confirmed on the table
        loaded afresh before the task skips the batch: a skip writes nothing."""
        view = self._forward_view(lineage)
        decided = self._decided_at(view, lineage, batch_id)
        if decided and isinstance(view, LogSnapshot) and not view.verified:
            view = self._view(lineage, fast=False)
            decided = self._decided_at(view, lineage, batch_id)
        self.__dict__["_task_view"] = view  # what this task's pre_commit writes for
        return decided

    def _decided_at(self, view: LogSnapshot | DeltaTable | None, lineage: str, batch_id: int) -> bool:
        version = None if view is None else view.transaction_version(self.app_id(lineage))
        return version is not None and version >= batch_id

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        """One file (unpartitioned) or one directory of partition files (:mod:`.tasks`), in
        the partitioning and schema of the table as this task saw it (decide checks both)."""
        fs, path = self._fs()
        if self.upsert is not None:  # staged for the decision's MERGE, in the stream's schema
            name = file_name(task, self.epoch)
            rows, _ = write_file(fs, f"{path}/{name}", to_arrow_schema(schema), batches, self.row_group_rows, False)
            return ({"path": name, "task": task.partition, "rows": rows} if rows else None), rows
        view = self.__dict__.pop("_task_view", None) or self._forward_view(task.lineage)
        parts, target, _ = self.write_plan(view, schema)
        if is_local(fs):  # an object store has no directories to make
            fs.makedirs(path, exist_ok=True)
        if parts:
            name = dir_name(task.lineage, self.epoch, task.batch_id)
            files, rows = write_partitioned(fs, path, name, target, parts, batches, self.row_group_rows, overwrite)
            return ({"path": name, "files": files, "rows": rows} if files else None), rows
        name = file_name(task, self.epoch)
        rows, size = write_file(fs, f"{path}/{name}", target, batches, self.row_group_rows, overwrite)
        if rows == 0 and not overwrite:
            return None, 0
        return {"path": name, "size": size, "rows": rows, "mtime": int(time.time() * 1000)}, rows

    # ---- driver ---------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        # the decision's own log (S3: two HEAD requests while nobody else commits), not a refresh
        view = self._view(lineage, log=None if self.upsert else self._commit_log())
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
                    created = self._table_struct(self.write_schema)
                    parts, _, _ = self.write_plan(None, created)
                    create_table_with_add_actions(
                        self._delta_url, delta_schema(to_arrow_schema(created)), [],
                        mode="append", partition_by=list(parts) or None,
                        storage_options=self._delta_opts, commit_properties=props)
                else:
                    table.create_write_transaction([], "append", pa.schema(table.schema().to_arrow()),
                                                   commit_properties=props)
                return epoch
            except CommitFailedError:
                continue  # another commit landed first: read the log again
            except (ConfigError, TableNotFoundError):
                raise
            except Exception as e:  # noqa: BLE001 - delta-rs raises several types
                if table is None and any(m in str(e).lower() for m in ("exist", "not allowed for create")):
                    time.sleep(0.05)
                    continue  # being created by someone else meanwhile: read it again
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
           log entry, on S3 :class:`~onceflow.sinks.delta.log.StoreLog`'s conditional create of
           it): if anything was committed since step 1 (a successor's epoch, a rival
           decision, another writer), the log write fails and we start again at step 1.
        """
        meta = {
            "lineage": decision.lineage, "batch": decision.batch_id, "epoch": decision.epoch,
            "fingerprint": decision.fingerprint, "files": [h["path"] for h in decision.handles],
        }
        app, epoch_app = self.app_id(decision.lineage), self.epoch_app_id(decision.lineage)
        local = None if overwrite or self.upsert else self._commit_log()
        what = f"decide batch {decision.batch_id}"
        staged: list[pa.Table | None] = []  # an upsert's rows, read once for every attempt
        for _ in range(_MAX_CONFLICTS):
            # the log append below is conditional on the next entry's absence: no look for it
            view = self._view(decision.lineage, fast=local is not None, log=local, latest=False)
            current = None if view is None else view.transaction_version(epoch_app)
            if current != decision.epoch and isinstance(view, LogSnapshot):  # fence on the latest only
                view = self._view(decision.lineage, fast=True, log=local)
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
                if self.upsert is not None:
                    self._merge(view, decision, meta, staged)
                    self._remember(decision)
                    return
                files = add_files(decision.handles)
                schema_json = self._decided_shape(view, files, schema)
                if isinstance(view, LogSnapshot):
                    assert local is not None
                    landed = local.append(view, files, app, decision.batch_id, meta, schema_json)
                    if landed is None:
                        continue  # the log moved (or cannot take links): read it again
                    self._remember(decision)
                    self._checkpoint_log(local, landed.version)
                    return
                if schema_json is not None and not overwrite:
                    raise ConfigError(
                        f"onceflow-delta: batch {decision.batch_id} adds columns to {self.table_url}, "
                        "which only a local table of writer version 2 on a filesystem with hard links "
                        "(or such a table on S3) takes in the batch's own commit; nothing was committed: add the columns first")
                self._commit_with_delta_rs(view, files, decision, meta, overwrite, schema)
                self._remember(decision)
                return
            except CommitFailedError:
                log.debug("onceflow-delta: batch %d lost a commit race on %s; read again", decision.batch_id,
                          self.table_url)
                continue
            except OnceflowError:
                raise
            except Exception as e:  # noqa: BLE001 - delta-rs raises several types; say what failed
                raise SinkError(f"onceflow-delta: commit of batch {decision.batch_id} to "
                                f"{self.table_url} failed: {e}") from e
        raise SinkError(f"onceflow-delta: {self.table_url} changed under every one of {_MAX_CONFLICTS} "
                        f"attempts to commit batch {decision.batch_id}; retried by the restart strategy")

    def _decided_shape(self, view: LogSnapshot | DeltaTable | None, files: list[dict[str, Any]],
                       schema: StructType) -> str | None:
        """Check the decision against the snapshot it commits on: every file carries exactly
        its partition columns, and the stream fits its schema. The merged schema string when
        ``schema_mode=merge`` adds columns (the commit writes it as a metaData action), else None.
        A mismatch raises SinkError (the tasks wrote for another shape of the table: the batch
        is written again after the restart) or ConfigError; nothing is committed."""
        shape = self._shape(view)
        if shape is None:
            return None
        parts, schema_json = shape
        wrong = sorted({f["path"] for f in files if tuple(sorted(f.get("partition") or {})) != tuple(sorted(parts))})
        if wrong:
            raise SinkError(
                f"onceflow-delta: table {self.table_url} is partitioned by {list(parts)} but the batch's "
                f"files were written for another partitioning ({wrong[0]}...); nothing was committed "
                "(the restart writes the batch again for the table as it is)")
        _, _, new = self.write_plan(view, schema)
        return merged_schema_json(schema_json, to_arrow_schema(schema), new) if new else None

    def _commit_with_delta_rs(self, table: DeltaTable, files: list[dict[str, Any]], decision: Decision,
                              meta: dict[str, Any], overwrite: bool, schema: StructType) -> None:
        """One delta-rs commit on top of exactly ``table``'s version (CommitFailedError when
        anything landed since)."""
        adds = [
            AddAction(
                path=h["path"], size=h["size"], partition_values=h.get("partition") or {},
                modification_time=h["mtime"], data_change=True, stats=json.dumps({"numRecords": h["rows"]}),
            )
            for h in files
        ]
        parts, _, new = self.write_plan(table, schema)
        written = to_arrow_schema(schema)
        if new or self.schema_mode == "merge":  # the table's types and any new columns
            written = arrow_of(merged_schema_json(table.schema().to_json(), written, new))
        props = CommitProperties(
            custom_metadata={"onceflow": json.dumps(meta)},
            app_transactions=[Transaction(self.app_id(decision.lineage), decision.batch_id)],
            max_commit_retries=0,
        )
        table.create_write_transaction(adds, "overwrite" if overwrite else "append", written,
                                       partition_by=list(parts) or None, commit_properties=props)

    def _merge(self, table: DeltaTable, decision: Decision, meta: dict[str, Any],
               staged: list[pa.Table | None]) -> None:
        """An upsert's decision: one MERGE of the batch's staged rows (the last per key) on top
        of exactly ``table``'s version, with the batch's app transaction (:mod:`.upsert`)."""
        assert self.upsert is not None
        if not staged:
            fs, path = self._fs()
            rows = read_staged(fs, path, decision.handles)
            staged.append(None if rows is None else last_per_key(rows, self.upsert.keys, self.upsert.order_by))
        props = CommitProperties(
            custom_metadata={"onceflow": json.dumps(meta)},
            app_transactions=[Transaction(self.app_id(decision.lineage), decision.batch_id)],
            max_commit_retries=0,
        )
        if staged[0] is None:  # no rows: the decision alone
            table.create_write_transaction([], "append", pa.schema(table.schema().to_arrow()), commit_properties=props)
            return
        stats = merge(table, staged[0], self.upsert, props, self.schema_mode == "merge")
        log.debug("onceflow-delta: batch %d merged into %s: %s", decision.batch_id, self.table_url, stats)

    def _decided_here(self, lineage: str) -> OrderedDict[int, frozenset[str]]:
        """The files of the last :data:`_DECIDED_KEPT` batches decided or committed under this
        driver's epoch in this process (and those recovery read): a file of such a batch that
        its decision does not list is a late loser (:func:`~.files.losing_rule`). Kept per
        process: Spark makes a new data source per commit."""
        return _DECIDED.setdefault((self.table_url, lineage, self.epoch), OrderedDict())

    def _remember(self, decision: Decision) -> None:
        decided = self._decided_here(decision.lineage)
        decided[decision.batch_id] = frozenset(unit(h["path"]) for h in decision.handles)
        decided.move_to_end(decision.batch_id)
        while len(decided) > _DECIDED_KEPT:
            decided.popitem(last=False)

    def commit(self, decision: Decision) -> None:
        """Visible since :meth:`decide`; here only remove files of losing attempts.

        Never deletes a file the decision lists, nor one of a batch not known to be decided
        (in flight), nor one written under a newer epoch than this driver's; when the
        decision's file list is unknown (its log entry was cleaned up) nothing is deleted at
        all. Besides the batch's own losers, the same listing sweeps late files of any of the
        last 1000 batches decided here (:func:`~.files.losing_rule`): those of stragglers,
        speculative attempts, lost executors and woken zombies that finished after their
        batch committed, of this driver's epoch or an older one. On an object store the
        listing is bounded by name prefixes (:func:`~.files.sweep_prefixes`): the batch's own
        units at each commit, the last 20 batches of this epoch at every 10th batch, every
        batch decided here for this epoch and the two before it at every 100th batch; recovery
        still lists the whole lineage.
        """
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)
        if decision.handles is None:
            return
        if self.upsert is not None:  # staged rows are merged: every staged file up to here goes
            self._remove_files(decision.lineage, staged_rule(decision.batch_id, self.epoch))
            return
        self._remember(decision)  # a replay's too: its late files are swept by later commits
        keep = {unit(h["path"]) for h in decision.handles}
        decided_here = self._decided_here(decision.lineage)
        self._remove_files(decision.lineage, losing_rule(decision.batch_id, keep, self.epoch, decided_here),
                           sweep_prefixes(decision.lineage, decision.batch_id, self.epoch, decided_here))

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        fs, path = self._fs()
        for name in {unit(h["path"]) for h in handles if h}:
            if fs.exists(f"{path}/{name}"):
                fs.rm(f"{path}/{name}", recursive=True)

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Delete this lineage's files that no decision references, written under an older epoch.

        Orphans are files of batches after the last decided one, files of the last decided
        batch that its decision does not list (a crash interrupted :meth:`commit`'s cleanup),
        and files of earlier batches decided in the last :data:`_SWEEP_VERSIONS` log versions
        that their decision does not list (late files of stragglers that finished after the
        previous driver's last commit). Files any decision lists are never touched, so time
        travel keeps working; a batch whose decision is not read is left alone. Only files of
        epochs older than this driver's are candidates: a file of this or a newer epoch may be
        in flight (and no older epoch can decide any more, so an old orphan stays an orphan).
        The decisions read seed :meth:`_decided_here`, so later commits sweep files that
        appear even later.
        """
        table = self._table()
        if table is None:
            return {"orphans_removed": 0}
        mine = self.epoch
        version = table.transaction_version(self.app_id(lineage))
        last = -1 if version is None else version
        keep = {unit(h["path"]) for h in in_flight if h}
        if self.upsert is not None:
            return {"orphans_removed": self._remove_files(lineage, staged_rule(last, mine, keep))}
        decided = recent_decisions(table, lineage, _SWEEP_VERSIONS) if last >= 0 else {}
        last_files: set[str] | None = set()
        if last in decided:
            last_files = set(decided[last])
        elif last >= 0:
            meta = commit_meta(table, lineage, last)  # None: unknown file list, spare them
            last_files = None if meta is None else {unit(p) for p in meta.get("files", [])}
        here = self._decided_here(lineage)
        for b in sorted(decided):
            here.setdefault(b, decided[b])
        while len(here) > _DECIDED_KEPT:
            here.popitem(last=False)

        orphan = orphan_rule(keep, mine, last, last_files, decided)

        return {"orphans_removed": self._remove_files(lineage, orphan)}

    def _remove_files(self, lineage: str, predicate, prefixes: list[str] | None = None) -> int:
        """Delete this lineage's units (task files, per-batch directories) for which
        ``predicate(batch, epoch, unit_name)`` holds (:func:`~.files.remove_units`)."""
        fs, path = self._fs()
        return remove_units(fs, path, lineage, predicate, prefixes)
