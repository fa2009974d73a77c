"""`onceflow run` on bad input: one line that names the problem, exit code 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

JOB = """
import os
from onceflow import Job, CheckpointConfig, DeltaSink
job = Job(
    name="bad-input",
    source=lambda spark: spark.readStream.format("onceflow-sequence").option("total", 1000).load(),
    sink=DeltaSink(os.environ["TABLE"]),
    checkpoint=CheckpointConfig(os.environ["CKPT"]),
    stop_when_idle=1.0,
)
"""


def run(tmp_path, table, ckpt) -> subprocess.CompletedProcess:
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(JOB))
    env = {**os.environ, "TABLE": str(table), "CKPT": str(ckpt)}
    return subprocess.run([sys.executable, "-m", "onceflow", "run", str(job_file)],
                          env=env, capture_output=True, text=True, timeout=180)


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


@pytest.mark.slow
def test_bad_input_gets_one_line_and_nothing_written(tmp_path):
    # An unwritable checkpoint directory (its parent is a file): refused before Spark starts.
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    line = error_line(run(tmp_path, tmp_path / "t1", blocker / "ckpt"))
    assert "checkpoint directory" in line and "not writable" in line
    assert not (tmp_path / "t1").exists()

    # A sink path that holds something other than a Delta table.
    not_delta = tmp_path / "not_delta"
    not_delta.mkdir()
    (not_delta / "data.csv").write_text("a,b\n")
    line = error_line(run(tmp_path, not_delta, tmp_path / "ckpt2"))
    assert "is not a Delta table" in line and str(not_delta) in line
    assert os.listdir(not_delta) == ["data.csv"]

    # A Delta table whose columns do not match the stream.
    other = tmp_path / "other"
    write_deltalake(str(other), pa.table({"name": ["a"]}))
    line = error_line(run(tmp_path, other, tmp_path / "ckpt3"))
    assert "do not match table" in line
    assert DeltaTable(str(other)).version() == 0
    assert not (tmp_path / "ckpt3" / "offsets").exists(), "a batch was planned"
