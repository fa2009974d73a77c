"""Each job's scratch space in one place of its own, reclaimed when its owner died.

Spark keeps a driver's scratch files (``blockmgr-*``, ``spark-*``, ``artifacts-*``, RocksDB
working copies, the extracted ``librocksdbjni*.so``) in ``spark.local.dir`` and the JVM's
``java.io.tmpdir``, by default the system temporary directory, and removes them only on a
clean exit. A killed driver leaves them behind: hundreds of MB per kill with large state.

Here every driver process (active or standby) of a job gets
``<root>/<job>-<checkpoint hash>/driver-<pid>-<start time>-<random>/`` as both (Spark's through
``SPARK_LOCAL_DIRS``, which Spark reads before ``spark.local.dir`` and without warning; root:
``$ONCEFLOW_SCRATCH_DIR``, else the system temporary directory), and every driver that starts
removes the directories of its job whose owner is gone. The owner holds an exclusive
``flock`` on ``driver-...lock`` beside its directory for its whole life, taken
before the directory exists; the kernel drops it when the process dies, whatever PID
namespace either process is in. A directory whose lock can be taken is a dead driver's.
Guarantee: a live driver's directory is never removed, also not by a driver in another
container that shares the directory (pids are not compared: the same pid means another
process in another namespace); a dead one's is removed by the next driver of the same job
that shares it. A directory without a lock file is not onceflow's: it is left alone. Only
local masters (``local``, ``local[N]``, ``local-cluster``) get Spark's local directory:
elsewhere the executors' own hosts decide theirs. A ``spark.local.dir`` or
``SPARK_LOCAL_DIRS`` the user set wins, and so does a ``-Djava.io.tmpdir`` in
``spark.driver.extraJavaOptions``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import IO

from onceflow.process import start_time
from onceflow.settings import setting

log = logging.getLogger("onceflow.scratch")

ENV = "ONCEFLOW_SCRATCH_DIR"
#: the SPARK_LOCAL_DIRS onceflow set (a later job of the process, or a child, may replace it)
_SET_ENV = "ONCEFLOW_SPARK_LOCAL_DIRS"


def job_dir(job_name: str, checkpoint_url: str) -> str:
    """The scratch directory of one job (one checkpoint) on this host."""
    root = setting(ENV) or os.path.join(tempfile.gettempdir(), "onceflow-scratch")
    digest = hashlib.sha1(checkpoint_url.rstrip("/").encode()).hexdigest()[:10]
    return os.path.join(root, f"{job_name}-{digest}")


#: tells apart two processes with one pid and start time (first pids of two containers)
_TAG = uuid.uuid4().hex[:8]
#: the lock files this process holds, by path (open for its whole life)
_HELD: dict[str, IO[bytes]] = {}


def _lock(path: str) -> IO[bytes] | None:
    """The open lock file ``path``, exclusively flock-ed; None when another process holds it.
    OSError when the filesystem cannot lock (NFS without locks, some FUSE mounts)."""
    f = open(path, "ab")  # noqa: SIM115 - held open on purpose (the lock lives with the fd)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    except OSError:
        f.close()
        raise
    return f


def _hold(path: str, wait_s: float = 5.0) -> IO[bytes] | None:
    """Take this process's lock ``path`` for its life: retried while a reclaimer holds the
    just-created file for a moment, and only once the path still names the locked file (a
    reclaimer may have removed it). None (logged) where the filesystem cannot lock."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            f = _lock(path)
        except OSError as e:
            log.warning("scratch space %s cannot be locked (%s): it is used without an owner lock "
                        "and left for you to remove", path[: -len(".lock")], e)
            return None
        if f is not None:
            try:
                if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                    return f
            except FileNotFoundError:
                pass
            f.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"scratch lock {path} stays held by another process")
        time.sleep(0.05)


def reclaim(job: str) -> list[str]:
    """Remove the driver directories under ``job`` whose owner is gone (its lock is free);
    their names."""
    try:
        names = os.listdir(job)
    except FileNotFoundError:
        return []
    gone = []
    for name in sorted(n for n in names if n.startswith("driver-") and n.endswith(".lock")):
        lock = os.path.join(job, name)
        if lock in _HELD:
            continue
        try:
            f = _lock(lock)
        except OSError:  # removed meanwhile, or a filesystem without locks: leave it
            continue
        if f is None:
            continue  # its owner lives
        try:
            shutil.rmtree(lock[: -len(".lock")], ignore_errors=True)
            os.unlink(lock)
            gone.append(name[: -len(".lock")])
        except FileNotFoundError:
            pass
        finally:
            f.close()
    if gone:
        log.info("reclaimed the scratch space of %d dead driver(s) in %s", len(gone), job)
    return gone


def driver_dir(job_name: str, checkpoint_url: str) -> str:
    """This process's scratch directory (created, and locked for this process's life), after
    reclaiming dead drivers' ones."""
    job = job_dir(job_name, checkpoint_url)
    os.makedirs(job, exist_ok=True)
    reclaim(job)
    path = os.path.join(job, f"driver-{os.getpid()}-{start_time(os.getpid())}-{_TAG}")
    if path + ".lock" not in _HELD:
        f = _hold(path + ".lock")
        if f is not None:
            _HELD[path + ".lock"] = f
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
