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


UPDATE_JOB = """
import os
from onceflow import Job, CheckpointConfig, DeltaSink
job = Job(
    name="update-mode",
    source=lambda spark: spark.readStream.format("onceflow-sequence").option("total", 1000).load(),
    transform=lambda df: df.groupBy("key").count(),
    output_mode="update",
    sink=DeltaSink(os.environ["TABLE"], writer=os.environ["WRITER"]),
    checkpoint=CheckpointConfig(os.environ["CKPT"]),
    stop_when_idle=1.0,
)
"""


def test_update_mode_into_a_python_data_source_is_one_line_not_a_restart_loop(tmp_path):
    """Spark's Python data sources refuse output mode 'update' when the query starts. Before,
    the job's restart strategy restarted that query again and again (the same refusal each
    time) and gave up with Spark's 'requirement failed'. Now the job is refused before its
    query starts, naming what takes 'update'; the JVM writer does take it."""
    job_file = tmp_path / "job.py"
    job_file.write_text(textwrap.dedent(UPDATE_JOB))

    def run_with(writer: str, name: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TABLE": str(tmp_path / name), "CKPT": str(tmp_path / f"ckpt-{name}"),
               "WRITER": writer}
        return subprocess.run([sys.executable, "-m", "onceflow", "run", "--no-standby", str(job_file)],
                              env=env, capture_output=True, text=True, timeout=300)

    line = error_line(run_with("arrow", "t-arrow"))
    assert "DeltaSink writes through the Python data source onceflow-delta" in line, line
    assert "not 'update'" in line and "DeltaSink(writer='jvm') takes 'update'" in line, line
    assert not (tmp_path / "t-arrow").exists()

    ok = run_with("jvm", "t-jvm")
    assert ok.returncode == 0, ok.stderr[-3000:]
    counts = DeltaTable(str(tmp_path / "t-jvm")).to_pyarrow_table().to_pandas()
    assert counts.groupby("key")["count"].max().sum() == 1000  # every key's last count
