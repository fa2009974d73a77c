"""The in-memory figures of one job, updated event by event (never by reading at scrape time)."""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

#: batch durations (s): a micro-batch is typically 0.1 s .. minutes
BATCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: sink commit durations (s): the decision record plus the commit itself
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: errors in a ``failed`` event that mean this driver lost its lease to another one
LEASE_ERRORS = ("LeaseLost", "FencedError")


@dataclass
class Histogram:
    """Cumulative Prometheus histogram state: per-bucket counts (non-cumulative), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``, as Prometheus expects."""
        out, acc = [], 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            acc += c
            out.append((bound, float(acc)))
        return out


@dataclass
class Operator:
    """One stateful operator's state after the last batch that reported it."""

    name: str = ""
    rows: int | None = None
    memory_bytes: int | None = None
    checkpoint_bytes: int | None = None


class JobMetrics:
    """Counters, gauges and histograms of one job, fed with event-log records as they happen.

    :meth:`apply` takes the same dicts :class:`~onceflow.checkpoint.eventlog.EventLog` appends:
    the driver's own events directly, other processes' (the sink's commit process, the
    supervisor, earlier drivers) from a follower (:mod:`onceflow.runtime.metrics.follow`).
    """

    def __init__(self, job: str, started: float | None = None):
        self.job = job
        self.started = started or time.time()
        self.lock = threading.Lock()
        self.batches = self.batches_failed = 0
        self.restarts: dict[str, int] = {"query": 0, "process": 0}
        self.lease_lost = 0
        self.records_in = self.records_out = 0
        self.replay_batches = self.replay_records = 0
        self.last_batch: int | None = None
        self.last_duration_ms = 0
        self.last_commit_ts: float | None = None
        self.newest_event_ts: float | None = None  # the newest event time a committed batch read
        self.batch_seconds = Histogram(BATCH_BUCKETS)
        self.commit_seconds = Histogram(COMMIT_BUCKETS)
        self.lag: dict[tuple[str, str], int] = {}  # (topic or stream, partition or shard) -> records
        self.lag_ms: dict[tuple[str, str], int] = {}  # (stream, shard) -> ms behind the tip
        self.operators: dict[int, Operator] = {}
        self.state_bytes: int | None = None  # all operators, bytes on the checkpoint
        self._batch_rows: dict[int, int] = {}  # recent batches' input rows, for skipped replays
        #: events applied as they were appended, not yet met again in the log (read by the follower)
        self._applied: set[tuple] = set()
        self.appending = threading.Lock()  # held from an append until its event is applied

    @staticmethod
    def _key(e: dict) -> tuple:
        return (e.get("ts"), e.get("event"), e.get("pid"), e.get("batch"))

    def applied_on_append(self, e: dict) -> None:
        """Account an event this process just appended; :meth:`apply_logged` will skip it."""
        if len(self._applied) > 10_000:  # appends that never reached the log (a full disk...)
            self._applied.clear()
        self._applied.add(self._key(e))
        self.apply(e)

    def apply_logged(self, e: dict) -> None:
        """Account an event read from the log, unless it was applied when appended."""
        with self.appending:
            key = self._key(e)
            if key in self._applied:
                self._applied.discard(key)
                return
        self.apply(e)

    def apply(self, e: dict) -> None:
        """Account one event (unknown kinds are ignored)."""
        kind = e.get("event")
        with self.lock:
            if kind == "batch":
                self._batch(e)
            elif kind == "batch_failed":
                self.batches_failed += 1
            elif kind == "restart":
                scope = "process" if e.get("scope") == "process" else "query"
                self.restarts[scope] += 1
            elif kind == "failed" and e.get("error") in LEASE_ERRORS:
                self.lease_lost += 1
            elif kind == "sink_commit":
                self._commit(e)

    def _batch(self, e: dict) -> None:
        self.batches += 1
        rows = int(e.get("input_rows") or 0)
        self.records_in += rows
        self.last_duration_ms = int(e.get("duration_ms") or 0)
        self.batch_seconds.observe(self.last_duration_ms / 1000)
        self._committed_at(float(e.get("ts") or time.time()))
        if e.get("batch") is not None:
            batch = int(e["batch"])
            self.last_batch = max(batch, self.last_batch if self.last_batch is not None else -1)
            self._batch_rows[batch] = rows
            if len(self._batch_rows) > 1000:
                self._batch_rows.pop(min(self._batch_rows))
        if e.get("newest_event_ts") is not None:
            self.newest_event_ts = max(float(e["newest_event_ts"]), self.newest_event_ts or float("-inf"))
        if isinstance(e.get("lag"), dict):
            self.lag = {(str(t), str(p)): int(n) for t, parts in e["lag"].items()
                        for p, n in (parts or {}).items()}
        if isinstance(e.get("lag_ms"), dict):
            self.lag_ms = {(str(t), str(p)): int(n) for t, parts in e["lag_ms"].items()
                           for p, n in (parts or {}).items()}
        for op in e.get("state") or []:
            o = self.operators.setdefault(int(op.get("id", 0)), Operator())
            o.name = op.get("name") or o.name
            o.rows, o.memory_bytes = op.get("rows"), op.get("memory_bytes")
            if op.get("checkpoint_bytes") is not None:
                o.checkpoint_bytes = int(op["checkpoint_bytes"])
        if e.get("state_bytes") is not None and e.get("state"):
            self.state_bytes = int(e["state_bytes"])

    def _commit(self, e: dict) -> None:
        if e.get("commit_s") is not None:
            self.commit_seconds.observe(float(e["commit_s"]))
        self._committed_at(float(e.get("ts") or time.time()))
        if e.get("replay"):
            self.replay_batches += 1
            self.replay_records += self._batch_rows.get(int(e.get("batch", -1)), 0)
        else:
            self.records_out += int(e.get("rows") or 0)

    def _committed_at(self, ts: float) -> None:
        self.last_commit_ts = max(ts, self.last_commit_ts or 0.0)

    def commit_age_s(self, now: float | None = None) -> float | None:
        """Seconds since the last committed batch (None: none seen yet)."""
        if self.last_commit_ts is None:
            return None
        return max(0.0, (now or time.time()) - self.last_commit_ts)

    def event_age_s(self, now: float | None = None) -> float | None:
        """Seconds from the newest committed event's time to now (None: none observed yet)."""
        if self.newest_event_ts is None:
            return None
        return (now or time.time()) - self.newest_event_ts
