"""Figures the driver derives per batch: source lag, the newest event's time and state per
operator from Spark's progress report, and the state's true size on the checkpoint (cached:
listed at most every N seconds)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError
from onceflow.settings import setting
from onceflow.sources import LAG_MS_KEY
from onceflow.storage import is_local

log = logging.getLogger("onceflow.metrics")

#: seconds between two listings of the checkpoint's state files (0: after every batch)
STATE_SIZE_ENV = "ONCEFLOW_STATE_SIZE_EVERY_S"
STATE_SIZE_EVERY_S = 30.0


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _offsets(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


#: name of the observation (Spark's ``DataFrame.observe``) of the newest event time of a batch
EVENT_TIME_METRIC = "onceflow_event_time"


def observe_event_time(df: Any, column: str | None) -> Any:
    """``df`` observed for the newest value of its event-time ``column`` in each batch (Spark's
    ``observe``: a running max in the tasks, reported with the batch's progress, no extra job).

    ``"auto"``: the first timestamp column (Kafka's ``timestamp``, Kinesis's
    ``approximateArrivalTimestamp``), none when there is none; ``None``: not observed.
    Raises :class:`ConfigError` for a named column that is missing or not a timestamp."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampType

    if column is None:
        return df
    fields = {f.name: f for f in df.schema.fields}
    if column == "auto":
        column = next((f.name for f in df.schema.fields if isinstance(f.dataType, TimestampType)), None)
        if column is None:
            return df
    elif column not in fields:
        raise ConfigError(f"Job.event_time={column!r}: the source has no such column (it has "
                          f"{', '.join(fields) or 'none'}); name a timestamp column, or None")
    elif not isinstance(fields[column].dataType, TimestampType):
        raise ConfigError(f"Job.event_time={column!r} is a {fields[column].dataType.simpleString()}, not a "
                          "timestamp; convert it in the source (to_timestamp) or set event_time=None")
    return df.observe(EVENT_TIME_METRIC, F.max(F.unix_micros(F.col(column))).alias("newest_us"))


def newest_event_ts(progress: Any) -> float | None:
    """The newest event time of the batch (epoch seconds; :func:`observe_event_time`), if any."""
    row = (_get(progress, "observedMetrics") or {}).get(EVENT_TIME_METRIC)
    value = _get(row, "newest_us") if row is not None else None
    return value / 1e6 if isinstance(value, int) else None


def source_lag(progress: Any) -> dict[str, dict[str, int]] | None:
    """Records behind per topic and partition: the source's latest offsets (Spark's
    ``reportLatestOffset``, asked when the batch was planned) minus where the batch ended, for
    sources whose offsets are ``{topic: {partition: offset}}`` (onceflow's and Spark's Kafka
    sources). None when no source reports them (Kinesis positions are sequence numbers)."""
    out: dict[str, dict[str, int]] = {}
    for s in _get(progress, "sources") or []:
        end, latest = _offsets(_get(s, "endOffset")), _offsets(_get(s, "latestOffset"))
        if not end or not latest:
            continue
        for topic, parts in latest.items():
            if not isinstance(parts, dict) or topic == LAG_MS_KEY:
                continue
            for p, hi in parts.items():
                lo = (end.get(topic) or {}).get(p) if isinstance(end.get(topic), dict) else None
                if isinstance(hi, int) and isinstance(lo, int) and hi >= 0 and lo >= 0:
                    out.setdefault(str(topic), {})[str(p)] = max(0, hi - lo)
    return out or None


def source_lag_ms(progress: Any) -> dict[str, dict[str, int]] | None:
    """Milliseconds behind per stream and shard, for sources that report it under
    :data:`~onceflow.sources.LAG_MS_KEY` in their latest offset (Kinesis: how far each shard's
    planned end is behind its tip). None when no source does."""
    out: dict[str, dict[str, int]] = {}
    for s in _get(progress, "sources") or []:
        lag = (_offsets(_get(s, "latestOffset")) or {}).get(LAG_MS_KEY)
        for stream, shards in (lag.items() if isinstance(lag, dict) else []):
            for shard, ms in (shards.items() if isinstance(shards, dict) else []):
                if isinstance(ms, int) and ms >= 0:
                    out.setdefault(str(stream), {})[str(shard)] = ms
    return out or None


def state_operators(progress: Any) -> list[dict]:
    """Per stateful operator (its id is its position, as in ``state/<id>``): name, keys
    (``numRowsTotal``) and the store's in-memory estimate (``memoryUsedBytes``: the loaded
    versions' maps, not the state's size)."""
    return [{"id": i, "name": _get(o, "operatorName") or "", "rows": int(_get(o, "numRowsTotal") or 0),
             "memory_bytes": int(_get(o, "memoryUsedBytes") or 0)}
            for i, o in enumerate(_get(progress, "stateOperators") or [])]


def checkpoint_state_bytes(ckpt: CheckpointDir, batch: int) -> dict[int, int]:
    """Bytes on the checkpoint per stateful operator for the state after ``batch`` (version
    ``batch + 1``): exactly the files Spark reads to load that version (the newest snapshot and
    the deltas or changelogs after it; for RocksDB the SST files its zip references), as a
    savepoint of that batch would copy them. Empty when the query has no state."""
    from onceflow.savepoint.create import select_files

    state_root = ckpt._p("state")
    try:
        found = ckpt.fs.find(state_root, detail=True)
    except FileNotFoundError:
        return {}
    if not found:
        return {}
    root = ckpt.path.rstrip("/")
    sizes = {p[len(root) + 1:]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(root + "/")}
    out: dict[int, int] = {}
    for rel in select_files(ckpt, batch):
        bits = rel.split("/")
        if bits[0] != "state" or len(bits) < 4 or not bits[1].isdigit() or not bits[2].isdigit():
            continue  # operator metadata (state/<op>/_metadata), not state
        out[int(bits[1])] = out.get(int(bits[1]), 0) + sizes.get(rel, 0)
    return out


class StateSize:
    """:func:`checkpoint_state_bytes` of the newest batch, listed at most every ``every_s``.

    On a local filesystem it is measured in the caller's thread (a directory walk); on object
    stores, where it is two listings and the RocksDB zips, in a background thread, so the
    runner's monitor loop never waits for it (the figure then names an earlier batch)."""

    def __init__(self, ckpt: CheckpointDir, every_s: float | None = None):
        self.ckpt = ckpt
        self.every_s = float(setting(STATE_SIZE_ENV, str(STATE_SIZE_EVERY_S))) if every_s is None else every_s
        self.background = not is_local(ckpt.fs)
        self._at = -1e18
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self.batch: int | None = None
        self.bytes: dict[int, int] = {}

    def after(self, batch: int) -> tuple[int | None, dict[int, int]]:
        """The (measured batch, bytes per operator): measured again for ``batch`` when due."""
        with self._lock:
            due = time.monotonic() - self._at >= self.every_s and not (
                self._running is not None and self._running.is_alive())
            if due:
                self._at = time.monotonic()
        if due and self.background:
            self._running = threading.Thread(target=self._measure, args=(batch,), daemon=True,
                                             name="onceflow-state-size")
            self._running.start()
        elif due:
            self._measure(batch)
        with self._lock:
            return self.batch, dict(self.bytes)

    def _measure(self, batch: int) -> None:
        try:
            sizes = checkpoint_state_bytes(self.ckpt, batch)
        except Exception as e:  # noqa: BLE001 - a figure for humans: keep the last one
            log.debug("state size of %s after batch %d: %s", self.ckpt.url, batch, e)
            return
        with self._lock:
            self.bytes, self.batch = sizes, batch
