"""Delta sink: late files of decided batches are swept, also under the current epoch (issue 28,
point 16). Real Spark local; the late files are written by the sink's own task code
(``DeltaDataSource.pre_commit``), as a straggler that passed its ``is_decided`` check before
its batch committed writes them."""

from __future__ import annotations

import json
import os
import uuid

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql.types import LongType, StructField, StructType

from onceflow.sinks.base import TaskInfo
from onceflow.sinks.delta import DeltaDataSource

SCHEMA = StructType([StructField("id", LongType())])


def test_late_files_of_decided_batches_are_swept_never_in_flight_or_decided_ones(spark, tmp_path):
    """A straggler of batch 0 finishes its file under the running driver's epoch after batch 0
    committed: batch 1's commit deletes it, while a file of the undecided batch 2 (in flight)
    survives. A straggler of batch 0 that finishes after the driver stopped is deleted by the
    next driver's recovery. Every file a decision lists stays; the table holds each row once."""
    src, table, ckpt = tmp_path / "in", tmp_path / "table", tmp_path / "ckpt"
    src.mkdir()
    lineage = str(uuid.uuid4())

    def feed(i: int, ids: list[int]) -> None:
        tmp = tmp_path / f".{i}.json"
        tmp.write_text("".join(json.dumps({"id": x}) + "\n" for x in ids))
        os.replace(tmp, src / f"{i}.json")

    def late_file(epoch: int, batch: int, attempt: int) -> str:
        straggler = DeltaDataSource({"path": str(table), "epoch": str(epoch)})
        rows = pa.record_batch({"id": pa.array([100 + attempt], pa.int64())})
        handle, _ = straggler.pre_commit(TaskInfo(lineage, batch, 0, attempt), SCHEMA, False, iter([rows]))
        assert (table / handle["path"]).exists()
        return handle["path"]

    q = (spark.readStream.schema(SCHEMA).json(str(src)).writeStream.format("onceflow-delta")
         .option("path", str(table)).option("lineage", lineage)
         .option("checkpointLocation", str(ckpt)).start())
    try:
        feed(0, [0, 1])
        q.processAllAvailable()
        decided = DeltaDataSource({"path": str(table)}).decision(lineage, 0)
        assert decided is not None and decided.epoch is not None
        epoch = decided.epoch
        late = late_file(epoch, 0, attempt=1)  # a straggler of the committed batch 0
        in_flight = late_file(epoch, 2, attempt=0)  # batch 2 is not decided yet
        feed(1, [2, 3])
        q.processAllAvailable()
    finally:
        q.stop()
    assert DeltaDataSource({"path": str(table)}).decision(lineage, 1) is not None
    assert not (table / late).exists(), "a late file of decided batch 0 (current epoch) was left behind"
    assert (table / in_flight).exists(), "a file of the undecided batch 2 was deleted while in flight"

    after_stop = late_file(epoch, 0, attempt=2)  # finished after its driver stopped
    successor = DeltaDataSource({"path": str(table)})
    assert successor.open(lineage) > epoch  # what the next driver does first: epoch, recovery
    assert not (table / after_stop).exists(), "recovery left a late file of decided batch 0"
    assert not (table / in_flight).exists(), "recovery left an older epoch's undecided file"

    dt = DeltaTable(str(table))
    assert sorted(dt.to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2, 3]
    names = {h["path"] for b in (0, 1) for h in (successor.decision(lineage, b).handles or [])}  # type: ignore[union-attr]
    assert len(names) >= 2 and all((table / n).exists() for n in names), "a decided file was deleted"
    left = {n for n in os.listdir(table) if n.startswith("part-of-")}
    assert left == names, f"files no decision lists: {sorted(left - names)}"
