"""Spark's Python workers are forked from onceflow's daemon, with their modules already imported."""

from __future__ import annotations

import os
import subprocess
import sys

from onceflow.runtime import daemon


def test_python_workers_start_with_onceflows_modules_imported_and_frozen(spark):
    def _worker(batches):  # nested: pickled by value, the workers cannot import this test module
        import gc
        import sys

        import pyarrow as pa

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode()
        # modules this task never imports itself: there only if the daemon imported them
        loaded = ",".join(m for m in ("pandas", "onceflow.sinks.base", "onceflow.sources.kinesis") if m in sys.modules)
        for _ in batches:
            yield pa.RecordBatch.from_pydict({"parent": [parent], "loaded": [loaded],
                                              "frozen": [gc.get_freeze_count()]})

    rows = spark.range(2, numPartitions=2).mapInArrow(_worker, "parent string, loaded string, frozen long").collect()
    assert rows and all("-m onceflow.runtime.daemon pyspark.worker" in r.parent for r in rows), rows
    assert {r.loaded for r in rows} == {"pandas,onceflow.sinks.base,onceflow.sources.kinesis"}, rows
    assert all(r.frozen > 10_000 for r in rows), rows  # the daemon's objects, untouched by the workers' GC


def test_the_daemon_imports_every_module_it_can_without_starting_blas_threads(tmp_path):
    """numpy imported under OMP_NUM_THREADS=1 starts no BLAS thread; the environment is given
    back as it was; a module that does not import is skipped, not fatal."""
    code = ("import os, sys; from onceflow.runtime import daemon; daemon.BASE += ('onceflow.no_such_module',); "
            "done = daemon.preload(); print(len(os.listdir('/proc/self/task')), 'OMP_NUM_THREADS' in os.environ, "
            "'onceflow.no_such_module' in done, 'numpy' in sys.modules, len(done))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    threads, omp, missing, numpy, done = out
    # the main thread and jemalloc's background thread (pyarrow's allocator), no BLAS threads
    assert int(threads) <= 2 and omp == "False" and missing == "False" and numpy == "True", out
    assert int(done) == len(daemon.modules()), out
