"""Creating a SparkSession that works for onceflow (Python workers, local IP, registrations)."""

from __future__ import annotations

import os
import shutil
import sys

from onceflow.errors import ConfigError


def ensure_java() -> None:
    """Fail with instructions (not a JVM launcher trace) when Java 17+ is missing."""
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not os.path.exists(java):
        raise ConfigError(
            "Java 17 or newer is required by Spark and was not found on PATH or JAVA_HOME. "
            "Install it (Debian/Ubuntu: 'apt-get install -y openjdk-17-jre-headless') and retry."
        )


def prepare_environment() -> None:
    """Environment every onceflow process needs before the JVM starts."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")


def get_spark(master: str = "local[2]", app_name: str = "onceflow", conf: dict | None = None):
    """Return a SparkSession with onceflow's data sources registered."""
    ensure_java()
    prepare_environment()
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.stopTimeout", "120s")
        .config("spark.python.worker.reuse", "true")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("ONCEFLOW_SPARK_LOG_LEVEL", "ERROR"))
    register_all(spark)
    return spark


def register_all(spark) -> None:
    """Register every onceflow data source (sources and sinks) with ``spark``."""
    from onceflow.sinks import registry as sink_registry
    from onceflow.sources import registry as source_registry

    for cls in sink_registry.data_sources() + source_registry.data_sources():
        spark.dataSource.register(cls)
