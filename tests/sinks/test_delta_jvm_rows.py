"""Delta sink, JVM writer: a decision that misses files Spark wrote is refused (issue 28,
point 5). Real Spark local."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import pytest
from deltalake import DeltaTable

from onceflow.errors import SinkError
from onceflow.sinks.delta import DeltaDataSource
from onceflow.sinks.delta.jvm import JvmBatchWriter


def test_jvm_writer_refuses_a_decision_missing_files_the_driver_cannot_see(spark, tmp_path):
    """Executors that write the table's ``file://`` path to disks of their own: the driver's
    listing of the attempt directory lacks their files. Simulated on one host by moving
    partition 1's file out of the attempt directory as soon as its task commits it there
    (partition 0's task is held back so the write is still running). The batch fails with
    SinkError naming the fix and commits nothing; with the files where the driver sees them,
    the batch then commits every row once."""
    path = tmp_path / "table"
    elsewhere = tmp_path / "executor-disk"  # where the "other host's" file went
    elsewhere.mkdir()
    lineage = str(uuid.uuid4())

    def held_back(batches):
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 0:
            time.sleep(2)
        yield from batches

    df = spark.range(0, 1000, numPartitions=2).mapInArrow(held_back, "id long")
    opts = {"path": str(path), "writer": "jvm", "lineage": lineage, "allow_unknown_fingerprint": "true"}
    ds = DeltaDataSource(opts)
    ds.write_schema = df.schema
    ds.validate(df.schema, False)
    ds.open(lineage)

    moved: list[str] = []
    done = threading.Event()

    def other_host() -> None:
        while not done.is_set() and not moved:
            for d in (d for d in os.listdir(path) if d.startswith(f"part-of-{lineage}-")):
                for f in os.listdir(path / d):
                    if f.startswith("part-00001-") and f.endswith(".parquet"):
                        shutil.move(str(path / d / f), elsewhere / f)
                        moved.append(f)
            time.sleep(0.005)

    watcher = threading.Thread(target=other_host, daemon=True)
    watcher.start()
    try:
        with pytest.raises(SinkError, match=r"Spark wrote 1000 rows .* driver finds 500 .*writer='arrow'"):
            JvmBatchWriter(ds, df.schema, False)(df, 0)
    finally:
        done.set()
        watcher.join()
    assert moved, "partition 1's file was never moved away"
    assert ds.decision(lineage, 0) is None, "a decision was committed"
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 0

    plain = spark.range(0, 1000, numPartitions=2)
    JvmBatchWriter(ds, plain.schema, False)(plain, 0)  # the batch again, every file visible
    ids = DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()
    assert sorted(ids) == list(range(1000))
    assert len([d for d in os.listdir(path) if d.startswith("part-of-")]) == 1, "the failed attempt's directory"
