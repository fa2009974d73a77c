"""Exporting operator state to Parquet (the read side of Flink's State Processor API).

Reads through Spark's ``statestore`` data source, so whatever state store provider wrote
the state (HDFS-backed or RocksDB), the rows come out as key / value columns. Works on a
checkpoint directory and on a savepoint (its ``checkpoint/`` directory is a complete Spark
checkpoint for the saved batch).
"""

from __future__ import annotations

import pyarrow.parquet as pq

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.savepoint.manifest import DATA_DIR, SavepointError, is_savepoint, read_manifest
from onceflow.storage import url_to_fs


def state_location(url: str) -> tuple[str, int | None]:
    """(checkpoint URL, batch) for a checkpoint or savepoint URL."""
    url = url.rstrip("/")
    if is_savepoint(url):
        return f"{url}/{DATA_DIR}", read_manifest(url).batch
    ckpt = CheckpointDir(url)
    if not ckpt.exists():
        raise SavepointError(f"{url} is neither a savepoint nor a started checkpoint directory")
    return url, ckpt.last_committed()


def export_state(spark, url: str, operator: int, out: str, store: str | None = None,
                 batch: int | None = None) -> int:
    """Write operator ``operator``'s state at ``batch`` (default: the last committed or saved
    batch) to the Parquet file ``out``; returns the row count."""
    location, default_batch = state_location(url)
    batch = default_batch if batch is None else batch
    if batch is None:
        raise SavepointError(f"{url} has no committed batch: no state to export")
    reader = spark.read.format("statestore").option("operatorId", operator).option("batchId", batch)
    if store:
        reader = reader.option("storeName", store)
    try:
        table = reader.load(location).toArrow()
    except Exception as e:  # noqa: BLE001 - Spark's message names what is wrong
        first = next((ln for ln in str(e).splitlines() if ln.strip()), str(e))
        raise SavepointError(f"cannot read state of operator {operator} at batch {batch} in {url}: {first[:400]}") from None
    fs, path = url_to_fs(out)
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)
    return table.num_rows
