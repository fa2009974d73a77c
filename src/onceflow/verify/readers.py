"""Independent readers: what a sink made visible, read without any onceflow sink code.

* Delta: delta-rs reads the table's log and files (the sink's decision and fencing code is
  not involved). Dangling: Parquet files in the table directory that no log entry adds, and
  directories (the JVM write path's per-attempt ones) none of whose files it adds.
* PostgreSQL: a plain ``SELECT``. Dangling: prepared transactions of this sink
  (``pg_prepared_xacts``) still waiting for a decision.
* Kafka: a ``read_committed`` consumer reading every partition to its end, and on until it is
  quiet (a broker may report too early an end: tansu does). A broker that does
  not hide aborted transactions shows their records here as duplicates (the defect onceflow's
  broker probe warns about). Dangling: not observable from a client (open transactions are
  aborted by the broker's transaction timeout), reported as none.
* Iceberg: pyiceberg's scan of the table's current snapshot (manifests and Parquet files read
  by pyiceberg and pyarrow; no sink code). Dangling: Parquet files in the table's ``data/``
  directory that no snapshot lists. :func:`iceberg_decided` reads the batch ids the snapshot
  summaries record, for the upsert check (a batch applied twice or never).

Each reader returns a table ``(id int64, payload string, checksum int64)`` (the ``*-upsert``
sinks: also ``key int64``).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from urllib.parse import unquote

import pyarrow as pa

from onceflow.extras import require
from onceflow.verify.spec import VerifySpec

SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.string()), ("checksum", pa.int64())])


def read_output(spec: VerifySpec) -> pa.Table:
    if spec.sink.startswith("delta"):
        return _read_delta(spec)
    if spec.sink.startswith("postgres"):
        return _read_postgres(spec)
    if spec.sink.startswith("iceberg"):
        return _read_iceberg(spec)
    return _read_kafka(spec)


def dangling(spec: VerifySpec) -> list[str]:
    """Transactions or files a sink prepared and never resolved."""
    if spec.sink.startswith("delta"):
        return _delta_orphans(spec)
    if spec.sink.startswith("postgres"):
        rows = _pg_query(spec, "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                         (f"onceflow:{spec.sink_id}:%",))
        return [r[0] for r in rows]
    if spec.sink.startswith("iceberg"):
        return _iceberg_orphans(spec)
    return []


def _iceberg_table(spec: VerifySpec):
    """The table through pyiceberg's own SQL catalog (None: never created)."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    db = spec.iceberg_catalog.removeprefix("sqlite:///")
    if not os.path.exists(db):
        return None
    try:
        return SqlCatalog("onceflow", uri=spec.iceberg_catalog).load_table(spec.table)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


def _read_iceberg(spec: VerifySpec) -> pa.Table:
    table = _iceberg_table(spec)
    columns = ["id", "payload", "checksum"] + (["key"] if spec.sink == "iceberg-upsert" else [])
    schema = SCHEMA.append(pa.field("key", pa.int64())) if "key" in columns else SCHEMA
    if table is None:
        return schema.empty_table()
    return table.scan(selected_fields=tuple(columns)).to_arrow().select(columns).cast(schema)


def _iceberg_orphans(spec: VerifySpec) -> list[str]:
    table = _iceberg_table(spec)
    if table is None:
        return []
    live = {p.rsplit("/", 1)[-1] for p in table.inspect.all_files().column("file_path").to_pylist()}
    data = os.path.join(table.location().removeprefix("file://"), "data")
    names = os.listdir(data) if os.path.isdir(data) else []
    return sorted(n for n in names if n.endswith(".parquet") and n not in live)


def iceberg_decided(spec: VerifySpec) -> list[int]:
    """Batch ids recorded in the summaries of the table's snapshots of this run's sink (one
    entry per snapshot: a batch applied twice appears twice)."""
    table = _iceberg_table(spec)
    out = []
    for snap in table.metadata.snapshots if table is not None else ():
        props = snap.summary.additional_properties if snap.summary is not None else {}
        if props.get("onceflow.sink") == spec.sink_id and "onceflow.batch" in props:
            out.append(int(props["onceflow.batch"]))
    return out


def delta_decided(spec: VerifySpec) -> list[int]:
    """Batch ids of the decisions in the table's raw JSON log (commitInfo's ``onceflow`` entry
    of every commit that decided a batch: a MERGE, or an empty batch's commit); one entry per
    commit, so a batch applied twice appears twice."""
    out = []
    log_dir = os.path.join(spec.table, "_delta_log")
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else ():
        if not name.endswith(".json"):
            continue
        with open(os.path.join(log_dir, name)) as f:
            for action in map(json.loads, f):
                meta = (action.get("commitInfo") or {}).get("onceflow")
                meta = json.loads(meta) if isinstance(meta, str) else meta
                if meta and isinstance(meta.get("batch"), int):
                    out.append(meta["batch"])
    return out


def _read_delta(spec: VerifySpec) -> pa.Table:
    require("delta", "reading a Delta table back")
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    upsert = spec.sink == "delta-upsert"
    schema = SCHEMA.append(pa.field("key", pa.int64())) if upsert else SCHEMA
    try:
        table = DeltaTable(spec.table).to_pyarrow_table(columns=schema.names)
    except TableNotFoundError:  # nothing was ever committed
        return schema.empty_table()
    return table.cast(schema)


