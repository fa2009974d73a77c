"""Creating a SparkSession that works for onceflow (Python workers, local IP, registrations)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from onceflow.errors import ConfigError
from onceflow.settings import setting


def ensure_java() -> None:
    """Fail with instructions (not a JVM launcher trace) when Java 17+ is missing or too old."""
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    how = "Install it (Debian/Ubuntu: 'apt-get install -y openjdk-17-jre-headless', or ./setup.sh) and retry."
    if not java or not os.path.exists(java):
        raise ConfigError(f"Java 17 or newer is required by Spark and was not found on PATH or JAVA_HOME. {how}")
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"{java} -version failed ({e}); Spark needs a working Java 17+. {how}") from None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(m.group(1)) if m else 0
    if major == 1 and m and m.group(2):  # "1.8.0_x" style
        major = int(m.group(2))
    if m and major < 17:
        raise ConfigError(f"{java} is Java {major}; Spark 4 needs Java 17 or newer. {how}")


#: The Spark line onceflow is built and tested against (pyproject pins pyspark to it): the
#: Python Data Source streaming API and the checkpoint layout onceflow reads changed before it.
SUPPORTED_SPARK = (4, 3)


def check_spark_version(version: str, what: str = "pyspark") -> None:
    """ConfigError, one line, when ``version`` is not a supported Spark (:data:`SUPPORTED_SPARK`)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m is None or (int(m.group(1)), int(m.group(2))) != SUPPORTED_SPARK:
        want = ".".join(map(str, SUPPORTED_SPARK))
        raise ConfigError(f"{what} is Spark {version}; onceflow supports Spark {want}.x only "
                          f"(pip install 'pyspark>={want},<{SUPPORTED_SPARK[0]}.{SUPPORTED_SPARK[1] + 1}'; "
                          "README: Compatibility)")


