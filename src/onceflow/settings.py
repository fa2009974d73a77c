"""Every ``ONCEFLOW_*`` environment variable, in one place: name, default and meaning.

Code reads them with :func:`setting` (or names them by the constants below), so that an
unknown name is a KeyError in development and docs/configuration.md, generated from
:data:`SETTINGS` (``onceflow config-reference``), lists them all. A test checks that every
``ONCEFLOW_`` name in the source is registered here.

``kind`` says who sets a variable: ``user`` (you), ``run`` (``onceflow run`` sets it for its
driver processes from its options; setting it yourself does the same), ``internal`` (between
onceflow's own processes: never set it), ``test`` (fault injection and test hooks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  #: None: unset means "not given"
    meaning: str
    kind: str = "user"  #: user | run | internal | test


_ALL = [
    # ---- user -----------------------------------------------------------------------------
    Setting("ONCEFLOW_STORAGE_OPTIONS", None, "JSON object of fsspec / delta-rs storage options "
            "for object-store URLs (s3://, gs://, abfs://) when neither the sink nor the job gives "
            "its own (docs/object-stores.md)."),
    Setting("ONCEFLOW_LOG_LEVEL", "INFO", "Log level of onceflow's processes: DEBUG, INFO, "
            "WARNING or ERROR (`onceflow --log-level`)."),
    Setting("ONCEFLOW_LOG_FORMAT", "text", "`text`, or `json`: one JSON object per line (time, "
            "level, logger, message, role, job, pid) for log shippers (`onceflow --log-format`)."),
    Setting("ONCEFLOW_SPARK_LOG_LEVEL", "ERROR", "Log level of the Spark JVM of each driver "
            "(Spark's own `setLogLevel`)."),
    Setting("ONCEFLOW_LEASE_TTL_S", "30", "Seconds a driver keeps the checkpoint's lease without "
            "a successful renewal before it gives it up (and stops its query)."),
    Setting("ONCEFLOW_LEASE_RENEW_S", "TTL/6", "Seconds between lease renewals."),
    Setting("ONCEFLOW_SCRATCH_DIR", "<system temp>/onceflow-scratch", "Where each driver keeps "
            "its Spark scratch space (one directory per job; reclaimed after crashes)."),
    Setting("ONCEFLOW_JVM_CACHE", "1", "`0` turns off the cache of Spark's JVM class archive "
            "(faster driver starts)."),
    Setting("ONCEFLOW_JVM_CACHE_DIR", "~/.cache/onceflow/jvm", "Where the JVM class archive is kept."),
    Setting("ONCEFLOW_STANDBY_WARM_UP", "1", "`0`: a standby driver starts its JVM and Spark "
            "session only, without the warm-up query and its reruns while waiting (less CPU; "
            "its takeover takes seconds longer: docs/recovery.md)."),
    Setting("ONCEFLOW_TASK_EVENTS", None, "`1`: every sink task logs the rows it processed to "
            "the event log (replays included); verify and the demo use it."),
    Setting("ONCEFLOW_NO_EVENTS", None, "Non-empty: sinks write no `sink_commit` events "
            "(benchmarks)."),
    Setting("ONCEFLOW_METRICS_FLINK_NAMES", "1", "`0`: the metrics endpoint leaves out Flink's "
            "names (`onceflow_job_numRestarts`...; docs/metrics.md)."),
    Setting("ONCEFLOW_METRICS_TAIL_S", "1 local, 15 object stores", "Minimum seconds between two "
            "reads of the event log by the metrics endpoint's follower (never per scrape)."),
    Setting("ONCEFLOW_STATE_SIZE_EVERY_S", "30", "Seconds between two listings of the state on "
            "the checkpoint for its size (batch events, metrics); `0`: after every batch."),
    # ---- set by onceflow run for its drivers -----------------------------------------------
    Setting("ONCEFLOW_CHECKPOINT", None, "`--checkpoint`: the job's checkpoint directory.", "run"),
    Setting("ONCEFLOW_RESTART_STRATEGY", None, "`--restart-strategy`: e.g. "
            "`fixed_delay:attempts=5,delay=2s`.", "run"),
    Setting("ONCEFLOW_MASTER", None, "`--master`: the Spark master of the drivers.", "run"),
    Setting("ONCEFLOW_REMOTE", None, "`--remote`: a Spark Connect URL (sc://host:port).", "run"),
    Setting("ONCEFLOW_SPARK_CONF", None, "`--conf`, as a JSON object of Spark settings for every "
            "SparkSession the drivers create.", "run"),
    Setting("ONCEFLOW_METRICS_PORT", None, "`--metrics-port`: serve Prometheus metrics there.", "run"),
    Setting("ONCEFLOW_LEASE_WAIT_S", "0", "`--wait-for-lease`: seconds to stand by while another "
            "driver holds the lease (`onceflow run` default: forever).", "run"),
    Setting("ONCEFLOW_SAVEPOINT_ON_STOP", "1", "`0` (`--no-savepoint-on-stop`): SIGTERM stops "
            "without a savepoint.", "run"),
    Setting("ONCEFLOW_SAVEPOINT_DIR", "CHECKPOINT/../savepoints", "`--savepoint-dir`: where the "
            "savepoint on stop goes.", "run"),
    Setting("ONCEFLOW_FROM_SAVEPOINT", None, "`--from-savepoint`: restore this savepoint first.", "run"),
    Setting("ONCEFLOW_FORK", None, "`--fork`: `1` runs the restored savepoint as a new lineage.", "run"),
    Setting("ONCEFLOW_RESCALE", None, "`--rescale N`: repartition restored state.", "run"),
    Setting("ONCEFLOW_ALLOW_NON_RESTORED_STATE", None, "`--allow-non-restored-state`: `1` drops "
            "state of operators the job no longer has.", "run"),
    # ---- between onceflow's own processes ---------------------------------------------------
    Setting("ONCEFLOW_DRIVER_PGID", None, "The driver's process group (the supervisor sets it).",
            "internal"),
    Setting("ONCEFLOW_STANDBY_GO", None, "Makes a driver a warm standby that runs once this file "
            "exists (the supervisor sets it).", "internal"),
    Setting("ONCEFLOW_SPARK_LOCAL_DIRS", None, "The SPARK_LOCAL_DIRS onceflow set for a driver's "
            "scratch space.", "internal"),
    Setting("ONCEFLOW_VERIFY_SPEC", None, "The spec file of `onceflow verify`'s job.", "internal"),
    Setting("ONCEFLOW_DEMO_DIR", "onceflow-demo", "`onceflow demo`'s work directory.", "internal"),
    Setting("ONCEFLOW_DEMO_EVENTS", "3000000", "`onceflow demo --events`.", "internal"),
    Setting("ONCEFLOW_DEMO_RATE", "100000", "`onceflow demo --rate`.", "internal"),
    # ---- tests and fault injection -----------------------------------------------------------
    Setting("ONCEFLOW_CRASH_AT", None, "Fault injection: `point[@batch][:mode]`, comma-separated "
            "(onceflow.faults).", "test"),
    Setting("ONCEFLOW_CRASH_MARKER_DIR", None, "Where fired fault rules are recorded (each fires "
            "once).", "test"),
    Setting("ONCEFLOW_SLOW_COMMIT_FILE", None, "While this file exists, every batch commit first "
            "sleeps the seconds it holds.", "test"),
    Setting("ONCEFLOW_STOP_LATE_S", "0", "A stop (`onceflow stop`, SIGTERM) stops the query this many "
            "seconds after the in-flight batch ended, in the next batch's write when that is longer "
            "(tests of an interrupted write).", "test"),
]

#: name -> Setting, in documentation order
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}

# names the code refers to as constants
LOG_LEVEL_ENV = "ONCEFLOW_LOG_LEVEL"
LOG_FORMAT_ENV = "ONCEFLOW_LOG_FORMAT"


@overload
def setting(name: str, default: str, environ: Mapping[str, str] | None = None) -> str: ...
@overload
def setting(name: str, default: None = None, environ: Mapping[str, str] | None = None) -> str | None: ...
def setting(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` in the environment, else ``default`` (KeyError: not registered).

    The registry's own default is for the documentation (it may be a description, such as
    ``TTL/6``); the caller passes the value it uses."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not in onceflow.settings.SETTINGS")
    value = (os.environ if environ is None else environ).get(name)
    return default if value in (None, "") else value