#: the data files delta-rs's MERGE writes (onceflow's own are named ``part-of-<lineage>-...``)
_MERGE_FILE = re.compile(r"part-\d{5}-[0-9a-f-]{36}-c\d{3}(\.\w+)?\.parquet")


def _delta_orphans(spec: VerifySpec) -> list[str]:
    """onceflow's unresolved files. For upserts, data files of a MERGE whose commit lost (a
    zombie's, or one that lost a race to another writer) are not counted: delta-rs writes them
    before its commit and leaves them, unreferenced and invisible, to the table's VACUUM, as
    Spark's Delta MERGE does (docs/delta-sink.md)."""
    found = delta_dangling(spec.table)
    if spec.sink == "delta-upsert":
        found = [f for f in found if not _MERGE_FILE.fullmatch(f.rsplit("/", 1)[-1])]
    return found


def _removed(table: str) -> set[str]:
    """Paths of the remove actions in the table's JSON log entries."""
    out: set[str] = set()
    log_dir = os.path.join(table, "_delta_log")
    for name in os.listdir(log_dir) if os.path.isdir(log_dir) else ():
        if name.endswith(".json"):
            with open(os.path.join(log_dir, name)) as f:
                out |= {unquote(a["remove"]["path"]) for a in map(json.loads, f) if "remove" in a}
    return out


def delta_dangling(table: str) -> list[str]:
    """What a local Delta table directory holds that no log entry adds: Parquet files the log
    does not list, and directories (the JVM write path's per-attempt directories, possibly
    half-written) none of whose files the log lists, named with a trailing ``/``. Files that a
    later version removed (an upsert's MERGE rewrites files) are the log's, kept for time
    travel until a VACUUM: not dangling."""
    require("delta", "reading a Delta table back")
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    if not os.path.isdir(table):
        return []
    try:
        adds = pa.table(DeltaTable(table).get_add_actions(flatten=True)).column("path").to_pylist()
    except TableNotFoundError:
        adds = []
    live = {unquote(p) for p in adds} | _removed(table)  # the log's paths are URIs (escaped)
    live_dirs = {p.split("/", 1)[0] for p in live if "/" in p}
    out = []
    for name in os.listdir(table):
        if os.path.isdir(os.path.join(table, name)):
            if name == "_delta_log":
                continue
            if name not in live_dirs:
                out.append(f"{name}/")
                continue
            for root, _, files in os.walk(os.path.join(table, name)):
                rel = os.path.relpath(root, table).replace(os.sep, "/")
                out += [f"{rel}/{f}" for f in files if f.endswith(".parquet") and f"{rel}/{f}" not in live]
        elif name.endswith(".parquet") and name not in live:
            out.append(name)
    return sorted(out)


def _pg_query(spec: VerifySpec, sql: str, params: tuple = ()) -> list[tuple]:
    import psycopg

    with psycopg.connect(spec.postgres, autocommit=True, connect_timeout=10) as conn:
        return conn.execute(sql, params).fetchall()


def _read_postgres(spec: VerifySpec) -> pa.Table:
    import psycopg
    from psycopg import sql

    query = sql.SQL("SELECT id, payload, checksum FROM {}").format(sql.Identifier(spec.table))
    try:
        rows = _pg_query(spec, query.as_string(None))
    except psycopg.errors.UndefinedTable:
        return SCHEMA.empty_table()
    ids, payloads, sums = zip(*rows, strict=True) if rows else ((), (), ())
    return pa.table([pa.array(ids, pa.int64()), pa.array(payloads, pa.string()),
                     pa.array(sums, pa.int64())], schema=SCHEMA)


def _read_kafka(spec: VerifySpec, timeout: float = 120.0) -> pa.Table:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": spec.kafka, "group.id": f"onceflow-verify-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "auto.offset.reset": "earliest"})
    try:
        meta = c.list_topics(spec.table, timeout=10).topics.get(spec.table)
        if meta is None or meta.error is not None or not meta.partitions:
            return SCHEMA.empty_table()
        parts = [TopicPartition(spec.table, p) for p in meta.partitions]
        ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in parts}
        c.assign([TopicPartition(spec.table, p, 0) for p in ends])
        ids, payloads, sums = [], [], []
        deadline, idle = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            msgs = c.consume(5000, 0.5)
            idle = 0 if msgs else idle + 1
            for m in msgs:
                if m.error() is not None:
                    continue
                fields = (m.value() or b"").decode(errors="replace").split(",")
                ids.append(int(fields[0]) if fields[0].lstrip("-").isdigit() else -1)
                payloads.append(fields[1] if len(fields) > 1 else "")
                sums.append(int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else -1)
            # The end the broker reports is a lower bound only: tansu reports the last record
            # batch's base offset + 1 (a 12,000-record producer batch ended at 1), and a reader
            # that stopped there lost that batch's records but its first. The job has finished:
            # read on until the partitions are quiet (two empty polls) and past that end (a
            # transaction's commit marker takes the last offset).
            pos = {tp.partition: tp.offset for tp in c.position(parts)}
            if idle >= 2 and all(ends[p] == 0 or pos[p] >= ends[p] - 1 for p in ends):
                break
    finally:
        c.close()
    return pa.table([pa.array(ids, pa.int64()), pa.array(payloads, pa.string()),
                     pa.array(sums, pa.int64())], schema=SCHEMA)