#: ``onceflow run --conf k=v``, as JSON, for every SparkSession the run's drivers create
SPARK_CONF_ENV = "ONCEFLOW_SPARK_CONF"
#: ``onceflow run --remote sc://host:15002``: drivers use a Spark Connect session
REMOTE_ENV = "ONCEFLOW_REMOTE"


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (no JVM in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def prepare_environment(master: str | None = None) -> None:
    """Environment every onceflow process needs before the JVM starts.

    With a ``local`` master, Spark binds to the loopback address unless ``SPARK_LOCAL_IP`` says
    otherwise (everything runs on this host; a host name that does not resolve cannot break
    it). With any other master nothing is forced: executors on other hosts must reach the
    driver."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")
    # Spark's Python processes import pyspark from its installed package, not from the zip
    # (see onceflow/runtime/sitepath/sitecustomize.py).
    sitepath = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime", "sitepath")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if sitepath not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([sitepath, *paths])


#: onceflow's defaults; a job's ``spark_conf``, ``--conf`` and spark-submit's settings win
DEFAULTS = {
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.streaming.stopTimeout": "120s",
    "spark.python.worker.reuse": "true",
}

#: onceflow's default for a ``local`` or ``local-cluster`` master, whose executors run this
#: very Python installation: Python workers forked from :mod:`onceflow.runtime.daemon`, with
#: pyarrow, pandas and onceflow's modules already imported. Executors elsewhere keep Spark's
#: daemon unless the job names this one (their installation may hold another onceflow).
LOCAL_DEFAULTS = {"spark.python.daemon.module": "onceflow.runtime.daemon"}


#: Spark's checkpoint files (``offsets/N``, ``commits/N``, state store files) of a query whose
#: checkpoint is on a local disk are written by the FileSystem-based manager. Spark's default
#: (FileContext-based) ran, without Hadoop's native library (PySpark ships none), ten new
#: processes for every file it wrote: ``chmod`` of the file and of its ``.crc``, and eight
#: ``readlink`` for the rename's checks, about 30 ms per file and two files per trigger. Both
#: managers write a temporary file and rename it after checking that the target does not exist,
#: and both keep the ``.crc`` files; on a local disk neither rename is more atomic. Elsewhere
#: (HDFS: an atomic rename) Spark's choice stands.
LOCAL_CHECKPOINT_CONF = {
    "spark.sql.streaming.checkpointFileManagerClass":
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
}

#: Arrow batches that cross from the JVM to the sinks' Python writers: Spark's default of
#: 10,000 rows made a million-row batch 100 Python calls per task and 100 Parquet row groups;
#: 100,000 rows, bounded at 64 MB a batch for wide rows, took the Iceberg sink from 1.96M to
#: 2.61M rows/s (benchmarks/bench_iceberg.py, 1M rows per batch). Pandas UDFs in the same query
#: see the same batches.
ARROW_BATCH_CONF = {
    "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
    "spark.sql.execution.arrow.maxBytesPerBatch": str(64 << 20),
}


@contextmanager
def query_conf(spark, checkpoint_url: str) -> Iterator[dict[str, str]]:
    """Session settings for the query started inside this block (Spark copies the session's
    settings when a query starts): :data:`ARROW_BATCH_CONF`, and :data:`LOCAL_CHECKPOINT_CONF`
    for a checkpoint on a local disk, each unless the session already names it. They are
    removed again on exit, so the caller's session keeps its own. Yields what was set."""
    from onceflow.storage import scheme_of

    conf = dict(ARROW_BATCH_CONF)
    if scheme_of(checkpoint_url) in ("", "file"):
        conf.update(LOCAL_CHECKPOINT_CONF)
    added = {k: v for k, v in conf.items() if spark.conf.get(k, None) is None}
    for key, value in added.items():
        spark.conf.set(key, value)
    try:
        yield added
    finally:
        for key in added:
            spark.conf.unset(key)


def submitted() -> bool:
    """Whether spark-submit started this Python process (its JVM, master and conf exist)."""
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT"))


def get_spark(master: str | None = "local[2]", app_name: str = "onceflow", conf: dict | None = None,
              remote: str | None = None):
    """Return a SparkSession with onceflow's data sources registered.

    ``master`` is a default: under spark-submit its ``--master`` wins; None leaves the choice to
    Spark (``spark.master`` in spark-defaults.conf, else ``local[*]``). ``conf`` is overridden by
    ``onceflow run --conf`` (``ONCEFLOW_SPARK_CONF``). The Spark UI is on (``spark.ui.port``,
    default 4040 or the next free port). ``remote``: a Spark Connect URL (``sc://host:15002``);
    the session is then a Connect client and ``master`` is the server's business."""
    import pyspark

    check_spark_version(pyspark.__version__)
    from onceflow.storage import spark_redaction_conf  # Spark redacts object-store secrets too

    if remote:
        return _connect(remote, app_name, spark_redaction_conf({**(conf or {}), **cli_conf()}, connect=True))
    ensure_java()
    if submitted():
        master = None
    prepare_environment(master)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder if master is None else SparkSession.builder.master(master)
    builder = builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    conf = spark_redaction_conf({**(conf or {}), **cli_conf()})
    if not submitted():  # under spark-submit, its --conf settings win over onceflow's defaults
        local = LOCAL_DEFAULTS if master and master.startswith("local") else {}
        conf = {**DEFAULTS, **local, **conf}
        from onceflow import jvm_cache

        cds = jvm_cache.java_options()  # the driver JVM maps its classes from an archive
        if cds:
            user = conf.get("spark.driver.extraJavaOptions", "")
            conf["spark.driver.extraJavaOptions"] = f"{cds} {user}".strip()  # the user's options win
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if submitted():
        given = spark.sparkContext.getConf()
        for key, value in DEFAULTS.items():
            if key.startswith("spark.sql.") and key not in conf and not given.contains(key):
                spark.conf.set(key, value)
    spark.sparkContext.setLogLevel(setting("ONCEFLOW_SPARK_LOG_LEVEL", "ERROR"))
    register_all(spark)
    return spark


def _connect(remote: str, app_name: str, conf: dict[str, str]):
    """A Spark Connect session to ``remote``: SQL settings are applied to the session; the
    others (executors, UI, ...) belong to the server and are left to it, with a warning."""
    import logging

    try:
        import pyspark.sql.connect.session  # noqa: F401 - the client libraries are installed
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise ConfigError(f"Spark Connect needs pyspark's client libraries ({e}); install them "
                          "with: pip install 'onceflow[connect]'") from None
    if not remote.startswith("sc://"):
        raise ConfigError(f"--remote {remote!r}: give a Spark Connect URL, e.g. sc://host:15002")
    _probe(remote)
    session_conf = {k: v for k, v in {**DEFAULTS, **conf}.items() if k.startswith("spark.sql.")}
    server_only = sorted(k for k in conf if not k.startswith("spark.sql."))
    if server_only:
        logging.getLogger("onceflow.spark").warning(
            "Spark Connect: %s are settings of the Connect server, not of a session; set them "
            "where the server starts (start-connect-server.sh --conf ...)", ", ".join(server_only))
    try:
        # pyspark's own builder: it also switches pyspark to Connect mode for this process
        # (DDL strings, UDF return types are then parsed by the server).
        spark = SparkSession.builder.remote(remote).appName(app_name).getOrCreate()
        check_spark_version(spark.version, f"the Spark Connect server {remote}")
        for key, value in session_conf.items():
            spark.conf.set(key, value)
        register_all(spark)
    except Exception as e:  # noqa: BLE001 - gRPC errors have many classes; one line says it
        if type(e).__name__ in ("SparkConnectGrpcException", "RetriesExceeded", "_InactiveRpcError") \
                or "UNAVAILABLE" in str(e):
            from onceflow.errors import SparkUnavailable

            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SparkUnavailable(f"Spark Connect server {remote} cannot be reached ({first[:200]}); "
                                   "start it (sbin/start-connect-server.sh) or fix --remote") from None
        raise
    return spark


def _probe(remote: str, timeout_s: float = 10.0) -> None:
    """SparkUnavailable at once when nothing listens at the Connect URL (the client itself
    would retry for minutes before saying so)."""
    import socket
    from urllib.parse import urlparse

    from onceflow.errors import SparkUnavailable

    url = urlparse(remote.replace("sc://", "http://", 1))
    try:
        with socket.create_connection((url.hostname or "localhost", url.port or 15002), timeout=timeout_s):
            pass
    except OSError as e:
        raise SparkUnavailable(f"Spark Connect server {remote} cannot be reached ({e}); start it "
                               "(sbin/start-connect-server.sh) or fix --remote") from None


def cli_conf() -> dict[str, str]:
    """The ``onceflow run --conf`` settings handed to this process, if any."""
    import json

    raw = os.environ.get(SPARK_CONF_ENV)
    if not raw:
        return {}
    try:
        conf = json.loads(raw)
    except ValueError:
        raise ConfigError(f"{SPARK_CONF_ENV} is not a JSON object of Spark settings: {raw[:200]}") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{SPARK_CONF_ENV} is not a JSON object of Spark settings: {raw[:200]}")
    return {str(k): str(v) for k, v in conf.items()}


def parse_conf(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``k=v`` strings (``onceflow run --conf``) as a dict; a clear error for anything else."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--conf {pair!r}: give a Spark setting as KEY=VALUE, e.g. --conf spark.ui.port=4050")
        out[key.strip()] = value
    return out


def register_all(spark) -> None:
    """Register every onceflow data source (sources and sinks) with ``spark`` and make it the
    calling thread's active session (see :func:`activate`)."""
    from onceflow.sinks import registry as sink_registry
    from onceflow.sources import registry as source_registry

    for cls in sink_registry.data_sources() + source_registry.data_sources():
        spark.dataSource.register(cls)
    activate(spark)


def activate(spark) -> None:
    """Make ``spark`` the active session of the calling thread's JVM thread.

    Spark 4.3 finds a Python data source *sink* at ``writeStream.start()`` only through the
    thread's active session: a query started from a Python thread that never had one (a job run
    from a worker thread, a scheduler, a notebook kernel thread) fails with DATA_SOURCE_NOT_FOUND
    although the source resolved fine. A no-op on Spark Connect sessions.
    """
    jvm = getattr(spark, "_jvm", None)
    if jvm is not None:
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
