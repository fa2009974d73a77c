"""``onceflow run --conf``: a malformed setting is refused before anything runs (the options'
effect on a running driver is checked in tests/runtime/test_metrics.py)."""

from __future__ import annotations

import os
import subprocess
import sys

JOB = """
from onceflow import CheckpointConfig, DeltaSink, Job

job = Job(name="opts", source=lambda spark: None, sink=DeltaSink("{work}/table"),
          checkpoint=CheckpointConfig("{work}/ckpt"))
"""


def test_a_malformed_conf_is_one_line_and_nothing_runs(tmp_path):
    (tmp_path / "job.py").write_text(JOB.format(work=tmp_path))
    r = subprocess.run([sys.executable, "-m", "onceflow", "run", "--no-standby", "--conf", "spark.ui.port",
                        str(tmp_path / "job.py")], env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "give a Spark setting as KEY=VALUE" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "ckpt").exists()
