"""A class-data-sharing archive of the driver JVM's classes: a cold driver starts faster.

A cold driver spends most of its start-up loading and verifying Spark's classes. The JVM can
map them from a CDS archive instead (``-XX:SharedArchiveFile``, Java 13+): on the project's
2-core machine the SparkSession was ready in 5.2 s instead of 8.1 s, and the first batch of
the demo pipeline committed 4 s sooner (docs/recovery.md).

How the archive comes to be: the first driver that finds none starts a background helper
(``python -m onceflow.runtime.jvm_archive PATH``), at low CPU priority. The helper starts a
SparkSession with ``-XX:ArchiveClassesAtExit``, runs the standby's tiny warm-up query, exits
(its JVM writes the archive) and renames the archive into place. Drivers started after that
use it. The archive lives in ``$ONCEFLOW_JVM_CACHE_DIR`` (default ``~/.cache/onceflow/jvm``),
keyed by the Java binary, PySpark's version and its jars (names, sizes, mtimes: a reinstall
gets a new archive). A JVM that finds an archive made by
another JDK or for other jars ignores it and starts normally. ``ONCEFLOW_JVM_CACHE=0`` turns
all of this off. Only the driver's JVM uses it, and only when onceflow starts that JVM.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time

from onceflow.settings import setting

log = logging.getLogger("onceflow.jvm_cache")

_BUILD_TIMEOUT_S = 600  # a helper older than this is presumed dead and may be replaced
QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def enabled() -> bool:
    return setting("ONCEFLOW_JVM_CACHE", "1").lower() not in ("0", "false", "off", "no")


def archive_path() -> str:
    """Where this installation's archive lives (it may not exist yet)."""
    import pyspark

    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else (shutil.which("java") or "java")
    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    names = sorted(os.listdir(jars)) if os.path.isdir(jars) else []
    # The JVM checks each jar's size and mtime against the archive: a reinstall at the same
    # path (same names) must get a new archive, or every driver silently starts without one.
    stamps = [f"{n}:{st.st_size}:{st.st_mtime_ns}" for n in names for st in [os.stat(os.path.join(jars, n))]]
    key = "\n".join([os.path.realpath(java), pyspark.__version__, jars, *stamps])
    base = setting("ONCEFLOW_JVM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "onceflow", "jvm")
    return os.path.join(base, f"spark-{pyspark.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa")


#: archives kept besides the current one (other installations: venvs, PySpark versions)
KEEP = 2


def prune(path: str, keep: int = KEEP, partial_age_s: float = _BUILD_TIMEOUT_S) -> list[str]:
    """Remove what piles up next to ``path`` (170 MB each): archives of other installations
    beyond the ``keep`` most recently used, and partial ones of builds older than their
    timeout. Returns the removed names; errors are ignored (another process may prune too)."""
    folder, removed = os.path.dirname(path), []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now, archives, dead = time.time(), [], []
    for name in names:
        full = os.path.join(folder, name)
        try:
            st = os.stat(full)
        except OSError:
            continue
        if name.endswith(".tmp") and now - st.st_mtime > partial_age_s:
            dead.append(full)  # a dead build's partial archive
        elif name.endswith(".jsa") and full != path:
            archives.append((max(st.st_atime, st.st_mtime), full))
    for full in dead + [full for _, full in sorted(archives, reverse=True)[keep:]]:
        try:
            os.unlink(full)
            removed.append(os.path.basename(full))
        except OSError:
            pass
    return removed


def java_options() -> str:
    """JVM options for a driver: use the archive if it exists, else start building it."""
    if not enabled():
        return ""
    try:
        path = archive_path()
        if os.path.exists(path):
            return f"-XX:SharedArchiveFile={path} {QUIET}"
        _start_build(path)
    except OSError as e:  # an unwritable cache dir only costs start-up time
        log.debug("no JVM class archive: %s", e)
    return ""


def _start_build(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = f"{path}.building"
    try:
        if time.time() - os.path.getmtime(lock) < _BUILD_TIMEOUT_S:
            return  # another driver's helper is at it
        os.unlink(lock)
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return
    env = {**os.environ, "ONCEFLOW_JVM_CACHE": "0"}  # the helper must not recurse
    # No preexec_fn: forking a threaded process (a driver, a test with a JVM) and running Python
    # in the child before exec can deadlock on a lock another thread held (seen: a test hung in
    # Popen). The helper lowers its own priority.
    subprocess.Popen([sys.executable, "-m", "onceflow.runtime.jvm_archive", path], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    log.info("building the JVM class archive %s in the background (faster driver starts)", path)
