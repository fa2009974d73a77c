"""Each job's scratch space in one place of its own, reclaimed when its owner died.

Spark keeps a driver's scratch files (``blockmgr-*``, ``spark-*``, ``artifacts-*``, RocksDB
working copies, the extracted ``librocksdbjni*.so``) in ``spark.local.dir`` and the JVM's
``java.io.tmpdir``, by default the system temporary directory, and removes them only on a
clean exit. A killed driver leaves them behind: hundreds of MB per kill with large state.

Here every driver process (active or standby) of a job gets
``<root>/<job>-<checkpoint hash>/driver-<pid>-<start time>/`` as both (Spark's through
``SPARK_LOCAL_DIRS``, which Spark reads before ``spark.local.dir`` and without warning; root:
``$ONCEFLOW_SCRATCH_DIR``, else the system temporary directory), and every driver that starts
removes the directories of its job whose process is gone (the pid dead, or reused by a
process that started at another time). Guarantee: a live driver's directory is never removed;
a dead one's is removed by the next driver of the same job on the same host. Only local
masters (``local``, ``local[N]``, ``local-cluster``) get Spark's local directory: elsewhere the
executors' own hosts decide theirs. A ``spark.local.dir`` or ``SPARK_LOCAL_DIRS`` the user set
wins, and so does a ``-Djava.io.tmpdir`` in ``spark.driver.extraJavaOptions``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from onceflow.process import start_time

log = logging.getLogger("onceflow.scratch")

ENV = "ONCEFLOW_SCRATCH_DIR"
#: the SPARK_LOCAL_DIRS onceflow set (a later job of the process, or a child, may replace it)
_SET_ENV = "ONCEFLOW_SPARK_LOCAL_DIRS"


def job_dir(job_name: str, checkpoint_url: str) -> str:
    """The scratch directory of one job (one checkpoint) on this host."""
    root = os.environ.get(ENV) or os.path.join(tempfile.gettempdir(), "onceflow-scratch")
    digest = hashlib.sha1(checkpoint_url.rstrip("/").encode()).hexdigest()[:10]
    return os.path.join(root, f"{job_name}-{digest}")


def _owner_alive(name: str) -> bool:
    """Whether ``driver-<pid>-<start>`` names a live process (the same one, not a pid reuse)."""
    try:
        _, pid, started = name.split("-", 2)
        now = start_time(int(pid))
        return now is not None and str(now) == started
    except ValueError:
        return True  # not ours: leave it


def reclaim(job: str) -> list[str]:
    """Remove the driver directories under ``job`` whose process is gone; their names."""
    try:
        names = os.listdir(job)
    except FileNotFoundError:
        return []
    gone = [n for n in names if n.startswith("driver-") and not _owner_alive(n)]
    for name in gone:
        shutil.rmtree(os.path.join(job, name), ignore_errors=True)
    if gone:
        log.info("reclaimed the scratch space of %d dead driver(s) in %s", len(gone), job)
    return gone


def driver_dir(job_name: str, checkpoint_url: str) -> str:
    """This process's scratch directory (created), after reclaiming dead drivers' ones."""
    job = job_dir(job_name, checkpoint_url)
    reclaim(job)
    path = os.path.join(job, f"driver-{os.getpid()}-{start_time(os.getpid())}")
    os.makedirs(path, exist_ok=True)
    return path


def spark_conf(path: str, master: str | None, conf: dict[str, str],
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """``conf`` with this driver's scratch directory as the JVM's temporary directory, and as
    Spark's local directory (``SPARK_LOCAL_DIRS`` in ``environ``, default this process's
    environment, which the driver JVM inherits); settings the user gave win."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    out = dict(conf)
    ours = environ.get("SPARK_LOCAL_DIRS") == environ.get(_SET_ENV)  # unset, or set by onceflow
    if master and master.startswith("local") and "spark.local.dir" not in out and ours:
        environ["SPARK_LOCAL_DIRS"] = environ[_SET_ENV] = path
    java = out.get("spark.driver.extraJavaOptions", "")
    if "java.io.tmpdir" not in java:
        out["spark.driver.extraJavaOptions"] = f"-Djava.io.tmpdir={path} {java}".strip()
    return out
