"""The Iceberg sink's data source: decision, fencing, recovery, and the tasks' Parquet files.

Guarantee (append): every batch's rows are in the table exactly once per lineage, through any
crash, a paused driver that wakes up after a successor took over, a lost commit reply, and
commits of other writers landing at any moment.

Tasks write one Parquet file per attempt into the table's ``data/`` directory, named
``part-of-<lineage>-e<epoch>-b<batch>-p<part>-a<attempt>-<uuid>.parquet``; no snapshot lists
them yet, so no reader sees them. The driver decides and commits in one step: one snapshot on
``main`` that adds the batch's files (pyiceberg ``add_files``: each file's footer is read for
its statistics) and carries (sink, lineage, batch, epoch, fingerprint, files) in its summary,
together with the lineage's state property (:mod:`.state`), committed with the catalog's
conditional update. So "after decide" and "mid-commit" are no windows here: what is decided
is visible. Files of failed or speculative attempts are deleted after the commit and on
recovery.

Upserts (``write=upsert``, :mod:`.upsert`): the tasks' files are staged rows; the decision
snapshot removes the data files holding the batch's keys and adds their rewrites and the
batch's winning rows (summary entry ``onceflow.outputs``), with the same check, fence and
conditional commit; after a refused commit the same plan is committed on the new metadata
when the commits in between only appended files without the batch's keys, else it is planned
again there (:class:`~.upsert.UpsertPlan`). The staged files are deleted after the commit like
a losing attempt's.

Fencing: :meth:`IcebergDataSource.acquire_epoch` commits a snapshot (no files) raising the
lineage's epoch. Each decision is checked against, and committed on top of, exactly the
metadata it read: its commit requires ``main`` to still be at the snapshot it was based on, so
any commit in between (a successor's epoch, another writer's append) makes it fail with
``CommitFailedException``, and the check runs again on the new metadata. pyiceberg's own retry,
which would rebase the snapshot onto the new metadata without that check, is turned off
(:func:`_checked_transaction`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow.parquet as pq
from pyspark.sql.types import StructType

try:  # pyiceberg.table (about 0.5 s) is imported where a driver commits, not by every task
    from pyiceberg.exceptions import (
        CommitFailedException,
        CommitStateUnknownException,
        NoSuchTableError,
        TableAlreadyExistsError,
    )
except ModuleNotFoundError as e:  # an ImportError still: the sink registry skips this sink
    raise ModuleNotFoundError(f"onceflow's Iceberg sink needs pyiceberg ({e}): "
                              "pip install 'onceflow[iceberg]'", name=e.name) from None

from onceflow.errors import ConfigError, SinkError
from onceflow.faults import maybe_crash
from onceflow.sinks.base import Decision, TaskInfo, TwoPhaseCommitSink, fenced
from onceflow.sinks.files import (
    compatible,
    dictionary_columns,
    file_name,
    orphan_rule,
    parquet_codec,
    remove_units,
    sweep_prefixes,
    to_arrow_schema,
)
from onceflow.sinks.iceberg import catalog as catalogs
from onceflow.sinks.iceberg.fileio import with_storage
from onceflow.sinks.iceberg.state import (
    FILES,
    FINGERPRINT,
    LineageState,
    decision_properties,
    decision_summary,
    lineage_state,
    state_key,
)
from onceflow.sinks.iceberg.upsert import (
    OUTPUTS,
    BatchChange,
    UpsertPlan,
    UpsertSpec,
    check_keys,
    read_staged,
    rewrites,
    write_file,
)
from onceflow.storage import as_options, url_to_fs

log = logging.getLogger(__name__)

#: Conditional commits lost to other writers of the table before giving up (SinkError).
_MAX_CONFLICTS = 100
_DECIDED_KEPT = 1000  # batches whose files a late writer's orphans are checked against
_DECIDED: dict[tuple[str, str, int | None], OrderedDict[int, frozenset[str]]] = {}


@functools.cache
def _checked_transaction() -> type:
    """A pyiceberg transaction class that commits on top of its base metadata or not at all.

    pyiceberg (>= 0.12) retries a commit that lost a race by rebuilding its snapshot on the new
    metadata; that would skip onceflow's fence and decided-batch check, which must see the
    metadata the commit lands on. Here the rebuild raises ``CommitFailedException`` instead
    (pyiceberg then deletes the attempt's manifests), and :meth:`IcebergDataSource.decide`
    re-reads and re-checks. pyiceberg's check that an earlier attempt of this very
    transaction landed (a lost reply within the retry) still runs first."""
    from pyiceberg.table import Transaction

    class CheckedTransaction(Transaction):
        def _rebuild_snapshot_updates(self) -> None:
            raise CommitFailedException("onceflow: the table changed; the fence is checked again first")

    return CheckedTransaction


class IcebergDataSource(TwoPhaseCommitSink):
    """``df.writeStream.format("onceflow-iceberg").option("catalog", URL).option("table", "ns.t")``."""

    format_name = "onceflow-iceberg"
    atomic_decide_commit = True
    required_options = ("catalog", "table")
    options_doc = {
        "catalog": "SQLAlchemy URL of a SQL catalog (sqlite:///path/catalog.db, "
                   "postgresql+psycopg://...) or a JSON object of pyiceberg catalog properties",
        "table": "table identifier namespace.name (created on open if it does not exist)",
        "warehouse": "where new tables' files go (default for SQLite: 'warehouse' beside the database)",
        "catalog_name": "the catalog's name for pyiceberg (default 'onceflow')",
        "sink_id": "name of this sink within the job, part of its summary and state keys (default 'iceberg')",
        "mode": "append (the only output mode); default: the query's output mode, which must be append",
        "write": "append (default) or upsert (one snapshot per batch: the batch's keys replaced or deleted)",
        "keys": "upsert: the columns that identify a row, a JSON list or comma-separated",
        "order_by": "upsert: a column ordering a key's events within a batch (largest wins; default: "
                    "the batch's order, task partition then row position)",
        "delete_column": "upsert: a boolean column; a winning event where it is true deletes the key "
                         "(never written; IcebergSink(delete_when=...) computes it)",
        "row_group_rows": "rows per Parquet row group (default 1000000)",
        "compression": "Parquet codec of the data files: zstd (default, as Iceberg's "
                       "write.parquet.compression-codec), snappy (what Spark's Parquet sink writes), "
                       "lz4, gzip, brotli or none",
        "storage_options": "JSON object of object-store options (fsspec or delta-rs keys) for the tasks' "
                           "files and, translated to s3.*/adls.* properties, pyiceberg's FileIO "
                           "(default: the job's)",
    }

    def __init__(self, options):
        super().__init__(options)
        raw = self.opts["catalog"].strip()
        catalog: Any = raw
        if raw.startswith("{"):
            try:
                catalog = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"onceflow-iceberg: option catalog is not valid JSON: {e}") from None
        self.identifier = self.opts["table"].strip()
        if "." not in self.identifier:
            raise ConfigError(f"onceflow-iceberg: table={self.identifier!r}; give namespace.name, "
                              "e.g. 'lake.orders'")
        self.sink_id = self.opts.get("sink_id") or "iceberg"
        self.mode = self.opts.get("mode") or None
        if self.mode not in (None, "append"):
            raise ConfigError(f"onceflow-iceberg: mode={self.mode!r} is not supported; use 'append' "
                              "(complete is not implemented; for upserts give write='upsert' and keys)")
        self.upsert = UpsertSpec.from_options(self.opts)
        self.storage_options = as_options(self.opts.get("storage_options") or None,
                                          "onceflow-iceberg: option storage_options")
        # pyiceberg's FileIO gets the same store options as the tasks' fsspec writes
        self.spec = with_storage(catalogs.catalog_spec(catalog, self.opts.get("warehouse") or None,
                                                       self.opts.get("catalog_name") or "onceflow"),
                                 self.storage_options)
        try:
            self.row_group_rows = int(self.opts.get("row_group_rows", 1_000_000))
        except ValueError:
            raise ConfigError("onceflow-iceberg: row_group_rows must be a whole number") from None
        self.compression = parquet_codec(self.opts.get("compression") or "zstd", "onceflow-iceberg: compression")

    # ---- the table ------------------------------------------------------------------

    def _catalog(self):
        return catalogs.load(self.spec)

    def _table(self):
        """The table at the catalog's current metadata, None when it does not exist."""
        try:
            return self._catalog().load_table(self.identifier)
        except NoSuchTableError:
            return None
        except Exception as e:  # noqa: BLE001 - database or network errors: an outage
            raise SinkError(f"onceflow-iceberg: cannot load {self.identifier} from "
                            f"{catalogs.redacted(self.spec)}: {e}") from e

    def _data_dir(self, table=None) -> tuple[Any, str]:
        """(fsspec filesystem, path) of the table's ``data/`` directory, where tasks write."""
        location = self.__dict__.get("_location")
        if location is None:
            table = table or self._table()
            if table is None:
                raise SinkError(f"onceflow-iceberg: table {self.identifier} does not exist (yet); "
                                "the sink creates it when the query starts")
            location = self.__dict__["_location"] = table.location().rstrip("/")
        fs, path = url_to_fs(f"{location}/data", self.storage_options)
        return fs, path

    def _state(self, table, lineage: str) -> LineageState:
        return lineage_state(table.metadata, self.sink_id, lineage)

    # ---- validation -----------------------------------------------------------------

    def validate(self, schema: StructType, overwrite: bool) -> None:
        """Append only; the table is created from ``schema`` if missing, else its columns must
        match the stream's."""
        if overwrite:
            raise ConfigError("onceflow-iceberg: the query's output mode is complete; the Iceberg "
                              "sink supports append only so far (use outputMode('append'))"
                              + ("; write='upsert' replaces rows by key in append mode" if self.upsert else ""))
        if self.upsert is not None:
            self.upsert.check(to_arrow_schema(schema))
        table = self._table()
        if table is None:  # created now, so that tasks know where to write before any commit
            self.write_schema = schema
            table = self._create()
        if not table.spec().is_unpartitioned():
            fields = ", ".join(f"{f.name}={f.transform}" for f in table.spec().fields)
            raise ConfigError(f"onceflow-iceberg: table {self.identifier} is partitioned "
                              f"({fields}); the sink writes unpartitioned tables only so far "
                              "(a task's file may span partitions): use an unpartitioned table, or a "
                              "new name for the sink to create")
        want = {f.name: f.type for f in self._table_schema(schema)}
        have = {f.name: f.type for f in table.schema().as_arrow()}
        if want.keys() != have.keys():
            raise ConfigError(
                f"onceflow-iceberg: the stream's columns {sorted(want)} do not match table "
                f"{self.identifier} columns {sorted(have)}; select matching columns or use a new table"
            )
        bad = [f"{n} ({want[n]} vs table {have[n]})" for n in want if not compatible(want[n], have[n])]
        if bad:
            raise ConfigError(f"onceflow-iceberg: column types differ from table {self.identifier}: "
                              f"{', '.join(bad)}; cast them in the transform or use a new table")

    def _table_schema(self, schema: StructType):
        """The Arrow schema of the table's columns: the stream's without an upsert's delete column."""
        arrow = to_arrow_schema(schema)
        column = self.upsert.delete_column if self.upsert else None
        return arrow.remove(arrow.get_field_index(column)) if column in arrow.names else arrow

    # ---- tasks ----------------------------------------------------------------------

    def is_decided(self, lineage: str, batch_id: int) -> bool:
        table = self._table()
        return table is not None and self._state(table, lineage).batch >= batch_id

    def pre_commit(self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator):
        """One Parquet file in ``data/`` (no field ids: the table's name mapping applies)."""
        arrow_schema = to_arrow_schema(schema)
        fs, path = self._data_dir()
        name = file_name(task, self.epoch)
        full, rows, writer = f"{path}/{name}", 0, None
        fs.makedirs(path, exist_ok=True)
        if self.upsert is not None:
            self.upsert.check(arrow_schema)
            if self.upsert.delete_column and self.upsert.delete_column not in arrow_schema.names:
                raise ConfigError(f"onceflow-iceberg: the stream has no delete column "
                                  f"{self.upsert.delete_column!r}")
        try:
            with fs.open(full, "wb") as f:
                try:
                    for batch in batches:
                        if batch.num_rows:
                            batch = batch.cast(arrow_schema) if batch.schema != arrow_schema else batch
                            if self.upsert is not None:
                                check_keys(batch, self.upsert)
                            if writer is None:
                                writer = pq.ParquetWriter(f, arrow_schema, compression=self.compression,
                                                          use_dictionary=dictionary_columns(batch))
                            writer.write_batch(batch, row_group_size=self.row_group_rows)
                            rows += batch.num_rows
                finally:
                    if writer is not None:
                        writer.close()
        except ConfigError:  # rows this sink refuses (null upsert keys): leave no file behind
            fs.rm(full)
            raise
        if rows == 0:
            fs.rm(full)
            return None, 0
        return {"path": name, "rows": rows}, rows

    # ---- driver ---------------------------------------------------------------------

    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        table = self._table()
        if table is None or self._state(table, lineage).batch < batch_id:
            return None
        return self._stored(table, lineage, batch_id)

    def _stored(self, table, lineage: str, batch_id: int) -> Decision:
        summary = decision_summary(table.metadata, self.sink_id, lineage, batch_id)
        if summary is None:  # decided, but its snapshot was expired: files unknown
            return Decision(lineage, batch_id, "unknown", handles=None)
        files = json.loads(summary.get(FILES) or "[]")
        return Decision(lineage, batch_id, summary.get(FINGERPRINT) or "unknown",
                        [{"path": p} for p in files], int(summary["onceflow.epoch"]))

    def acquire_epoch(self, lineage: str) -> int:
        """Commit epoch+1 of (sink, lineage): a snapshot without files; create the table first
        if it does not exist (from the stream's schema)."""
        for _ in range(_MAX_CONFLICTS):
            table = self._table() or self._create()
            state = self._state(table, lineage)
            epoch = (state.epoch or 0) + 1
            try:
                self._commit(table, lineage, LineageState(epoch, state.batch),
                             decision_properties(self.sink_id, lineage, epoch), [])
                return epoch
            except CommitFailedException:
                continue  # another commit landed first: read the metadata again
            except Exception as e:  # noqa: BLE001 - the catalog's database down, a lock timeout...
                raise SinkError(f"onceflow-iceberg: cannot open {self.identifier} for lineage "
                                f"{lineage}: {e}") from e
        raise SinkError(f"onceflow-iceberg: {self.identifier} changed under every one of "
                        f"{_MAX_CONFLICTS} attempts to take an epoch; retried by the restart strategy")

    def _create(self):
        if self.write_schema is None:
            raise ConfigError(f"onceflow-iceberg: table {self.identifier} does not exist and the "
                              "stream's schema is unknown; start the query to create it")
        catalog = self._catalog()
        try:
            catalog.create_namespace_if_not_exists(self.identifier.rsplit(".", 1)[0])
            return catalog.create_table(self.identifier, schema=self._table_schema(self.write_schema))
        except TableAlreadyExistsError:  # created by another driver meanwhile
            return self._table()
        except Exception as e:  # noqa: BLE001 - say which table could not be created
            raise SinkError(f"onceflow-iceberg: cannot create {self.identifier}: {e}") from e

    def _commit(self, table, lineage: str, state: LineageState, summary: dict[str, str],
                files: list[str]) -> None:
        """One conditional commit on top of exactly ``table``'s metadata: a snapshot adding
        ``files`` (names in ``data/``) with this summary, and the lineage's state property.
        CommitFailedException when anything was committed since ``table`` was loaded."""
        tx = _checked_transaction()(table)
        tx.set_properties({state_key(self.sink_id, lineage): state.as_property()})
        if files:
            location = table.location().rstrip("/")
            tx.add_files([f"{location}/data/{name}" for name in files], snapshot_properties=summary,
                         check_duplicate_files=False)
        else:
            with tx.update_snapshot(snapshot_properties=summary).fast_append():
                pass
        tx.commit_transaction()

    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        """Decide and commit batch N in one snapshot. Steps, each on the same metadata, with
        the fault each survives:

        1. load the table's current metadata;
        2. the lineage's stored epoch must be the caller's (a successor opened the sink while
           this driver was paused: FencedError, nothing committed);
        3. batch N must be undecided there, or decided with this very decision: a replay, a
           retried decide or a reply lost after the commit landed returns without committing;
           a rival decision raises FencedError;
        4. commit on top of exactly that metadata; if anything landed since step 1 (another
           writer, a successor's epoch) the catalog refuses it and we start again at step 1.
           A commit whose outcome is unknown also goes back to step 1, where step 3 finds it if
           it landed.
        """
        names = [h["path"] for h in decision.handles]
        what = f"decide batch {decision.batch_id}"
        plan: UpsertPlan | None = None
        for attempt in range(_MAX_CONFLICTS):
            table = self._table()
            state = LineageState(None, -1) if table is None else self._state(table, decision.lineage)
            if state.epoch != decision.epoch:  # the plan's files stay: its last commit may have
                # landed despite the refusal (unchecked here); the successor's recovery decides
                raise fenced(self.format_name, decision.lineage, decision.epoch, state.epoch, what)
            if state.batch >= decision.batch_id:
                stored = self._stored(table, decision.lineage, decision.batch_id)
                if (stored.handles is not None and stored.epoch == decision.epoch
                        and stored.fingerprint == decision.fingerprint
                        and sorted(h["path"] for h in stored.handles) == sorted(names)):
                    added = self._added(table, decision.lineage, decision.batch_id)
                    self._remember(decision, names if added is None else added)
                    return  # our own earlier attempt landed
                if stored.handles is not None:  # another decision's snapshot: ours never landed
                    self._discard(plan)
                raise fenced(self.format_name, decision.lineage, decision.epoch, state.epoch,
                             f"{what} (already decided by another commit)")
            summary = decision_properties(self.sink_id, decision.lineage, decision.epoch,
                                          decision.batch_id, decision.fingerprint, names)
            try:
                if self.upsert is None:
                    self._commit(table, decision.lineage, LineageState(decision.epoch, decision.batch_id),
                                 summary, names)
                    added = names
                else:
                    plan = self._plan_upsert(table, decision, attempt, plan)
                    added = self._commit_upsert(table, decision, summary, plan)
            except CommitFailedException:
                continue
            except CommitStateUnknownException:
                plan = None  # it may have landed (step 3 tells): its files are never reused or deleted
                continue
            except Exception as e:  # noqa: BLE001 - a file gone, the catalog's database down...
                # Whether or not it landed, the restarted driver's step 3 finds out.
                raise SinkError(f"onceflow-iceberg: commit of batch {decision.batch_id} to "
                                f"{self.identifier} failed: {e}") from e
            self._remember(decision, added)
            maybe_crash("after_catalog_commit", decision.batch_id, None, self.opts)
            return
        # the last refusal was not checked against a commit that landed anyway (a catalog that
        # said "failed" for one): the plan's files stay for the restarted driver's recovery
        raise SinkError(f"onceflow-iceberg: {self.identifier} changed under every one of "
                        f"{_MAX_CONFLICTS} attempts to commit batch {decision.batch_id}; retried "
                        "by the restart strategy")

    def _decided_here(self, lineage: str) -> OrderedDict[int, frozenset[str]]:
        """Files of the last batches decided under this driver's epoch in this process (a late
        file of an older epoch for such a batch is an orphan; see :meth:`commit`)."""
        return _DECIDED.setdefault((self.identifier, lineage, self.epoch), OrderedDict())

    def _plan_upsert(self, table, decision: Decision, attempt: int, prior: UpsertPlan | None) -> UpsertPlan:
        """The upsert commit of this batch on ``table``'s metadata (:mod:`.upsert`): ``prior``
        when it still holds there, else a new plan (``prior``'s files deleted: refused, no
        snapshot references them) that removes the data files holding the batch's keys and
        writes their rewrites and a file of the winning rows."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file, schema_to_pyarrow

        if prior is not None and prior.holds_on(table):
            current = table.current_snapshot()  # checked up to here: the next check walks from it
            prior.base = current.snapshot_id if current else None
            return prior
        fs, path = self._data_dir(table)
        if prior is None:
            change = BatchChange.of(read_staged(fs, path, [h["path"] for h in decision.handles]), self.upsert)
        else:
            change = prior.change
            log.info("onceflow-iceberg: batch %s: %s changed the batch's keys or the table's layout "
                     "meanwhile; planning again", decision.batch_id, self.identifier)
            self._drop(fs, path, prior.added)
        target, location = schema_to_pyarrow(table.schema()), table.location().rstrip("/")
        snapshot = table.current_snapshot()
        plan = UpsertPlan(change, snapshot.snapshot_id if snapshot else None, table.metadata.current_schema_id,
                          table.metadata.default_spec_id, [], [], [])

        def write(part: int, rows) -> None:
            name = file_name(TaskInfo(decision.lineage, decision.batch_id, part, attempt), decision.epoch)
            plan.added.append(name)
            write_file(fs, f"{path}/{name}", rows, target, self.compression)

        try:
            for part, (data_file, kept) in enumerate(rewrites(table, change), start=1):
                plan.removed.append(data_file)
                if kept is not None:
                    write(part, kept)
            if change.upserts.num_rows:
                write(0, change.upserts)
            plan.files = [parquet_file_to_data_file(table.io, table.metadata, f"{location}/data/{n}")
                          for n in plan.added]
        except BaseException:
            self._drop(fs, path, plan.added)
            raise
        return plan

    @staticmethod
    def _drop(fs, path: str, names: list[str]) -> None:
        for name in names:
            if fs.exists(f"{path}/{name}"):
                fs.rm(f"{path}/{name}")

    def _discard(self, plan: UpsertPlan | None) -> None:
        """Delete the files of a plan that cannot have landed (the batch is another decision's)."""
        if plan is not None:
            self._drop(*self._data_dir(), plan.added)

    def _commit_upsert(self, table, decision: Decision, summary: dict[str, str], plan: UpsertPlan) -> list[str]:
        """One conditional commit of ``plan`` on top of exactly ``table``'s metadata: one
        snapshot removing its data files and adding its files, with ``summary`` (plus the files
        it adds) and the lineage's state property. Returns the names of the files it added.
        CommitFailedException (nothing landed) when anything was committed since ``table`` was
        loaded; the plan's files stay for the next attempt (:meth:`_plan_upsert`)."""
        tx = _checked_transaction()(table)
        tx.set_properties({state_key(self.sink_id, decision.lineage):
                           LineageState(decision.epoch, decision.batch_id).as_property()})
        producer = tx.update_snapshot(snapshot_properties=summary | {OUTPUTS: json.dumps(plan.added)})
        with producer.overwrite() if plan.removed else producer.fast_append() as snapshot:
            for data_file in plan.removed:
                snapshot.delete_data_file(data_file)
            for data_file in plan.files:
                snapshot.append_data_file(data_file)
        tx.commit_transaction()
        return plan.added

    def _added(self, table, lineage: str, batch_id: int) -> list[str] | None:
        """Names of the data files the decision of batch N added (None: its snapshot expired)."""
        summary = decision_summary(table.metadata, self.sink_id, lineage, batch_id)
        if summary is None:
            return None
        return json.loads(summary.get(OUTPUTS) or summary.get(FILES) or "[]")

    def _remember(self, decision: Decision, added: list[str]) -> None:
        decided = self._decided_here(decision.lineage)
        decided[decision.batch_id] = frozenset(added)
        while len(decided) > _DECIDED_KEPT:
            decided.popitem(last=False)

    def commit(self, decision: Decision) -> None:
        """Visible since :meth:`decide`; here only remove files of losing attempts.

        Never deletes a file the decision lists, nor one of a newer epoch than this driver's;
        with an unknown file list (its snapshot was expired) nothing at all. Also removes files
        that an older epoch's tasks wrote late for batches this driver decided (recovery ran
        before they appeared)."""
        maybe_crash("mid_commit", decision.batch_id, None, self.opts)
        if decision.handles is None:
            return
        mine, decided_here = self.epoch, self._decided_here(decision.lineage)
        if self.upsert is None:
            keep = {h["path"] for h in decision.handles}
        elif decision.batch_id in decided_here:
            keep = set(decided_here[decision.batch_id])
        else:  # a replay: the files its snapshot added (staged files are never kept)
            table = self._table()
            added = None if table is None else self._added(table, decision.lineage, decision.batch_id)
            if added is None:
                return
            keep = set(added)

        def losing(b: int, e: int, name: str) -> bool:
            if b == decision.batch_id:
                return name not in keep and (mine is None or e <= mine)
            return mine is not None and e < mine and b in decided_here and name not in decided_here[b]

        fs, path = self._data_dir()
        if fs.exists(path):
            remove_units(fs, path, decision.lineage, losing,
                         sweep_prefixes(decision.lineage, decision.batch_id, mine, decided_here))

    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        if "_location" not in self.__dict__ and self._table() is None:
            return  # no table: no task could have written
        fs, path = self._data_dir()
        for name in {h["path"] for h in handles if h}:
            if fs.exists(f"{path}/{name}"):
                fs.rm(f"{path}/{name}")

    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Delete this lineage's files that no decision references, written under an older epoch:
        files of batches after the last decided one, and files of the last decided batch that
        its decision does not list. Files of this or a newer epoch may be in flight; no older
        epoch can decide any more, so an old orphan stays an orphan."""
        table = self._table()
        if table is None:
            return {"orphans_removed": 0}
        mine, last = self.epoch, self._state(table, lineage).batch
        keep = {h["path"] for h in in_flight if h}
        last_files: set[str] | None = set()
        if last >= 0:
            added = self._added(table, lineage, last)
            last_files = None if added is None else set(added)

        orphan = orphan_rule(keep, mine, last, last_files)

        fs, path = self._data_dir(table)
        if not fs.exists(path):
            return {"orphans_removed": 0}
        return {"orphans_removed": remove_units(fs, path, lineage, orphan)}

    def describe_guarantee(self) -> str:
        if self.upsert is not None:
            return (f"exactly-once (upsert on {', '.join(self.upsert.keys)}): one Iceberg snapshot per "
                    "batch replaces or deletes its keys (last event per key wins) and carries (lineage, "
                    "batch, epoch), committed conditionally; replays and lost replies apply nothing")
        return ("exactly-once (append): one Iceberg snapshot per batch carrying (lineage, batch, "
                "epoch), committed conditionally; replays and lost replies find it and commit nothing")


