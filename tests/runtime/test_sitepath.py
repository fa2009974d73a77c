"""Spark's Python processes import pyspark from the installed package, not from pyspark.zip."""

from __future__ import annotations

import os
import subprocess
import sys

import pyspark

SITEPATH = os.path.join(os.path.dirname(__import__("onceflow").__file__), "runtime", "sitepath")
ZIP = os.path.join(os.path.dirname(pyspark.__file__), "python", "lib", "pyspark.zip")


def test_spark_python_workers_import_pyspark_from_its_package_not_the_zip(spark):
    def _origin(batches):  # nested: pickled by value, the workers cannot import this test module
        import pyarrow as pa
        import pyspark

        for _ in batches:
            yield pa.RecordBatch.from_pydict({"file": [pyspark.__file__]})

    files = {r.file for r in spark.range(2, numPartitions=2).mapInArrow(_origin, "file string").collect()}
    assert files and not any(".zip" in f for f in files), files


def _start(pythonpath: list[str], cwd: str) -> str:
    code = "import pyspark, sys; print(pyspark.__file__); print(getattr(sys, 'other_sitecustomize', None))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, check=True).stdout


def test_only_the_installed_pysparks_own_zip_is_dropped_and_another_sitecustomize_still_runs(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys\nsys.other_sitecustomize = 'ran'\n")
    out = _start([SITEPATH, ZIP, str(other)], str(tmp_path)).split("\n")
    assert ".zip" not in out[0] and out[1] == "ran", out

    copy = tmp_path / "elsewhere" / "pyspark.zip"  # a zip some other Spark ships: kept
    copy.parent.mkdir()
    copy.write_bytes(open(ZIP, "rb").read())
    out = _start([SITEPATH, str(copy)], str(tmp_path)).split("\n")
    assert out[0].startswith(str(copy)), out
