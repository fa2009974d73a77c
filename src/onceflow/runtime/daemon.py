"""Spark's Python worker daemon with the modules of an onceflow task imported before it forks.

Spark starts one daemon per executor (``python -m <spark.python.daemon.module> pyspark.worker``)
and forks it for every Python worker. Spark's own daemon imports only ``pyspark`` first, so each
worker imports pyarrow, pandas and the sink's module itself: about 0.5-0.8 CPU-s per worker on
a 2-core machine, several workers per driver. This daemon imports them once; each forked worker
shares them (copy-on-write) and starts in milliseconds. The first worker still waits for the
imports (now in the daemon), so a cold driver's first commit comes no sooner; the saving is the
CPU of every later worker (``benchmarks/bench_worker_daemon.py``: 0.83-0.91x of the CPU of a
short job, 0.89-0.96x of its wall time).

Which modules: Spark's worker and its Arrow serializers, pyarrow (with Parquet) and pandas, and
the modules of onceflow's registered sources and sinks (their heavy dependencies are imported
where a task uses them, so each costs milliseconds here). A module that fails to import (an
extra not installed) is skipped: a worker that needs it imports it and reports the error as
under Spark's own daemon. The imported objects are then frozen (:func:`gc.freeze`), so the
workers' collections between tasks do not copy the daemon's pages.

Fork safety: pyspark's daemon imports nothing before the fork because pandas and pyarrow "start
some threads when they are imported". numpy's BLAS threads are kept from starting by
``OMP_NUM_THREADS=1`` during the imports (Spark sets it for the workers themselves from
``spark.task.cpus``). The one thread left is jemalloc's background thread (pyarrow's
allocator), which jemalloc itself stops and restarts around ``fork``; a module that would
start another is left to the workers (:data:`AFTER_FORK`). Arrow's CPU and I/O
thread pools start lazily, at the first compute or file call, in the workers, never here.

onceflow's default for local masters (``spark.python.daemon.module``, see
:data:`onceflow.spark.LOCAL_DEFAULTS`); Spark's planner processes (data source lookups and
writes' commits) keep Spark's daemon.
"""

from __future__ import annotations

import gc
import importlib
import os

#: what every onceflow task imports: Spark's worker, its Arrow serializers and conversions,
#: pyarrow (and Parquet, which every file sink writes), pandas (Spark's Arrow paths import it)
BASE = ("pyspark.worker", "pyspark.sql.pandas.serializers", "pyspark.sql.conversion",
        "pyarrow", "pyarrow.parquet", "pandas", "onceflow.sinks.base")


#: modules whose import starts a thread of a library with no documented fork safety: the
#: Delta sink's (deltalake starts its own allocator's background thread); its workers import
#: it after the fork, as under Spark's daemon (about 50 ms)
AFTER_FORK = ("onceflow.sinks.delta",)


def modules() -> list[str]:
    """:data:`BASE` and the modules of onceflow's registered sources and sinks, except
    :data:`AFTER_FORK`."""
    from onceflow.sinks.registry import SINKS
    from onceflow.sources.registry import SOURCES

    registered = (ref.split(":")[0] for ref in (*SOURCES.values(), *SINKS.values()))
    return [*BASE, *(m for m in registered if m not in AFTER_FORK)]


def preload() -> list[str]:
    """Import :func:`modules` (each that imports) and freeze what was loaded; their names."""
    blas = "OMP_NUM_THREADS" not in os.environ
    if blas:
        os.environ["OMP_NUM_THREADS"] = "1"
    done = []
    try:
        for name in modules():
            try:
                importlib.import_module(name)
                done.append(name)
            except Exception:  # noqa: BLE001 - a worker that needs it reports the error itself
                pass
    finally:
        if blas:
            del os.environ["OMP_NUM_THREADS"]
    gc.collect()
    gc.freeze()
    return done


if __name__ == "__main__":
    preload()
    from pyspark import daemon

    daemon.manager()
