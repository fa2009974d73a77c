"""Loading a Job from ``path/to/job.py[:name]``."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

from onceflow.errors import ConfigError
from onceflow.runtime.spec import JobSpec


def load_job(target: str, args: Sequence[str] | None = None) -> JobSpec:
    """Import the file and return its Job (``:name``, else ``job``, else the only Job).

    With ``args`` (``onceflow run job.py -- ARGS``), ``sys.argv`` becomes ``[path, *args]``
    before the file runs and stays so, as under spark-submit: the job reads its own arguments."""
    path, _, name = target.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"job file {path!r} not found; give path/to/job.py[:variable]")
    module_name = f"onceflow_job_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path!r} is not a Python file")
    if args is not None:
        sys.argv = [path, *args]
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # Spark's workers cannot import a file loaded by path: ship its functions by value.
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    if name:
        job = getattr(module, name, None)
        if not isinstance(job, JobSpec):
            raise ConfigError(f"{path} has no Job named {name!r}")
        return job
    jobs = {k: v for k, v in vars(module).items() if isinstance(v, JobSpec)}
    if "job" in jobs:
        return jobs["job"]
    if len(jobs) == 1:
        return next(iter(jobs.values()))
    if not jobs:
        raise ConfigError(f"{path} defines no onceflow.Job; define one, e.g. job = Job(...)")
    raise ConfigError(f"{path} defines several Jobs ({', '.join(sorted(jobs))}); pick one with {path}:NAME")
