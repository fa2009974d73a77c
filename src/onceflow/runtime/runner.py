"""Running a Job in this process: pre-flight checks, the fence, the query, in-process restarts.

Query failures restart the query in-process per the job's RestartStrategy; errors that a
restart cannot fix (bad configuration, fingerprint mismatch, fenced) stop at once with a
one-line message. Each committed batch, start, restart and stop is appended to the event log.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import ExitStack
from typing import TYPE_CHECKING

from fsspec.core import url_to_fs

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import CheckpointError, ConfigError, OnceflowError

if TYPE_CHECKING:
    from onceflow.job import Job

log = logging.getLogger("onceflow.runner")

# Exceptions (by class name) raised inside Spark that a restart cannot fix.
FATAL_MARKERS = ("FingerprintMismatch", "ConfigError", "FencedError")
# Held while one job sets the session conf its source reads and builds that source.
_SOURCE_LOCK = threading.Lock()


class GaveUp(OnceflowError):
    """The restart strategy gave up after repeated query failures."""


class BatchTimeout(OnceflowError):
    """A batch ran longer than CheckpointConfig.batch_timeout."""


def _fatal_message(text: str) -> str | None:
    for marker in FATAL_MARKERS:
        idx = text.find(f"onceflow.errors.{marker}: ")
        if idx >= 0:
            line = text[idx:].splitlines()[0]
            return line.split(": ", 1)[1].replace(" SQLSTATE: 38000", "").strip()
    return None


def check_checkpoint_dir(url: str) -> None:
    """The checkpoint directory must be creatable and writable; fail early if not."""
    try:
        fs, path = url_to_fs(url)
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/_onceflow/.probe-{uuid.uuid4().hex[:8]}"
        fs.makedirs(probe.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(probe, "w") as f:
            f.write("ok")
        fs.rm(probe)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint directory {url} is not writable ({e.__class__.__name__}: {e}); "
            "give a directory you can write to"
        ) from None
    ckpt = CheckpointDir(url)
    if ckpt.fs.exists(ckpt._p("metadata")):
        _ = ckpt.lineage  # raises CheckpointError when corrupt


class JobRunner:
    """Runs one Job until its source is exhausted, a stop is requested, or restarts run out."""

    def __init__(self, job: Job, spark=None, stop: threading.Event | None = None, restore=None):
        self.job = job
        self.restore = restore  # a savepoint.RestoreRequest, applied before the first query
        self.spark = spark
        self.stop = stop or threading.Event()
        self.url = job.checkpoint.directory.rstrip("/")
        self.events = EventLog(self.url)

    # ---- public ------------------------------------------------------------------------

    def run(self) -> None:
        job = self.job
        check_checkpoint_dir(self.url)
        with ExitStack() as stack:
            lease = DriverLease(self.url, job.name).acquire()
            stack.callback(lease.release)
            spark = self.spark or self._spark()
            if self.restore is not None:
                self.restore.apply(self.url, job=job, spark=spark)
            started = time.time()
            self.events.append("start", job=job.name, restart_strategy=job.restart_strategy.describe())
            attempt = 0
            while True:
                try:
                    self._run_query(spark, started)
                    self.events.append("stop", job=job.name, reason="stopped" if self.stop.is_set() else "finished")
                    return
                except OnceflowError:
                    raise
                except Exception as e:  # a failed query: restart strategy decides
                    text = str(e)
                    fatal = _fatal_message(text)
                    if fatal:
                        self.events.append("failed", cause=fatal)
                        raise OnceflowError(fatal) from None
                    cause = _short_cause(text)
                    delay = job.restart_strategy.on_failure(time.time())
                    attempt += 1
                    if delay is None:
                        self.events.append("gave_up", cause=cause, attempts=attempt)
                        raise GaveUp(
                            f"job {job.name} failed and the restart strategy "
                            f"{job.restart_strategy.describe()} gave up; last cause: {cause}"
                        ) from None
                    log.warning("query failed (%s); restarting in %.1fs", cause, delay)
                    self.events.append("restart", cause=cause, delay_s=delay, attempt=attempt, scope="query")
                    if self.stop.wait(delay):
                        self.events.append("stop", job=job.name, reason="stopped")
                        return
                    started = time.time()

    # ---- internals ---------------------------------------------------------------------

    def _spark(self):
        from onceflow.spark import get_spark

        conf = {**self.job.checkpoint.spark_conf(), **self.job.spark_conf}
        return get_spark(self.job.master, self.job.name, conf)

    def _build(self, spark):
        from onceflow.spark import register_all

        register_all(spark)
        job = self.job
        for key, value in {**job.checkpoint.spark_conf(), **job.spark_conf}.items():
            if key.startswith("spark.sql."):  # session confs: apply to a given session too
                spark.conf.set(key, value)
        with _SOURCE_LOCK:  # the session conf is read by job.source(): one job at a time per process
            spark.conf.set("spark.onceflow.checkpointLocation", self.url)  # sources' event log (Kafka data loss)
            df = job.source(spark)
        if job.transform is not None:
            df = job.transform(df)
        if not df.isStreaming:
            raise ConfigError(f"job {job.name}: the source must be a streaming DataFrame (spark.readStream...)")
        sink_opts = dict(job.sink.options())
        if job.checkpoint.min_pause_s:
            sink_opts["min_pause"] = str(job.checkpoint.min_pause_s)
        source = job.sink.data_source({**sink_opts, "checkpointlocation": self.url})
        source.validate(df.schema, job.output_mode == "complete")
        writer = (
            df.writeStream.format(job.sink.format_name)
            .options(**sink_opts)
            .option("checkpointLocation", self.url)
            .outputMode(job.output_mode)
            .queryName(job.name)
        )
        if job.checkpoint.interval_s > 0:
            writer = writer.trigger(processingTime=f"{int(job.checkpoint.interval_s * 1000)} milliseconds")
        return writer, source

    def _run_query(self, spark, started: float) -> None:
        if any(q.name == self.job.name for q in spark.streams.active):
            raise ConfigError(
                f"job {self.job.name}: a query with this name is already running in this Spark "
                "session (another job of the same name); give each job that runs at the same "
                "time in one driver its own Job(name=...)"
            )
        writer, source = self._build(spark)
        ckpt = CheckpointDir(self.url)
        with ExitStack() as stack:
            opener = getattr(source, "open", None)
            if ckpt.exists():
                if callable(opener):  # fence + recovery, held for the run
                    stack.enter_context(opener(ckpt.lineage))
                    opener = None
                else:
                    source.recover(ckpt.lineage)
            query = writer.start()
            stack.callback(_stop_quietly, query)
            if callable(opener):
                stack.enter_context(opener(query.id))
            self._monitor(query, started)

    def _monitor(self, query, started: float) -> None:
        job, cfg = self.job, self.job.checkpoint
        seen = -1
        recovered = False
        active_since: float | None = None
        idle_since: float | None = None
        stop_after: int | None = None  # batch id in flight when a stop was requested
        while True:
            if query.awaitTermination(0.25):
                self._record_progress(query, seen)
                exc = query.exception()
                if exc is not None:
                    raise RuntimeError(str(exc))
                return
            seen, new = self._record_progress(query, seen)
            if new and not recovered:
                recovered = True
                self.events.append("recovered", recovery_s=round(time.time() - started, 3), batch=seen)
            status = query.status
            now = time.time()
            active = bool(status.get("isTriggerActive"))
            active_since = (active_since or now) if active else None
            # Idle = no batch ran and the source reported no data since idle_since. A trigger
            # that is only asking the source for offsets (slow for Kafka) does not reset it.
            if new or status.get("isDataAvailable") or (seen < 0 and query.lastProgress is None):
                idle_since = None
            else:
                idle_since = idle_since or now
            if cfg.batch_timeout_s and active_since and now - active_since > cfg.batch_timeout_s:
                query.stop()
                raise RuntimeError(f"BatchTimeout: batch ran longer than {cfg.batch_timeout_s}s")
            if self.stop.is_set():
                # Let the in-flight batch finish; stop before the next one gets far.
                if stop_after is None:
                    stop_after = seen
                if not active or seen > stop_after:
                    query.stop()
                    return
            if (job.stop_when_idle is not None and idle_since and not active
                    and now - idle_since >= job.stop_when_idle):
                query.stop()
                return

    def _record_progress(self, query, seen: int) -> tuple[int, bool]:
        """Log each executed batch once. Spark's idle reports ("no data", no ``addBatch``) carry
        the id of the batch that has not run yet; they are skipped so that batch's real figures
        are logged when it runs."""
        new = False
        for p in query.recentProgress:
            batch = p.batchId
            if batch <= seen or "addBatch" not in (p.durationMs or {}):
                continue
            new = True
            seen = batch
            self.events.append(
                "batch", batch=batch, input_rows=p.numInputRows,
                duration_ms=p.durationMs.get("triggerExecution"),
                rows_per_s=round(p.processedRowsPerSecond or 0.0, 1),
                offsets=[s.endOffset for s in p.sources],
                state_rows=sum(o.numRowsTotal for o in p.stateOperators),
                state_bytes=sum(o.memoryUsedBytes for o in p.stateOperators),
            )
        return seen, new


def _stop_quietly(query) -> None:
    try:
        if query.isActive:
            query.stop()
    except Exception:  # noqa: BLE001 - stopping during shutdown; nothing left to save
        pass


def _short_cause(text: str) -> str:
    """The most telling line of a Spark failure (the Python or JVM exception line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ("Error:" in ln or "Exception:" in ln) and not ln.startswith("at "):
            if "onceflow" in ln or "Injected" in ln or "psycopg" in ln:
                return ln[:300]
    return (lines[0] if lines else "unknown")[:300]
