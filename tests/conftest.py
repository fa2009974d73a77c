"""Shared fixtures: one local SparkSession per test session, temp dirs."""

from __future__ import annotations

import os
import sys

import pytest

from s3_server import s3, s3_server  # noqa: F401 - fixtures: moto's S3 server (object-store tests)

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Every JVM of the suite (the test session's, and each driver process the tests start) is
# short-lived and the machine has 2 cores: the C1 compiler alone and the serial GC cut the
# CPU a Spark start-up takes by about 30% (measured with a 10-batch query). Tests only.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# Spark's UI is on by default for users; the suite's many short-lived JVMs do without it
# (tests/runtime/test_metrics.py checks the default).
os.environ.setdefault("ONCEFLOW_SPARK_CONF", '{"spark.ui.enabled": "false"}')


@pytest.fixture(scope="session")
def spark():
    """A shared local[2] session with onceflow's data sources registered.

    ``spark.task.maxFailures`` > 1 so injected task failures are retried like on a cluster.
    """
    from onceflow.spark import get_spark

    s = get_spark("local[2,3]", "onceflow-tests")
    yield s
    s.stop()
