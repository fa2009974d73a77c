"""Java pre-flight: a missing or too old Java is one clear line, not a JVM launcher trace."""

from __future__ import annotations

import pytest

from onceflow.errors import ConfigError
from onceflow.spark import ensure_java


def fake_java_home(tmp_path, version_line: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(0o755)
    return tmp_path


def test_missing_java_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="Java 17 or newer is required.*openjdk-17"):
        ensure_java()


@pytest.mark.parametrize("line", ['openjdk version "11.0.22" 2024-01-16', 'java version "1.8.0_392"'])
def test_old_java_is_refused(tmp_path, monkeypatch, line):
    monkeypatch.setenv("JAVA_HOME", str(fake_java_home(tmp_path, line)))
    with pytest.raises(ConfigError, match="needs Java 17 or newer"):
        ensure_java()


def test_java_17_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(fake_java_home(tmp_path, 'openjdk version "17.0.15" 2025-04-15')))
    ensure_java()


# ---- Spark version: one line at start on an unsupported Spark (issue 31) -------------------

@pytest.mark.parametrize("version", ["4.3.0", "4.3.2", "4.3.1.dev0"])
def test_supported_spark_versions_pass(version):
    from onceflow.spark import check_spark_version

    check_spark_version(version)


@pytest.mark.parametrize("version", ["3.5.1", "4.2.0", "4.4.0", "5.0.0", ""])
def test_unsupported_spark_versions_are_one_line_naming_the_fix(version):
    from onceflow.spark import check_spark_version

    with pytest.raises(ConfigError) as e:
        check_spark_version(version, "the Spark Connect server sc://h:15002")
    assert "\n" not in str(e.value)
    assert f"is Spark {version}; onceflow supports Spark 4.3.x only" in str(e.value)
    assert "pip install 'pyspark>=4.3,<4.4'" in str(e.value)


OLD_SPARK_JOB = """
import os
import pyspark
pyspark.__version__ = "3.5.1"  # what an older pyspark installation reports
from onceflow import CheckpointConfig, DeltaSink, Job
job = Job(name="old-spark",
          source=lambda spark: spark.readStream.format("onceflow-sequence").option("total", 10).load(),
          sink=DeltaSink(os.environ["TABLE"]), checkpoint=CheckpointConfig(os.environ["CKPT"]),
          stop_when_idle=1.0)  # bounded: without the check it runs and ends (rc 0)
"""


def test_onceflow_run_on_an_unsupported_spark_exits_2_with_one_line(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "job.py").write_text(OLD_SPARK_JOB)
    env = {**os.environ, "TABLE": str(tmp_path / "t"), "CKPT": str(tmp_path / "ckpt")}
    r = subprocess.run([sys.executable, "-m", "onceflow", "run", "--no-standby", str(tmp_path / "job.py")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == ["error: pyspark is Spark 3.5.1; onceflow supports Spark 4.3.x only (pip install "
                      "'pyspark>=4.3,<4.4'; README: Compatibility)"], r.stderr[-3000:]
    assert not (tmp_path / "t").exists()
