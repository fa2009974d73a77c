"""Building the driver JVM's class-data-sharing archive (see :mod:`onceflow.jvm_cache`):
``python -m onceflow.runtime.jvm_archive PATH``, started in the background by the first driver
that finds no archive."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from onceflow.jvm_cache import QUIET, prune
from onceflow.runtime.standby import warm_query
from onceflow.spark import get_spark


def build(path: str) -> None:
    """Write the archive for ``path``: start Spark, run the warm-up query, let the JVM dump."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    tmp = tempfile.mkdtemp(prefix="onceflow-jvm-cache-")
    try:
        spark = get_spark("local[2]", "onceflow-jvm-cache",
                          {"spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={partial} {QUIET}"})
        warm_query(spark, tmp).awaitTermination(300)
        spark.stop()
        from pyspark import SparkContext

        proc = SparkContext._gateway.proc  # closing its stdin ends the JVM, which writes the archive
        proc.stdin.close()
        proc.wait(timeout=300)
        if os.path.exists(partial) and os.path.getsize(partial) > 0:
            os.replace(partial, path)
            prune(path)  # other installations' archives beyond the last few, dead builds' parts
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for leftover in (partial, f"{path}.building"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    os.nice(10)  # in the background, behind the drivers
    logging.basicConfig(level=logging.WARNING)
    build(sys.argv[1])
