"""Faster start for the Python processes Spark launches for an onceflow driver.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's path. Python
keeps no bytecode cache for a zip, so each worker, planner and daemon compiles pyspark again:
about 0.7 s per process on a 2-core machine, and a cold driver's first batch starts about ten
of them one after another. :func:`onceflow.spark.prepare_environment` puts this directory on
the ``PYTHONPATH`` the driver's JVM passes to them; at start-up this module drops the zip when
it is the one shipped inside the pip-installed ``pyspark`` that is on the path anyway (the
same code, with cached bytecode). Any other ``sitecustomize`` on the path still runs.
"""

import os
import sys


def _drop_pyspark_zip() -> None:
    zips = {os.path.realpath(p): p for p in sys.path if p.endswith("pyspark.zip")}
    for entry in list(sys.path):
        own = os.path.realpath(os.path.join(entry or ".", "pyspark", "python", "lib", "pyspark.zip"))
        if own in zips and os.path.isfile(os.path.join(entry, "pyspark", "__init__.py")):
            sys.path.remove(zips.pop(own))


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    _drop_pyspark_zip()
except Exception:  # never stop a worker from starting: the zip then stays
    pass
_chain()
