"""``onceflow doctor --delta PATH``: a table's partitioning, protocol and onceflow lineages."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
from deltalake import CommitProperties, write_deltalake


def doctor(*paths: str) -> tuple[int, str]:
    args = [a for p in paths for a in ("--delta", p)]
    proc = subprocess.run([sys.executable, "-m", "onceflow", "doctor", *args], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_reports_partitioning_protocol_features_and_lineages(tmp_path):
    plain, featured = str(tmp_path / "plain"), str(tmp_path / "featured")
    rows = pa.table({"id": pa.array([1, 2], pa.int64()), "p": ["a", "b"]})
    write_deltalake(plain, rows, partition_by=["p"], commit_properties=CommitProperties(
        custom_metadata={"onceflow": json.dumps({"lineage": "L1", "batch": 7, "epoch": 3})}))
    write_deltalake(featured, rows, configuration={"delta.enableChangeDataFeed": "true"})
    rc, out = doctor(plain, featured)
    assert rc == 0, out
    assert "partitioned by ['p']" in out and "not partitioned" in out
    assert "L1: batch 7 (epoch 3)" in out
    assert "constant-cost log appends" in out  # the plain table
    assert "commit through delta-rs (writer version or table features)" in out  # change data feed: writer v4


def test_a_directory_that_is_not_a_delta_table_fails(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "data.csv").write_text("a\n")
    rc, out = doctor(str(tmp_path / "x"))
    assert rc == 1 and "is not a Delta table" in out
