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

#: Test files in the order the two workers take them: longest first (worker-seconds measured in
#: a full run), so that no long file starts last while the other worker idles. xdist's default
#: order (most tests first) put the 220 s clock-skew run, one test, at the very end of the run.
LONGEST_FIRST = [
    "sinks/test_conformance.py", "verify/test_verify_cli.py", "sinks/test_delta.py", "sinks/test_postgres.py",
    "sources/test_kinesis_source.py", "verify/test_verify_clock_skew.py", "verify/test_verify_net_clock.py",
    "runtime/test_connect.py", "test_install.py", "sinks/test_kafka_sink.py", "cli/test_demo.py",
    "verify/test_verify_upserts.py", "runtime/test_standalone_cluster.py", "runtime/test_two_pods.py",
    "savepoint/test_savepoint.py", "sinks/test_iceberg.py", "test_examples.py", "sinks/test_delta_partitioned.py",
    "sinks/test_executor_loss.py", "sinks/test_sink_outage.py", "cli/test_savepoint_cli.py",
    "cli/test_operations.py", "runtime/test_runner.py", "runtime/test_metrics.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    """Longest files first (:data:`LONGEST_FIRST`; with ``--no-loadscope-reorder`` xdist keeps
    this order); tests within a file keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = os.path.dirname(os.path.abspath(__file__))

    def key(item) -> int:
        rel = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the rest keep their collection order


@pytest.fixture(scope="session")
def spark():
    """A shared local[2] session with onceflow's data sources registered.

    ``spark.task.maxFailures`` > 1 so injected task failures are retried like on a cluster.
    """
    from onceflow.spark import get_spark

    s = get_spark("local[2,3]", "onceflow-tests")
    yield s
    s.stop()
