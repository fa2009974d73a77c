"""``onceflow run --dry-run``: the plan, the sink opened read-only and its guarantee; exit 0 and
nothing written, or one error line (exit 2) and still nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

JOB = textwrap.dedent(
    """
    import os, sys
    from onceflow import CheckpointConfig, DeltaSink, Job

    rows = int(sys.argv[sys.argv.index("--rows") + 1])  # the job's own argument
    job = Job(name="dry",
              source=lambda spark: spark.readStream.format("onceflow-sequence").option("total", rows).load()
              .selectExpr("id", "key", "id * 2 AS doubled"),
              sink=DeltaSink(os.environ["TABLE"]),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt"))
    """
)


def dry_run(tmp_path, table, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "job.py").write_text(JOB)
    env = {**os.environ, "WORK": str(tmp_path), "TABLE": str(table), "ONCEFLOW_SPARK_LOG_LEVEL": "ERROR"}
    return subprocess.run([sys.executable, "-m", "onceflow", "run", "--dry-run", "--no-standby", *options,
                           str(tmp_path / "job.py"), "--", "--rows", "100"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_prints_plan_and_guarantee_and_writes_nothing(tmp_path):
    r = dry_run(tmp_path, tmp_path / "table")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "job         dry" in out and f"checkpoint  {tmp_path}/ckpt: absent" in out
    assert "Physical Plan" in out and "doubled" in out, out
    assert f"sink        onceflow-delta: Delta table {tmp_path}/table: absent" in out
    assert "guarantee   onceflow-delta: exactly-once" in out and "dry run: OK" in out
    assert sorted(os.listdir(tmp_path)) == ["job.py"]  # no checkpoint, no table


def test_dry_run_refuses_a_table_whose_columns_do_not_match(tmp_path):
    other = tmp_path / "other"
    write_deltalake(str(other), pa.table({"name": ["a"]}))
    r = dry_run(tmp_path, other)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert "do not match table" in line, line
    assert DeltaTable(str(other)).version() == 0 and not (tmp_path / "ckpt").exists()


def test_dry_run_refuses_a_restore_before_spark_starts(tmp_path):
    r = dry_run(tmp_path, tmp_path / "table", "--from-savepoint", str(tmp_path / "no-sp"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert "not a savepoint" in line and sorted(os.listdir(tmp_path)) == ["job.py"]
