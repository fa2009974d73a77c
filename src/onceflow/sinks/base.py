"""Two-phase commit per micro-batch (docs/protocol.md), on PySpark's Arrow stream writer.

Vocabulary follows Flink's ``TwoPhaseCommitSinkFunction``:

* **pre-commit** (task, executor): write the partition's rows durably but invisibly and
  return a handle; if the batch is already decided for this lineage, write nothing.
* **decide** (driver): record in the sink system that batch N of this lineage commits with
  exactly these handles and this fingerprint (hash of ``offsets/N``).
* **commit** (driver): make decided handles visible; idempotent; retried with back-off.
* **abort** (driver): roll back pre-committed handles that are not part of a decision.
* **recover** (driver, on open): roll forward decided batches, roll back the rest.

**Fencing.** Every driver incarnation holds an *epoch* for (sink, lineage), a number kept in
the sink system and raised atomically by :meth:`TwoPhaseCommitSink.acquire_epoch` when the sink
opens (:meth:`TwoPhaseCommitSink.open`). ``decide`` verifies, in the same atomic write that
records the decision (one Delta log commit, one PostgreSQL transaction, one Kafka
transaction), that the stored epoch is still the caller's; a call from an older epoch changes
nothing and raises :class:`~onceflow.errors.FencedError`. So a driver that was paused (GC,
SIGSTOP, VM freeze, partition) and wakes up after a successor opened the sink can never make
anything visible. Recovery and clean-up only remove what an older or the same epoch wrote.
The runner passes the epoch to tasks and the commit runner as the ``epoch`` option; a plain
``writeStream`` without it gets an epoch per commit process (fencing then covers commit
processes, not whole drivers: use :class:`~onceflow.Job` for that).

A sink implementation subclasses :class:`TwoPhaseCommitSink` (the Spark data source) and fills
in those steps; the Spark plumbing, fingerprint check and crash points live here once.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import check_driver_lease
from onceflow.errors import CheckpointError, ConfigError, FencedError, FingerprintMismatch
from onceflow.faults import maybe_crash, maybe_slow
from onceflow.settings import setting

log = logging.getLogger(__name__)

# Options Spark itself passes to every sink; never reported as unknown.
SPARK_OPTIONS = frozenset({"checkpointlocation", "path", "queryname"})
# Options every onceflow sink understands.
COMMON_OPTIONS = {
    "lineage": "lineage (query id) to use instead of the checkpoint's; set by Job.run",
    "epoch": "fencing epoch of this driver for (sink, lineage), from open(); set by Job.run",
    "allow_unknown_fingerprint": "true: commit batches whose offsets/N cannot be read (unsafe for forks)",
    "min_pause": "seconds to wait after each batch's commit before the next batch",
    "driver_lease": "EPOCH:TTL_S of the driver's lease; commits stop once it lapses (set by Job.run "
                    "over Spark Connect, where a query outlives its driver)",
    "test_crash_at": "tests only: fault injection rule, see onceflow.faults",
    "test_crash_markers": "tests only: directory recording fired fault rules",
}


@dataclass
class PreCommitted(WriterCommitMessage):
    """What a task returns: its handle (None when it skipped an already-decided batch)."""

    lineage: str
    batch_id: int
    partition: int
    attempt: int
    rows: int
    handle: Any = None
    skipped: bool = False


@dataclass
class Decision:
    """A durable commit decision as stored in the sink system."""

    lineage: str
    batch_id: int
    fingerprint: str
    #: None when the sink knows the batch is decided but no longer knows its handles.
    handles: list[Any] | None = field(default_factory=list)
    #: the epoch of the driver that decided (None: recorded before epochs existed).
    epoch: int | None = None

    def same_as(self, other: Decision) -> bool:
        """True when ``other`` is this very decision (a retried decide), not a rival one."""
        return (self.fingerprint == other.fingerprint and self.epoch == other.epoch
                and _handle_keys(self.handles) == _handle_keys(other.handles))


def _handle_keys(handles: list[Any] | None) -> list[str] | None:

    return None if handles is None else sorted(json.dumps(h, sort_keys=True) for h in handles if h)


def fenced(sink: str, lineage: str, mine: int | None, current: int | None, what: str) -> FencedError:
    """The FencedError a call of an older epoch raises (nothing was changed)."""
    return FencedError(
        f"{sink}: {what} refused: this driver holds epoch {mine} of lineage {lineage}, but "
        f"epoch {current} has opened the sink since (a newer driver took over while this one was "
        "paused or cut off); nothing was changed. This driver stops; the newer one continues"
    )


@dataclass
class TaskInfo:
    """Where a task runs: lineage, batch, partition and attempt (from Spark's TaskContext)."""

    lineage: str
    batch_id: int
    partition: int
    attempt: int

    @classmethod
    def current(cls) -> TaskInfo:
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is None:
            raise RuntimeError("onceflow sink write() called outside a Spark task")
        batch = tc.getLocalProperty("streaming.sql.batchId")
        lineage = tc.getLocalProperty("sql.streaming.queryId")
        if batch is None or lineage is None:
            raise ConfigError("onceflow sinks only support streaming writes (writeStream)")
        return cls(lineage, int(batch), tc.partitionId(), tc.attemptNumber())


class TwoPhaseCommitSink(DataSource, ABC):
    """Base of every transactional onceflow sink (a PySpark Python data source).

    Guarantee: with a replayable source and a deterministic transform, every batch's rows
    become visible exactly once per lineage, whatever crashes happen between the steps.
    """

    format_name: ClassVar[str]
    #: option name -> description (besides COMMON_OPTIONS); unknown options are refused.
    options_doc: ClassVar[dict[str, str]] = {}
    #: option names that must be given.
    required_options: ClassVar[tuple[str, ...]] = ()
    #: set True where decide and commit are one atomic step in the sink system.
    atomic_decide_commit: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, str]):
        super().__init__(options)
        self.opts = {k.lower(): v for k, v in options.items()}
        #: the stream's schema once known (validate / streamWriter); a sink that creates its
        #: target when it opens (Delta) needs it there.
        self.write_schema: StructType | None = None
        known = set(self.options_doc) | set(COMMON_OPTIONS) | SPARK_OPTIONS
        unknown = sorted(set(self.opts) - known)
        if unknown:
            raise ConfigError(
                f"{self.format_name}: unknown option(s) {', '.join(unknown)}; "
                f"known options: {', '.join(sorted(set(self.options_doc) | set(COMMON_OPTIONS)))}"
            )
        missing = [o for o in self.required_options if not self.opts.get(o)]
        if missing:
            raise ConfigError(f"{self.format_name}: missing required option(s) {', '.join(missing)}")

    @classmethod
    def name(cls) -> str:
        return cls.format_name

    _validated: ClassVar[set[str]] = set()

    def streamWriter(self, schema: StructType, overwrite: bool) -> TwoPhaseCommitWriter:
        """Called by Spark on the driver at query start and per commit; validates once per process."""
        self.write_schema = schema
        key = repr((self.format_name, sorted(self.opts.items()), schema.json(), overwrite))
        if key not in self._validated:
            self.validate(schema, overwrite)
            self._validated.add(key)
        return TwoPhaseCommitWriter(self, schema, overwrite)

    # ---- what implementations fill in -------------------------------------------------

    def validate(self, schema: StructType, overwrite: bool) -> None:  # noqa: B027
        """Driver, before the query starts: check options, reachability and schema.

        Wrong configuration raises ConfigError; an unreachable system raises SinkError."""

    @abstractmethod
    def is_decided(self, lineage: str, batch_id: int) -> bool:
        """Task: is batch N of this lineage already decided (so nothing must be written)?"""

    @abstractmethod
    def pre_commit(
        self, task: TaskInfo, schema: StructType, overwrite: bool, batches: Iterator
    ) -> tuple[Any, int]:
        """Task: write the rows durably but invisibly; return (handle, row count)."""

    @abstractmethod
    def decision(self, lineage: str, batch_id: int) -> Decision | None:
        """Driver: the stored decision for batch N of this lineage, if any."""

    @abstractmethod
    def decide(self, decision: Decision, schema: StructType, overwrite: bool) -> None:
        """Driver: record the decision durably in the sink system.

        Atomically with that write: the stored epoch must equal ``decision.epoch`` (else
        FencedError, nothing written) and the batch must be undecided, or decided with this
        very decision (:meth:`Decision.same_as`: a retry); a rival decision raises FencedError.
        """

    @abstractmethod
    def commit(self, decision: Decision) -> None:
        """Driver: make every decided handle visible. Idempotent."""

    @abstractmethod
    def abort(self, lineage: str, batch_id: int, handles: list[Any]) -> None:
        """Driver: roll back these pre-committed handles (never decided ones)."""

    @abstractmethod
    def recover(self, lineage: str, in_flight: Sequence[Any] = ()) -> dict[str, int]:
        """Driver, on open: finish decided batches, roll back the rest; return counts.

        ``in_flight``: handles pre-committed for the batch being committed right now (when
        recovery runs lazily in a fresh commit process); they must be left alone.
        """

    def visible_partitions(self, lineage: str, batch_id: int) -> dict[int, int | None]:
        """Partitions of batch N of ``lineage`` whose rows are visible although the batch is
        undecided -> their row counts (None: unknown). Only sinks whose tasks make rows visible
        on their own (Kafka, PostgreSQL ``idempotent`` append) have any; the default, for sinks
        where nothing is visible before the driver's commit, is none. Restore and fork call it
        to tell a partly visible batch (:mod:`onceflow.savepoint.restore`): it only reads, and
        fences or locks nothing (a live job of the lineage may be running beside it). For a
        decided batch the answer may be empty."""
        return {}

    @property
    def epoch(self) -> int | None:
        """This driver's fencing epoch (the ``epoch`` option), None before :meth:`open`."""
        value = self.opts.get("epoch")
        return int(value) if value not in (None, "") else None

    @abstractmethod
    def acquire_epoch(self, lineage: str) -> int:
        """Driver, when the sink opens: atomically raise the (sink, lineage) epoch stored in
        the sink system and return it (strictly greater than any earlier one). From then on
        every decide of an older epoch fails with FencedError."""

    def open(self, lineage: str) -> int:
        """Driver, before the query starts: take a new epoch, then recover under it.

        Returns the epoch; the runner passes it to the query as the ``epoch`` option. An
        unreachable sink raises SinkError (the restart strategy waits it out).
        """
        lineage = self.opts.get("lineage") or lineage  # the lineage the writer writes under
        epoch = self.acquire_epoch(lineage)
        self.opts["epoch"] = str(epoch)
        counts = self.recover(lineage)
        if any(counts.values()):
            log.warning("onceflow %s recovery for %s (epoch %d): %s", self.format_name, lineage, epoch, counts)
        return epoch

    def task_options(self, lineage: str) -> dict[str, str]:
        """Driver, after :meth:`open`: options for the query's tasks besides the sink's own,
        such as state they would otherwise read from the sink system first. Advisory only:
        every decision is checked by the driver as before. None by default."""
        return {}

    def describe_guarantee(self) -> str:
        """One line stating the guarantee of the configured mode (for ``onceflow doctor``)."""
        return "exactly-once: batch visible atomically after a durable decision"


class TwoPhaseCommitWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer, translating its callbacks into the 2PC protocol."""

    _recovered: ClassVar[set[tuple[str, str]]] = set()
    #: epochs taken by commit processes of plain writeStream queries (no ``epoch`` option).
    _epochs: ClassVar[dict[str, int]] = {}

    def __init__(self, sink: TwoPhaseCommitSink, schema: StructType, overwrite: bool):
        self.sink, self.schema, self.overwrite = sink, schema, overwrite

    # ---- executors --------------------------------------------------------------------

    def write(self, iterator: Iterator) -> PreCommitted:
        task = TaskInfo.current()
        lineage = self.sink.opts.get("lineage") or task.lineage
        task.lineage = lineage
        maybe_crash("before_precommit", task.batch_id, task.partition, self.sink.opts)
        if self.sink.is_decided(lineage, task.batch_id):
            # Drain anyway: upstream stateful operators commit their state version only when
            # the partition is fully consumed; the rows are processed but not written again.
            rows = sum(b.num_rows for b in iterator)
            self._task_event(task, rows, skipped=True)
            return PreCommitted(lineage, task.batch_id, task.partition, task.attempt, 0, None, True)
        handle, rows = self.sink.pre_commit(task, self.schema, self.overwrite, iterator)
        self._task_event(task, rows, skipped=False)
        maybe_crash("after_precommit", task.batch_id, task.partition, self.sink.opts)
        return PreCommitted(lineage, task.batch_id, task.partition, task.attempt, rows, handle)

    def _task_event(self, task: TaskInfo, rows: int, skipped: bool) -> None:
        """With ONCEFLOW_TASK_EVENTS=1, tasks log rows processed (replays included)."""
        loc = self.sink.opts.get("checkpointlocation")
        if loc and setting("ONCEFLOW_TASK_EVENTS") == "1":
            EventLog(loc).append("task", batch=task.batch_id, partition=task.partition,
                                 attempt=task.attempt, rows=rows, skipped=skipped)

    # ---- driver -----------------------------------------------------------------------

    def _checkpoint(self) -> CheckpointDir | None:
        loc = self.sink.opts.get("checkpointlocation")
        return CheckpointDir(loc) if loc else None

    def _lineage(self, ckpt: CheckpointDir | None, messages: list) -> str:
        if self.sink.opts.get("lineage"):
            return self.sink.opts["lineage"]
        for m in messages:
            if m is not None:
                return m.lineage
        if ckpt is None:
            raise ConfigError(f"{self.sink.format_name}: a checkpointLocation is required")
        return ckpt.lineage

    def _open_once(self, lineage: str, in_flight: list) -> int:
        """The epoch: the ``epoch`` option (the runner opened the sink and recovered), else one
        taken by this commit process on its first commit, followed by recovery."""
        if self.sink.epoch is not None:
            return self.sink.epoch
        key = repr((self.sink.format_name, lineage, sorted(
            (k, v) for k, v in self.sink.opts.items() if k not in ("checkpointlocation", "epoch"))))
        if key not in self._epochs:
            self._epochs[key] = self.sink.acquire_epoch(lineage)
        self.sink.opts["epoch"] = str(self._epochs[key])
        if key not in self._recovered:
            counts = self.sink.recover(lineage, in_flight)
            if any(counts.values()):
                log.warning("onceflow %s recovery for %s: %s", self.sink.format_name, lineage, counts)
            self._recovered.add(key)
        return self._epochs[key]

    def _fingerprint(self, ckpt: CheckpointDir | None, batch_id: int) -> str:
        """Hash of ``offsets/N``; refusing to go on without it unless the user opted out."""
        allow = self.sink.opts.get("allow_unknown_fingerprint", "").lower() in ("true", "1", "yes")
        if ckpt is not None:
            try:
                return ckpt.offsets(batch_id).fingerprint
            except CheckpointError as e:
                if not allow:
                    raise ConfigError(
                        f"{self.sink.format_name}: cannot fingerprint batch {batch_id}: {e}; the sink "
                        "must read offsets/N to tell a replay from a different batch under the same "
                        "id. Give the driver read access to the checkpoint, or set "
                        "allow_unknown_fingerprint=true to accept that risk"
                    ) from None
        elif not allow:
            raise ConfigError(
                f"{self.sink.format_name}: no checkpointLocation option: the sink cannot fingerprint "
                "batches (hash of offsets/N), so a restored or edited checkpoint could silently skip "
                "data. Set .option('checkpointLocation', ...) on writeStream, or "
                "allow_unknown_fingerprint=true to accept that risk"
            )
        return "unknown"

    def commit(self, messages: list, batchId: int) -> None:
        started = time.monotonic()
        ckpt = self._checkpoint()
        if self.sink.opts.get("driver_lease") and ckpt is not None:
            epoch, _, ttl = self.sink.opts["driver_lease"].partition(":")
            check_driver_lease(ckpt.url, int(epoch), float(ttl))
        lineage = self._lineage(ckpt, messages)
        fingerprint = self._fingerprint(ckpt, batchId)
        present = [m for m in messages if m is not None]
        handles = [m.handle for m in present if not m.skipped and m.handle is not None]
        epoch = self._open_once(lineage, handles)
        rows = sum(m.rows for m in present if not m.skipped)

        existing = self.sink.decision(lineage, batchId)
        if existing is None:
            maybe_crash("after_decision_lookup", batchId, None, self.sink.opts)
        if existing is not None:
            if existing.fingerprint != fingerprint and "unknown" not in (existing.fingerprint, fingerprint):
                self.sink.abort(lineage, batchId, handles)
                raise FingerprintMismatch(
                    f"{self.sink.format_name}: batch {batchId} of lineage {lineage} was already "
                    f"committed from different source offsets (stored fingerprint "
                    f"{existing.fingerprint}, this run {fingerprint}). The checkpoint was restored "
                    "from an older savepoint or edited while keeping the lineage: restart with "
                    "'onceflow run --from-savepoint SP --fork' to get a new lineage."
                )
            if existing.epoch is not None and epoch is not None and existing.epoch > epoch:
                # A newer driver decided this batch: this one is a zombie on the replay path. It
                # must not report the batch done (Spark would write commits/N and sources clean
                # up what the successor still reads).
                raise fenced(self.sink.format_name, lineage, epoch, existing.epoch,
                             f"finish batch {batchId}, which a newer driver decided")
            # Replay of a decided batch: finish it (idempotent), drop stray attempts.
            self.sink.commit(existing)
            stray = [h for h in handles if existing.handles is None or h not in existing.handles]
            if stray:
                self.sink.abort(lineage, batchId, stray)
            self._log(ckpt, batchId, lineage, 0, True, started)
            return

        decision = Decision(lineage, batchId, fingerprint, handles, epoch)
        maybe_crash("before_decide", batchId, None, self.sink.opts)
        maybe_slow()
        self.sink.decide(decision, self.schema, self.overwrite)
        maybe_crash("after_decide", batchId, None, self.sink.opts)
        self.sink.commit(decision)
        maybe_crash("after_commit", batchId, None, self.sink.opts)
        self._log(ckpt, batchId, lineage, rows, False, started)
        pause = float(self.sink.opts.get("min_pause") or 0)
        if pause > 0:
            time.sleep(pause)

    def abort(self, messages: list, batchId: int) -> None:
        ckpt = self._checkpoint()
        lineage = self._lineage(ckpt, messages)
        handles = [m.handle for m in messages if m is not None and m.handle is not None]
        if self.sink.decision(lineage, batchId) is None:
            self.sink.abort(lineage, batchId, handles)

    def _log(self, ckpt, batch_id, lineage, rows, replay, started) -> None:
        if ckpt is None or setting("ONCEFLOW_NO_EVENTS"):
            return
        try:
            EventLog(ckpt.url).append(
                "sink_commit", sink=self.sink.format_name, batch=batch_id, lineage=lineage,
                rows=rows, replay=replay, commit_s=round(time.monotonic() - started, 4),
                driver=int(setting("ONCEFLOW_DRIVER_PGID") or 0) or None,
            )
        except OSError as e:  # the event log is for humans; never fail a commit over it
            log.warning("could not append to the event log: %s", e)


class Sink(ABC):
    """User-facing sink configuration: a format name and its options for ``writeStream``."""

    format_name: ClassVar[str]

    @abstractmethod
    def options(self) -> dict[str, str]:
        """Spark options for ``df.writeStream.format(format_name).options(**options())``."""

    def for_session(self, spark: Any) -> Sink:
        """This sink as it runs in ``spark`` (the runner calls it first; a sink whose default
        depends on the session decides it here)."""
        return self

    def check_output_mode(self, output_mode: str) -> None:
        """Refuse, in one line, an output mode this sink's write path cannot take (the runner
        and :meth:`write_stream` call it on the sink as it runs in the session). Spark's Python
        data sources, through which onceflow's sinks write, take ``append`` and ``complete``."""
        if output_mode == "update":
            raise ConfigError(
                f"{type(self).__name__} writes through the Python data source {self.format_name}, and "
                "Spark's Python data sources take the output modes 'append' and 'complete', not "
                f"'update'{self._update_hint()}")

    def _update_hint(self) -> str:
        return ("; use 'complete' (the whole result each batch), or 'append' with write='upsert' "
                "and keys where the sink offers it (an aggregation in append mode needs a watermark)")

    def prepare(self, df: Any) -> Any:
        """The stream as this sink writes it (the runner calls it before checking the schema):
        ``df`` itself unless the sink derives a column, such as an upsert's delete flag."""
        return df

    def stream_writer(self, df: Any, source: TwoPhaseCommitSink, options: Mapping[str, str],
                      overwrite: bool) -> Any:
        """The query's ``DataStreamWriter`` before the runner sets checkpoint location, output
        mode, trigger and name: the data source ``format_name`` with ``options``. ``source`` is
        the data source instance the runner opens (it holds the fencing epoch once opened)."""
        return df.writeStream.format(self.format_name).options(**options)

    def write_stream(self, df: Any, checkpoint_location: str, output_mode: str = "append") -> Any:
        """``df.writeStream`` into this sink for plain Spark code, set up as a Job sets it up:
        the sink as it runs in ``df``'s session (:meth:`for_session`: a ``DeltaSink`` on a local
        table gets Spark's own Parquet writer), the stream's schema checked, and the sink opened
        now for the checkpoint's lineage (a new fencing epoch, so an older query of this
        checkpoint can no longer decide, then recovery). Returns the ``DataStreamWriter`` with
        checkpoint location and output mode set, as a :class:`StreamWriter` whose ``start()``
        gives the query a Job's Spark settings; add a trigger and ``start()`` it. Open it again
        (call this again) for every start of the query."""
        sink = self.for_session(df.sparkSession)
        sink.check_output_mode(output_mode)
        df = sink.prepare(df)
        opts = dict(sink.options())
        overwrite = output_mode == "complete"
        source = sink.data_source({**opts, "checkpointlocation": checkpoint_location})
        source.write_schema = df.schema
        source.validate(df.schema, overwrite)
        lineage = CheckpointDir(checkpoint_location).ensure_lineage()
        epoch = source.open(lineage)
        writer = (sink.stream_writer(df, source, opts, overwrite).option("checkpointLocation", checkpoint_location)
                  .option("epoch", str(epoch)).options(**source.task_options(lineage)).outputMode(output_mode))
        return StreamWriter(writer, df.sparkSession, checkpoint_location)

    def data_source(self, extra: Mapping[str, str] | None = None) -> TwoPhaseCommitSink:
        """The data source instance with these options (used for pre-flight checks)."""
        from onceflow.sinks.registry import SINKS, _load

        cls = _load(SINKS[self.format_name])
        return cls({**self.options(), **(extra or {})})


class StreamWriter:
    """A ``DataStreamWriter`` as :meth:`Sink.write_stream` returns it: every method is Spark's
    (those that return the writer return this wrapper), and ``start()`` runs inside
    :func:`onceflow.spark.query_conf`, so the query starts with the settings a Job's query gets
    (Arrow batches of 100,000 rows for Python writers; on a local checkpoint, Spark's
    FileSystem-based checkpoint file manager) while the session keeps its own."""

    def __init__(self, writer: Any, spark: Any, checkpoint_location: str) -> None:
        self._writer, self._spark, self._checkpoint = writer, spark, checkpoint_location

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._writer, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            return self if out is self._writer else out
        return call

    def start(self, *args: Any, **kwargs: Any) -> Any:
        """Spark's ``start()``, with a Job's query settings (see the class doc)."""
        from onceflow.spark import query_conf

        with query_conf(self._spark, self._checkpoint):
            return self._writer.start(*args, **kwargs)
