"""``onceflow run --conf``: a malformed setting is refused before anything runs (the options'
effect on a running driver is checked in tests/runtime/test_metrics.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

JOB = textwrap.dedent(
    """
    import json, os
    from onceflow import CheckpointConfig, DeltaSink, Job, fixed_delay

    def source(spark):
        sc = spark.sparkContext
        with open(os.environ["WORK"] + "/session.json", "w") as f:
            json.dump({"master": sc.master, "ui": sc.uiWebUrl,
                       "shuffle": spark.conf.get("spark.sql.shuffle.partitions"),
                       "tz": spark.conf.get("spark.sql.session.timeZone")}, f)
        return spark.readStream.format("onceflow-sequence").option("total", 100).load()

    job = Job(name="opts", source=source, sink=DeltaSink(os.environ["WORK"] + "/table"),
              checkpoint=CheckpointConfig(os.environ["WORK"] + "/ckpt", interval=0),
              restart_strategy=fixed_delay(attempts=1, delay=0), stop_when_idle=1.0,
              master="local[2]", spark_conf={"spark.sql.shuffle.partitions": "5"})
    """
)


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ONCEFLOW_SPARK_CONF"}  # the user's default: UI on
    env["WORK"] = str(tmp_path)
    return subprocess.run([sys.executable, "-m", "onceflow", "run", "--no-standby", *args, str(tmp_path / "job.py")],
                          env=env, capture_output=True, text=True, timeout=240)


def test_a_malformed_conf_is_one_line_and_nothing_runs(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    r = _run(tmp_path, "--conf", "spark.ui.port")
    assert r.returncode == 2 and "give a Spark setting as KEY=VALUE" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "ckpt").exists()
