"""Running a Job in this process: pre-flight checks, the lease, the sink's epoch, the query,
in-process restarts.

Before each query start the runner fixes the lineage (writing Spark's ``metadata`` when the
checkpoint is new), opens the sink for it (:meth:`TwoPhaseCommitSink.open`: a new fencing
epoch, then recovery) and passes the epoch to the query as the ``epoch`` option.

Query failures, and outages (:class:`~onceflow.errors.SinkError`: a sink unreachable while
opening, validating or committing), restart the query in-process per the job's
RestartStrategy, with one log line per attempt saying what waits. Errors that a restart cannot
fix (``fatal``: bad configuration, fingerprint mismatch, fenced) stop at once with a one-line
message; a driver fenced by a successor (a newer sink epoch, or the lease lost) raises
FencedError. A dead Spark JVM raises JvmDied (the process must restart). Each committed batch,
start, restart and stop is appended to the event log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from contextlib import ExitStack
from typing import TYPE_CHECKING

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import (
    BY_NAME,
    CheckpointError,
    ConfigError,
    FencedError,
    GaveUp,
    JvmDied,
    LeaseLost,
    OnceflowError,
)
from onceflow.outages import Stopped, short, wait_out
from onceflow.runtime import metrics, scratch
from onceflow.savepoint.context import RestoreContext, checkpoint_context
from onceflow.savepoint.operations import cancel_requested, stop_request_id, stop_requested
from onceflow.settings import setting
from onceflow.spark import cli_conf, get_spark, is_connect, query_conf, register_all

if TYPE_CHECKING:
    from collections.abc import Callable

    from onceflow.runtime.spec import JobSpec

log = logging.getLogger("onceflow.runner")

# Held while one job sets the session conf its source reads and builds that source.
_SOURCE_LOCK = threading.Lock()

#: a wall-clock step back longer than this (seconds) restarts the query: Spark's
#: processing-time trigger would otherwise wait out the step (a restart costs about this much)
CLOCK_STEP_S = 5.0


class BatchTimeout(OnceflowError):
    """A batch ran longer than CheckpointConfig.batch_timeout."""


def onceflow_error_in(text: str) -> OnceflowError | None:
    """The first onceflow error named in a Spark failure's text (raised in a task or the
    commit runner), rebuilt as its class with its one-line message; None if there is none."""
    found: tuple[int, OnceflowError] | None = None
    for name, cls in BY_NAME.items():
        idx = text.find(f"onceflow.errors.{name}: ")
        if idx >= 0 and (found is None or idx < found[0]):
            line = text[idx:].splitlines()[0]
            found = (idx, cls(line.split(": ", 1)[1].replace(" SQLSTATE: 38000", "").strip()))
    return found[1] if found else None


def jvm_alive(spark) -> bool:
    """False when the session's JVM process (launched by this Python process) has exited
    (always True for a Spark Connect session: its JVM is the server's)."""
    if is_connect(spark):
        return True
    gateway = getattr(spark.sparkContext, "_gateway", None)
    proc = getattr(gateway, "proc", None)
    return proc is None or proc.poll() is None


def ensure_lineage(ckpt: CheckpointDir) -> str:
    """:meth:`CheckpointDir.ensure_lineage`."""
    return ckpt.ensure_lineage()


def check_checkpoint_dir(checkpoint: CheckpointDir | str, stop: threading.Event | None = None) -> None:
    """The checkpoint directory must be creatable and writable, and its ``metadata`` (when
    present) readable: CheckpointError at once for what waiting cannot fix (a path under a
    file, no permission, a malformed URL, corrupt metadata). Any other error, e.g. a full or
    read-only filesystem or an object store that is down, is an outage: waited out, one log
    line per retry."""
    ckpt = CheckpointDir.of(checkpoint)

    def probe() -> None:
        _probe_write(ckpt)
        if ckpt.fs.exists(ckpt._p("metadata")):
            ckpt.read_lineage()  # raises CheckpointError when corrupt

    try:
        wait_out(f"writing to the checkpoint directory {ckpt.url}", probe, log, stop=stop)
    except (OnceflowError, Stopped):
        raise
    except Exception as e:  # noqa: BLE001 - a configuration error of the store: one line
        raise CheckpointError(f"checkpoint directory {ckpt.url} is not writable ({short(e)}); "
                              "give a directory you can write to") from None


def _probe_write(ckpt: CheckpointDir) -> None:
    fs, path = ckpt.fs, ckpt.path
    fs.makedirs(path, exist_ok=True)
    probe = f"{path}/_onceflow/.probe-{uuid.uuid4().hex[:8]}"
    fs.makedirs(probe.rsplit("/", 1)[0], exist_ok=True)
    try:
        with fs.open(probe, "w") as f:
            f.write("ok")
    finally:
        if fs.exists(probe):
            fs.rm(probe)


def driver_spark(job: JobSpec, checkpoint_url: str):
    """The job's SparkSession for this driver process, its scratch space in a directory of its
    own (see :mod:`onceflow.runtime.scratch`; not for Spark Connect, which has no local JVM)."""
    conf = {**job.checkpoint.spark_conf(), **job.spark_conf}
    if not job.remote:
        conf = scratch.spark_conf(scratch.driver_dir(job.name, checkpoint_url), job.master, conf)
    return get_spark(job.master, job.name, conf, job.remote)


class JobRunner:
    """Runs one Job until its source is exhausted, a stop is requested, or restarts run out."""

    def __init__(self, job: JobSpec, spark=None, stop: threading.Event | None = None, restore=None,
                 takeover: bool | int = False, checkpoint: CheckpointDir | None = None):
        self.job = job
        self.takeover = takeover
        self.ran = False
        self.restore = restore  # a savepoint.RestoreRequest, applied before the first query
        self.spark = spark
        self.stop = stop or threading.Event()
        self.ckpt = checkpoint or CheckpointDir(job.checkpoint.directory)
        self.url = self.ckpt.url
        self.events: EventLog = metrics.event_log(self.ckpt)  # feeds the served metrics, if any
        self._state_size = metrics.StateSize(self.ckpt)
        self._query_started = False
        self._restored_now, self._attempt = False, 0  # for context(), set again by run()

    # ---- public ------------------------------------------------------------------------

    def _stopped_meanwhile(self, since: float) -> bool:
        """Whether ``onceflow stop`` stopped the job since ``since``: its request is still there
        (the stopping driver consumes it after releasing the lease) or was done meanwhile."""
        try:
            return stop_requested(self.url) or any(
                e.get("event") == "stop_request_done" and float(e.get("ts", 0)) >= since
                for e in self.events.read())
        except Exception as e:  # noqa: BLE001 - unreadable: start (the stop retries, the lease fences)
            log.warning("could not read the stop request of %s (%s); starting", self.url, short(e))
            return False

    def run(self) -> None:
        """Run the job until it finishes, is stopped or fails for good. ``ran`` says afterwards
        whether it ran at all (False: stopped while standing by for another driver's lease)."""
        job = self.job
        try:
            check_checkpoint_dir(self.ckpt, self.stop)
        except Stopped:
            log.info("stopped while waiting for the checkpoint store")
            return
        with ExitStack() as stack:
            t0 = time.time()
            lease, spark = DriverLease(self.ckpt, job.name), self.spark
            if spark is None and float(setting("ONCEFLOW_LEASE_WAIT_S", "0")) > 0 and lease.holder():
                spark = self._spark()  # waiting for another host's lease: start Spark meanwhile
            spark_s = time.time() - t0
            try:
                self.lease = lease.acquire(takeover=self.takeover, stop=self.stop)
            except Stopped:
                log.info("stopped while standing by for the lease of %s; the job ran elsewhere", self.url)
                return
            stack.callback(self.lease.release)
            stack.callback(self._saw_stop_request)  # (an ExitStack runs it first)
            if self.lease.waited and self._stopped_meanwhile(t0):
                log.info("the job was stopped ('onceflow stop') while this driver stood by for its "
                         "lease; not starting it")
                return
            self.ran = True
            lease_s = time.time() - t0 - spark_s
            if spark is None:
                spark = self._spark()
                spark_s = time.time() - t0 - lease_s
            restored_now = False
            if self.restore is not None:
                restored_now = self.restore.apply(self.url, job=job, spark=spark).mode != "already_restored"
            self._restored_now, self._attempt = restored_now, self._process_attempt()
            started = time.time()
            self.events.append("start", job=job.name, restart_strategy=job.restart_strategy.describe(),
                               lease_epoch=self.lease.epoch, lease_s=round(lease_s, 3),
                               spark_s=round(spark_s, 3), takeover=self.takeover)
            attempt = 0
            while True:
                try:
                    self._run_query(spark, started)
                    self.events.append("stop", job=job.name, reason="stopped" if self.stop.is_set() else "finished")
                    return
                except Exception as e:  # a failed query or an outage: restart strategy decides
                    error = e if isinstance(e, OnceflowError) else onceflow_error_in(str(e))
                    self._log_failed_batch(e, error)
                    if not jvm_alive(spark):
                        self.events.append("failed", cause="the Spark JVM died")
                        raise JvmDied("the driver's Spark JVM died (OOM killer?); the process must "
                                      "restart (onceflow run does that)") from None
                    query_error = None
                    if not isinstance(error, (FencedError, LeaseLost)):
                        try:  # a failure of a driver that lost the lease: it must not restart
                            self.lease.check()
                        except (FencedError, LeaseLost) as lost:
                            query_error = str(error) if error is not None else _short_cause(str(e))
                            log.warning("the query failed (%s) after this driver lost the lease (%s)",
                                        query_error, lost)
                            error = lost
                    if isinstance(error, LeaseLost):  # only a new process may take the lease again
                        self.events.append("failed", cause=str(error), error="LeaseLost")
                        raise error from None
                    if error is not None and error.fatal:
                        extra = {"query_error": query_error} if query_error else {}
                        self.events.append("failed", cause=str(error), error=type(error).__name__, **extra)
                        raise error from None
                    cause = str(error) if error is not None else _short_cause(str(e))
                    delay = job.restart_strategy.on_failure(time.time())
                    attempt += 1
                    if delay is None:
                        self.events.append("gave_up", cause=cause, attempts=attempt)
                        raise GaveUp(
                            f"job {job.name} failed and the restart strategy "
                            f"{job.restart_strategy.describe()} gave up; last cause: {cause}"
                        ) from None
                    self._restored_now, self._attempt = False, self._attempt + 1
                    log.warning("%s; %s; retry %d in %.1f s", cause, self._waiting(), attempt, delay)
                    self.events.append("restart", cause=cause, delay_s=delay, attempt=attempt, scope="query")
                    if self.stop.wait(delay):
                        self.events.append("stop", job=job.name, reason="stopped")
                        return
                    started = time.time()

    def _log_failed_batch(self, e: Exception, error: OnceflowError | None) -> None:
        """A ``batch_failed`` event when the query failed with a batch in flight (planned in
        ``offsets/`` and not committed): what Flink counts as a failed checkpoint. Failures
        before the query ran (sink unreachable while opening...) are not batch failures."""
        if not self._query_started:
            return
        self._query_started = False
        try:
            planned, done = self.ckpt.offset_batches(), self.ckpt.last_committed()
        except (OSError, OnceflowError):
            return
        if planned and (done is None or planned[-1] > done):
            cause = str(error) if error is not None else _short_cause(str(e))
            self.events.append("batch_failed", batch=planned[-1], cause=cause[:300])

    def _waiting(self) -> str:
        """What a restart leaves waiting: the batch planned but not committed, if any."""
        try:
            planned, done = self.ckpt.offset_batches(), self.ckpt.last_committed()
        except (OSError, OnceflowError):
            return "the job waits"
        if planned and (done is None or planned[-1] > done):
            return f"batch {planned[-1]} waits (replayed or rolled forward after the restart)"
        return "no batch in flight"

    # ---- internals ---------------------------------------------------------------------

    def _process_attempt(self) -> int:
        """Driver restarts before this process: ``onceflow run`` logs each driver it starts."""
        pid = os.getpid()
        attempt = 0
        try:
            end = self.events.size()  # the supervisor's entry is recent: read the last MB only
            recent = self.events.read_from(max(0, end - 1_000_000)) if isinstance(end, int) else self.events.read()
            for e in recent:
                if e.get("event") == "process_start" and e.get("pid") == pid:
                    attempt = max(int(e.get("attempt", 1)) - 1, 0)
        except (OSError, ValueError):
            pass
        return attempt

    def context(self) -> RestoreContext:
        """How the query about to start was started (given to the job's source and transform)."""
        return checkpoint_context(self.ckpt, restored_now=self._restored_now, attempt=self._attempt)

    def _spark(self):
        return driver_spark(self.job, self.url)

    def _build(self, spark):
        register_all(spark)
        job = self.job
        for key, value in {**job.checkpoint.spark_conf(), **job.spark_conf, **cli_conf()}.items():
            if key.startswith("spark.sql."):  # session confs: apply to a given session too
                spark.conf.set(key, value)
        with _SOURCE_LOCK:  # the session conf is read by job.source(): one job at a time per process
            spark.conf.set("spark.onceflow.checkpointLocation", self.url)  # sources' event log (Kafka data loss)
            df = job.dataframe(spark, self.context())
        if not df.isStreaming:
            raise ConfigError(f"job {job.name}: the source must be a streaming DataFrame (spark.readStream...)")
        sink = job.sink.for_session(spark)
        sink.check_output_mode(job.output_mode)
        df = sink.prepare(df)
        sink_opts = dict(sink.options())
        if is_connect(spark):  # the query runs on the server and would outlive this driver
            sink_opts["driver_lease"] = f"{self.lease.epoch}:{self.lease.ttl_s:g}"
        if job.checkpoint.min_pause_s:
            sink_opts["min_pause"] = str(job.checkpoint.min_pause_s)
        source = sink.data_source({**sink_opts, "checkpointlocation": self.url})
        source.write_schema = df.schema
        source.validate(df.schema, job.output_mode == "complete")
        writer = (
            sink.stream_writer(df, source, sink_opts, job.output_mode == "complete")
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
        t0 = time.time()
        writer, source = self._build(spark)
        lineage = ensure_lineage(self.ckpt)
        t1 = time.time()
        epoch = source.open(lineage)  # new fencing epoch + recovery; SinkError while unreachable
        extra = source.task_options(lineage)
        t2 = time.time()
        self.events.append("sink_open", sink=job_sink_name(source), lineage=lineage, epoch=epoch,
                           open_s=round(t2 - t1, 3))
        while True:
            with query_conf(spark, self.url):
                query = writer.option("epoch", str(epoch)).options(**extra).start()
            self._query_started = True
            self._phases = {"build_s": round(t1 - t0, 3), "sink_open_s": round(t2 - t1, 3),
                            "query_start_s": round(time.time() - t2, 3)}
            try:
                stepped = self._monitor(query, started, _wall_clock(spark))
            finally:
                _stop_quietly(query)
            if stepped is None:
                return
            # Spark's processing-time trigger waits for a wall-clock instant: after the clock
            # stepped back it would wait that long. A new query plans from the clock as it is now.
            log.warning("the host's wall clock stepped back %.0f s; restarting the query between batches "
                        "so that its trigger does not wait that long", stepped)
            self.events.append("clock_step", back_s=round(stepped, 1), epoch=epoch)
            t2 = time.time()

    def _monitor(self, query, started: float, wall_clock: Callable[[], float] | None = None) -> float | None:
        """Watch the query until it ends or must stop (None), or until ``wall_clock`` (the
        clock its trigger waits on) stepped back by more than :data:`CLOCK_STEP_S` while its
        processing-time trigger waits: returns the step (seconds) for the caller to restart
        the query."""
        job, cfg = self.job, self.job.checkpoint
        wall_clock = wall_clock or time.time
        wall = _clock_offset(wall_clock) or 0.0  # the wall clock's offset from the monotonic one
        stepped = 0.0
        seen = -1
        recovered = False
        active_since: float | None = None
        idle_since: float | None = None
        stop_after: int | None = None  # batch id in flight when a stop was requested
        stop_at: float | None = None  # when the query stops (tests: ONCEFLOW_STOP_LATE_S later)
        lease = getattr(self, "lease", None)
        polled = time.monotonic()
        while True:
            if lease is not None and lease.lost.is_set():
                query.stop()
                lost = lease.lost_error()
                raise type(lost)(f"job {job.name}: {lost}; this driver stopped its query")
            if query.awaitTermination(0.25):
                self._record_progress(query, seen)
                exc = query.exception()
                if exc is not None:
                    raise RuntimeError(str(exc))
                self._still_holder()
                return None
            if time.monotonic() - polled > 2.0:  # this process was paused (GC, SIGSTOP, VM freeze):
                idle_since = None  # time without data is only counted while we watch
            polled = time.monotonic()
            seen, new = self._record_progress(query, seen)
            if new and not recovered:
                recovered = True
                self.events.append("recovered", recovery_s=round(time.time() - started, 3), batch=seen,
                                   phases={**getattr(self, "_phases", {}), **_first_batch_phases(query, seen)})
            status = query.status
            now = time.monotonic()  # idle and batch timers: a wall clock may jump by minutes
            active = bool(status.get("isTriggerActive"))
            offset = _clock_offset(wall_clock)
            if offset is not None:
                stepped, wall = max(0.0, stepped + wall - offset), offset  # back: +, forward: -
            if stepped > CLOCK_STEP_S and cfg.interval_s > 0 and not active and not self.stop.is_set():
                return stepped  # the trigger now waits for a wall-clock instant `stepped` s away
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
                # Let the in-flight batch finish (unless cancelled); stop before the next one gets far.
                if stop_after is None:
                    stop_after = seen
                    if active and self._cancelled():
                        log.info("cancelled: stopping the query now; its in-flight batch is replayed by "
                                 "the next run")
                        query.stop()
                        return None
                if not active or seen > stop_after:
                    stop_at = stop_at or now + float(setting("ONCEFLOW_STOP_LATE_S", "0"))
                    if now >= stop_at:
                        query.stop()
                        return None
            if (job.stop_when_idle is not None and idle_since and not active
                    and now - idle_since >= job.stop_when_idle):
                query.stop()
                self._still_holder()
                return None

    def _saw_stop_request(self) -> None:
        """Stopped with a stop request pending (its driver acts on it once the lease is free):
        say so while this driver still holds the lease, so that ``onceflow stop`` on another
        host waits for the savepoint rather than taking one into the same target itself."""
        if not (self.stop.is_set() and self.ran):
            return
        try:
            rid = stop_request_id(self.url)
            if rid is not None:
                self.events.append("stop_request_seen", request=rid)
        except Exception as e:  # noqa: BLE001 - the checkpoint store erred: 'onceflow stop' times out
            log.warning("could not read the stop request of %s (%s)", self.url, short(e))

    def _cancelled(self) -> bool:
        """Whether the stop is ``onceflow cancel``'s (an unreadable request: a graceful stop)."""
        try:
            return cancel_requested(self.url)
        except Exception as e:  # noqa: BLE001 - the checkpoint store erred: stop gracefully
            log.warning("could not read the stop request of %s (%s); stopping after the batch", self.url, short(e))
            return False

    def _still_holder(self) -> None:
        """FencedError if a newer driver took the lease: a driver that wakes from a pause to
        find its query ended must not report the job finished (exit 0) for its successor."""
        lease = getattr(self, "lease", None)
        if lease is not None:
            lease.check()

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
                **self._state_and_lag(p),
            )
        return seen, new

    def _state_and_lag(self, p) -> dict:
        """The batch event's ``newest_event_ts`` (the newest event time it read, where the job
        observes one), ``lag`` (records per topic and partition, where the source reports
        its latest offsets), ``lag_ms`` (per stream and shard: Kinesis) and ``state`` per
        operator: keys, in-memory estimate and bytes on the checkpoint (``state_bytes``: all
        operators; measured at most every N seconds, for the batch named in ``state_batch``)."""
        out: dict = {}
        lag, lag_ms, newest = metrics.source_lag(p), metrics.source_lag_ms(p), metrics.newest_event_ts(p)
        if newest is not None:
            out["newest_event_ts"] = newest
        if lag:
            out["lag"] = lag
        if lag_ms:
            out["lag_ms"] = lag_ms
        ops = metrics.state_operators(p)
        if ops:
            measured, on_ckpt = self._state_size.after(p.batchId)
            for op in ops:
                op["checkpoint_bytes"] = on_ckpt.get(op["id"])
            out.update(state=ops, state_bytes=sum(on_ckpt.values()), state_batch=measured)
        return out


def _first_batch_phases(query, batch: int) -> dict[str, float]:
    """Where the first batch after a (re)start spent its time, from Spark's progress report:
    planning (offsets, source batch, query plan, offset log write) and execution + commit.
    An idle report ("no data", no ``addBatch``) carries the id of the batch not run yet: skipped,
    as in :meth:`JobRunner._record_progress`."""
    for p in query.recentProgress:
        if p.batchId == batch and "addBatch" in (p.durationMs or {}):
            d = p.durationMs
            plan = sum(d.get(k, 0) for k in ("latestOffset", "getBatch", "queryPlanning", "walCommit"))
            return {"plan_s": round(plan / 1000, 3), "execute_and_commit_s": round(d.get("addBatch", 0) / 1000, 3),
                    "batch_s": round(d.get("triggerExecution", 0) / 1000, 3)}
    return {}


def job_sink_name(source) -> str:
    return f"{source.format_name}:{source.opts.get('sink_id', '')}".rstrip(":")


def _wall_clock(spark) -> Callable[[], float]:
    """The wall clock the query's trigger waits on: the driver JVM's (``System.currentTimeMillis``;
    a process may see a clock step later than this one), else (Spark Connect) this process's."""
    if is_connect(spark):
        return time.time
    system = spark._jvm.java.lang.System

    def jvm_time() -> float:
        try:
            return system.currentTimeMillis() / 1000.0
        except Exception:  # noqa: BLE001 - the JVM is going away: the monitor finds out itself
            return time.time()

    return jvm_time


def _clock_offset(wall_clock: Callable[[], float]) -> float | None:
    """``wall_clock()`` minus this process's monotonic clock, or None when reading it took
    over a second (a JVM paused for GC would look like a clock step)."""
    before = time.monotonic()
    wall = wall_clock()
    after = time.monotonic()
    return None if after - before > 1.0 else wall - (before + after) / 2


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
