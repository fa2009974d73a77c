"""A replayable source of consecutive integer event ids (the demo's and verify's stream).

Offsets are ``{"next": n}`` and live only in Spark's checkpoint: batch N reads exactly ids
``[start, end)`` from ``offsets/N`` on every replay. New ids become available at
``rows_per_second`` up to ``total`` (then the source is exhausted). A query restarting a stream
that has read ids before finds :data:`WAITING_S` seconds' worth waiting, as it would find what
a real source received while it was down (a fresh stream starts with none). Columns: ``id`` (long),
``key`` (``id % keys``), ``event_time`` (timestamp derived from the id, deterministic).
With ``release_file``, the ids not yet available all become available once that file exists
(planning looks for it: one ``stat`` per trigger).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from onceflow.errors import ConfigError

OPTIONS = {
    "total": "number of events, ids 0..total-1 (default: unbounded)",
    "rows_per_second": "how fast new ids become available (default 50000); a query restarting a stream "
                       "that has read ids before finds a second's worth waiting",
    "partitions": "Spark partitions per batch (default 2)",
    "keys": "number of distinct keys, key = id % keys (default 16)",
    "max_rows_per_batch": "cap on ids per micro-batch (default: none)",
    "release_file": "once this file exists, every id up to total is available at once, in batches of at most "
                    "10 x max_rows_per_batch (onceflow verify: the rest of the stream after its last fault)",
}


def _int(opts: dict, name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = opts.get(name)
    if raw is None:
        return default
    try:
        value = int(float(raw))
    except ValueError:
        raise ConfigError(f"onceflow-sequence: option {name}={raw!r} is not a number") from None
    if value < minimum:
        raise ConfigError(f"onceflow-sequence: option {name} must be at least {minimum}")
    return value


class SequenceDataSource(DataSource):
    """``spark.readStream.format("onceflow-sequence").option("total", 1_000_000)``."""

    @classmethod
    def name(cls) -> str:
        return "onceflow-sequence"

    def schema(self) -> str:
        return "id long, key long, event_time timestamp"

    def simpleStreamReader(self, schema):  # pragma: no cover - Spark picks streamReader
        raise NotImplementedError

    def streamReader(self, schema) -> SequenceReader:
        opts = {k.lower(): v for k, v in self.options.items()}
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"onceflow-sequence: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}"
            )
        return SequenceReader(
            total=_int(opts, "total", None),
            rate=_int(opts, "rows_per_second", 50_000, 1),
            partitions=_int(opts, "partitions", 2, 1),
            keys=_int(opts, "keys", 16, 1),
            max_rows=_int(opts, "max_rows_per_batch", None, 1),
            release=opts.get("release_file") or None,
        )


#: seconds' worth of ids that a restarted stream finds waiting at its first trigger. Without
#: them, a restart's first trigger found nothing and its first batch waited for the next
#: trigger instant (up to an interval: 0.5-0.75 s of the demo's takeovers).
WAITING_S = 1.0


class SequenceReader(DataSourceStreamReader):
    def __init__(self, total, rate, partitions, keys, max_rows, release: str | None = None):
        self.total, self.rate, self.parts, self.keys, self.max_rows = total, rate, partitions, keys, max_rows
        self.release = release
        self._t0: float | None = None
        self._base = 0

    def initialOffset(self) -> dict:
        return {"next": 0}

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        begin = int((start or {"next": 0})["next"])
        now = time.monotonic()
        if self._t0 is None:  # this query's first look: ids arrive from now on
            self._t0, self._base = now - (WAITING_S if begin > 0 else 0.0), begin
        end = max(begin, self._base + int(self.rate * (now - self._t0)))
        released = self.total is not None and self.release is not None and os.path.exists(self.release)
        if released:
            end = self.total
        if self.max_rows:
            end = min(end, begin + self.max_rows * (10 if released else 1))
        if self.total is not None:
            end = min(end, self.total)
        return {"next": end}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        lo, hi = int(start["next"]), int(end["next"])
        step = max(1, -(-(hi - lo) // self.parts))
        return [InputPartition((a, min(hi, a + step))) for a in range(lo, hi, step)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        lo, hi = partition.value
        for a in range(lo, hi, 262_144):
            ids = np.arange(a, min(hi, a + 262_144), dtype=np.int64)
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids), pa.array(ids % self.keys),
                 pa.array(ids * 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC"))],
                names=["id", "key", "event_time"],
            )

    def commit(self, end: dict) -> None:
        pass
