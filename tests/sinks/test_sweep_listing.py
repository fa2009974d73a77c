"""A commit's clean-up listing on an object store follows the recent batches, not the table's age.

Issue 32 (found measuring the Delta sink on moto's S3 server): the commit of every batch listed
every file of its lineage in the table directory to find late losers, and a table directory
keeps every file ever committed, so each commit's listing grew with the table (about 1,000 names
per request: a day of a batch a second, two files each, is 170 requests per commit). Now the
listing is bounded by name prefixes (``sinks/files.py``: ``sweep_prefixes``); what it must still
find: a failed attempt's file at its batch's commit (each commit lists its own batch), the late
file of a recent batch at the next 10th batch's commit (which lists the last 20: the recent
batches at every commit were two listings of a batch's twelve requests), and a zombie's late
file of an older epoch at the next 100th batch. Real moto server, the sink's own task code writes the files.
"""

from __future__ import annotations

import json
import uuid
from urllib.parse import parse_qs

import pyarrow as pa
from pyspark.sql.types import LongType, StructField, StructType

from onceflow.sinks.base import Decision, TaskInfo
from onceflow.sinks.delta import DeltaDataSource
from onceflow.storage import url_to_fs

SCHEMA = StructType([StructField("id", LongType())])


def test_a_commit_lists_the_recent_batches_and_still_sweeps_their_late_files(s3):
    bucket = s3.bucket()
    url, opts = f"s3://{bucket}/table", {"storage_options": json.dumps(s3.options)}
    ds = DeltaDataSource({"path": url, **opts})
    ds.write_schema = SCHEMA
    lineage = str(uuid.uuid4())
    ds.open(lineage)
    mine = ds.epoch
    assert mine >= 1

    def write(source: DeltaDataSource, batch: int, attempt: int = 0) -> dict:
        rows = pa.record_batch({"id": pa.array([batch * 10 + attempt], pa.int64())})
        handle, _ = source.pre_commit(TaskInfo(lineage, batch, 0, attempt), SCHEMA, False, iter([rows]))
        return handle

    def commit(batch: int) -> None:
        decision = Decision(lineage, batch, f"fp-{batch}", [write(ds, batch)], mine)
        ds.decide(decision, SCHEMA, False)
        ds.commit(decision)

    for batch in range(1000, 1013):
        commit(batch)
    # the files of 350 batches of long ago: never losers (no decision of this process names
    # their batches), but the old listing read all of them at every commit
    fs, root = url_to_fs(url, s3.options)
    fs.pipe({f"{root}/part-of-{lineage}-e{mine}-b{b // 3:010d}-p00000-a{b % 3}-{uuid.uuid4().hex[:12]}.parquet": b"x"
             for b in range(1050)})
    late = write(ds, 1012, attempt=1)  # a straggler of batch 1012, finished after its commit
    zombie = write(DeltaDataSource({"path": url, "epoch": str(mine - 1), **opts}), 1005)  # an older epoch's

    def listings(since: int) -> list[str]:
        """The listing requests of the table directory (not of its log) since ``since``."""
        out = []
        for r in s3.requests[since:]:
            prefix = parse_qs(r[5]).get("prefix", [""])[0]
            if r[0] == "GET" and r[1].rstrip("/") == f"/{bucket}" and prefix.startswith("table/") \
                    and not prefix.startswith("table/_delta_log") \
                    and (prefix == "table/" or not prefix.endswith("/")):  # not a removal's look inside a unit
                out.append(prefix)
        return out

    before = len(s3.requests)
    commit(1013)
    # between sweeps: the batch's own units only (the late file of 1012 waits)
    assert listings(before) == [f"table/part-of-{lineage}-e{mine}-b0000001013"]
    assert fs.exists(f"{root}/{late['path']}")
    loser = write(ds, 1014, attempt=0)  # a failed attempt of batch 1014: gone at its commit
    commit(1014)
    assert not fs.exists(f"{root}/{loser['path']}")
    for batch in range(1015, 1020):
        commit(batch)
    before = len(s3.requests)
    commit(1020)
    # one small listing, of the last 20 batches (was 2 pages: every file of the lineage, 1,000
    # per request)
    assert listings(before) == [f"table/part-of-{lineage}-e{mine}-b00000010"]
    assert not fs.exists(f"{root}/{late['path']}")  # the recent straggler's file: swept
    assert fs.exists(f"{root}/{zombie['path']}")  # an older epoch waits for the 100th batch
    commit(1100)
    assert not fs.exists(f"{root}/{zombie['path']}")
    assert len(fs.ls(root)) >= 1050 + 15  # nothing a decision or an old batch owns was touched
