"""The Kinesis source's stream reader: shard discovery, planning positions, data loss.

Data loss across a reshard (:meth:`KinesisStreamReader._lost_across_reshard`): Kinesis drops a
closed shard from ListShards once its records expired (retention). Before planning, the driver
compares ListShards with the checkpointed positions and reports (``failOnDataLoss=true``:
KinesisDataLossError naming every such shard, the query fails; ``false``: one WARNING per
shard, and the children are read from their start) two cases:

- a checkpointed shard that is no longer listed although its position is not ``SHARD_END``:
  the records after its position were never read (conservative: if the last record read was
  in fact the shard's last, nothing was lost, and it is reported all the same);
- a shard that appeared since the last planning whose parent is neither listed nor
  checkpointed (created and expired while the query was stopped): none of the parent's records
  were read, and its child would start at TRIM_HORIZON after them.

Both are only possible when the query was stopped (or kept failing) for longer than the
stream's retention; either way every counted loss is a ``source_data_loss`` event. A loss
accepted once (``failOnDataLoss=false``) is found in the event log and not reported again,
also when ``failOnDataLoss`` is set back to true (without ``eventLog``: once per driver).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from onceflow.sources import LAG_MS_KEY
from onceflow.sources.initial import kept_initial
from onceflow.sources.kinesis.client import THROTTLED, describe
from onceflow.sources.kinesis.fetch import KinesisInputPartition, read_range
from onceflow.sources.kinesis.options import (
    NAME,
    SHARD_END,
    TRIM_HORIZON,
    KinesisDataLossError,
    Positions,
    Settings,
    ShardKey,
    _fail,
    from_json,
    is_seq,
    to_json,
)
from onceflow.sources.kinesis.shards import (
    ShardInfo,
    accepted_losses,
    check_retained,
    initial_position,
    raise_or_skip,
    read_ahead,
    record_event,
)
from onceflow.sources.kinesis.spill import cleanup, spill_writer

log = logging.getLogger("onceflow.sources.kinesis")


class KinesisStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans per-shard ranges on the driver; ``read`` fetches one range on an executor.

    A shard is readable once every parent it has in the stream is at ``SHARD_END`` in the
    batch's start positions, so a parent's records always land in earlier batches than its
    children's. Shards that appear (resharding) are read from ``TRIM_HORIZON``."""

    def __init__(self, settings: Settings, schema: StructType) -> None:
        self.s = settings
        self.schema = schema
        self._available_now: tuple[float, set[ShardKey]] | None = None
        self._available_done: set[ShardKey] = set()
        self.skipped = 0  # data-loss events skipped (failOnDataLoss=false)
        self._throttled_reported = 0
        self._arrow = None  # the Arrow schema of spilled ranges
        self._rotation = 0
        self._replaced: Positions = {}  # stale start -> TRIM_HORIZON (failOnDataLoss=false)
        self._lost: set[ShardKey] = set()  # shards reported lost across a reshard (once each)
        #: per shard, ms the last planned batch ends behind the shard's tip (reportLatestOffset)
        self._lag_ms: dict[ShardKey, int] = {}

    # -- shards -----------------------------------------------------------------------------
    def shards(self) -> dict[ShardKey, ShardInfo]:
        return {(st, raw["ShardId"]): ShardInfo.of(st, raw)
                for st in self.s.streams for raw in describe(self.s, st)}

    def check(self) -> None:
        """Fail early: bad credentials, unreachable endpoint, unknown streams or shards."""
        found = self.shards()
        if isinstance(self.s.starting, dict):
            unknown = sorted(f"{st}/{sh}" for st, shards in self.s.starting.items()
                             for sh in shards if (st, sh) not in found)
            if unknown:
                raise _fail(f"startingPosition names shard(s) {', '.join(unknown)} that do not exist")

    # -- driver: offsets --------------------------------------------------------------------
    def initialOffset(self) -> dict:
        """Where a new query starts, pinned to concrete positions. With ``eventLog`` (set by
        onceflow Jobs) the first answer is kept in the checkpoint, so a batch 0 replayed after
        a crash reads the same records even for LATEST or AT_TIMESTAMP."""
        return kept_initial(self._initial_path(), self._identity(), self._initial, NAME)

    def _identity(self) -> str:
        return json.dumps([self.s.endpoint_url, self.s.region, sorted(self.s.streams), self.s.starting,
                           self.s.starting_timestamp], sort_keys=True)

    def _initial_path(self) -> str | None:
        if not self.s.event_log:
            return None
        key = hashlib.sha256(self._identity().encode()).hexdigest()[:16]
        return f"{self.s.event_log.rstrip('/')}/_onceflow/kinesis-initial-positions-{key}.json"

    def _initial(self) -> dict:
        found = self.shards()
        out: Positions = {}
        for key, info in sorted(found.items()):
            if isinstance(self.s.starting, dict):
                spec = self.s.starting.get(key[0], {}).get(key[1], TRIM_HORIZON)
            else:
                spec = self.s.starting
            out[key] = initial_position(self.s, info, spec, self.s.starting_timestamp)
        return to_json(out)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.s.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read the shards that exist now until each reaches its tip (or
        a record that arrived after this call); shards created later are left for later runs.
        Where AvailableNow stops is all this decides: every batch's range is still exact."""
        self._available_now = (time.time(), set(self.shards()))
        self._available_done: set[ShardKey] = set()

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        """End positions of the next batch: per readable shard, the newest record (or, with
        ``maxRecordsPerTrigger``, the last of its share), found by reading ahead on the driver."""
        begin = from_json(start)
        cleanup(self.s, begin)  # Spark does not call commit() for the batch before a restart
        found = self.shards()
        self._report_lost(self._lost_across_reshard(begin, found))
        for key in sorted(found):
            begin.setdefault(key, TRIM_HORIZON)  # a new shard (resharding)
        end = dict(begin)
        ready = [k for k in sorted(found) if self._readable(k, begin, found)]
        if self._available_now is not None:
            known = self._available_now[1]
            ready = [k for k in ready if k in known and k not in self._available_done]
        caps = self._caps(ready, limit)
        self._lag_ms = {k: ms for k, ms in self._lag_ms.items() if k in found}
        for key in ready:
            end[key], at_tip = self._advance(found[key], self._checked(key, begin[key]), caps.get(key))
            if self._available_now is not None and at_tip:
                self._available_done.add(key)
        self._report_throttled()
        return to_json(end)

    def _lost_across_reshard(self, begin: Positions, found: dict[ShardKey, ShardInfo]
                             ) -> dict[ShardKey, tuple[str | None, str]]:
        """Shards whose unread records are gone: (checkpointed position or None, why); see the
        module's docstring. Shards already reported by this reader, or accepted earlier
        (``failOnDataLoss=false``, per the event log), are left out."""
        lost: dict[ShardKey, tuple[str | None, str]] = {}
        for key, pos in sorted(begin.items()):
            if key[0] in self.s.streams and key not in found and pos != SHARD_END:
                read = f"read only up to {pos}" if is_seq(pos) else "never read"
                lost[key] = (pos, f"{read}, not to its end (SHARD_END), and no longer listed (expired after retention)")
        checkpointed = {st for st, _ in begin}
        for key, info in sorted(found.items()):
            if key in begin or key[0] not in checkpointed:  # a stream new to the query starts fresh
                continue
            for parent in info.parents:
                pk = (key[0], parent)
                if pk not in begin and pk not in found:
                    lost[pk] = (None, "never read, and no longer listed (created and expired while the query "
                                      "was stopped)")
        lost = {k: v for k, v in lost.items() if k not in self._lost}
        if lost:
            self._lost.update(accepted_losses(self.s))
            lost = {k: v for k, v in lost.items() if k not in self._lost}
        for pk, (pos, why) in lost.items():
            children = sorted(k[1] for k, i in found.items() if k[0] == pk[0] and pk[1] in i.parents)
            if children:
                lost[pk] = (pos, f"{why}; its child shard(s) {', '.join(children)} would start after its lost records")
        return lost

    def _report_lost(self, lost: dict[ShardKey, tuple[str | None, str]]) -> None:
        """failOnDataLoss: one KinesisDataLossError naming every shard; else a WARNING each.
        Either way each is a ``source_data_loss`` event."""
        if not lost:
            return
        for (st, sh), (pos, why) in sorted(lost.items()):
            self.skipped += 0 if self.s.fail_on_data_loss else 1
            record_event(self.s, "source_data_loss", stream=st, shard=sh, start=pos, end=None, records=None,
                         cause=f"reshard: {why}", failed=self.s.fail_on_data_loss, skipped_so_far=self.skipped)
        shards = "; ".join(f"stream {st} shard {sh}: {why}" for (st, sh), (_, why) in sorted(lost.items()))
        if self.s.fail_on_data_loss:
            raise KinesisDataLossError(
                f"{NAME}: records lost across a reshard: {shards}. Kinesis no longer has them (retention): "
                "re-send them from their producer if you can, then set failOnDataLoss=false to continue with "
                "the child shards (the loss is logged and counted as source_data_loss events); raise the "
                "stream's retention above the longest time the job may be stopped")
        for (st, sh), (_, why) in sorted(lost.items()):
            log.warning("%s: records lost across a reshard: stream %s shard %s: %s; failOnDataLoss=false: "
                        "continuing with its children", NAME, st, sh, why)
        self._lost.update(lost)

    def _readable(self, key: ShardKey, pos: Positions, found: dict[ShardKey, ShardInfo]) -> bool:
        if pos.get(key) == SHARD_END:
            return False
        return all(pos.get((key[0], p)) == SHARD_END for p in found[key].parents if (key[0], p) in found)

    def _caps(self, ready: list[ShardKey], limit: ReadLimit | None) -> dict[ShardKey, int]:
        if not isinstance(limit, ReadMaxRows) or not ready:
            return {}
        n = limit.max_rows
        share, extra = divmod(n, len(ready))
        self._rotation += 1  # the remainder goes to other shards each batch: none starves
        first = self._rotation % len(ready)
        return {k: share + (1 if (i - first) % len(ready) < extra else 0) for i, k in enumerate(ready)}

    def _checked(self, key: ShardKey, position: str) -> str:
        """The position to plan from: a stale (trimmed / re-created) one raises, or with
        failOnDataLoss=false is replaced by TRIM_HORIZON and counted."""
        why = check_retained(self.s, key[0], key[1], position)
        if why is None:
            return position
        self.skipped += 0 if self.s.fail_on_data_loss else 1
        record_event(self.s, "source_data_loss", stream=key[0], shard=key[1], start=position,
                     end=None, records=None, cause=why, failed=self.s.fail_on_data_loss,
                     skipped_so_far=self.skipped)
        raise_or_skip(self.s, key[0], key[1], position, why)
        self._replaced[key] = position
        return TRIM_HORIZON

    def _advance(self, info: ShardInfo, position: str, cap: int | None) -> tuple[str, bool]:
        """Read ahead from ``position`` to find the batch's end; what is read is spilled for
        the executor (spill.py) so the shard is read once per batch. Returns the end and
        whether the shard's tip (or, under AvailableNow, a record newer than its start) was
        reached."""
        if cap == 0:
            return position, False
        if cap is None and info.closed:
            self._lag_ms[(info.stream, info.shard_id)] = 0
            return SHARD_END, True  # a closed shard's records are fixed: the executor reads them
        if self._arrow is None:
            from pyspark.sql.pandas.types import to_arrow_schema

            self._arrow = to_arrow_schema(self.schema, timezone="UTC")
        writer = spill_writer(self.s, info.stream, info.shard_id, position, self._arrow)
        newest = [0.0]

        def keep(records: list) -> None:
            if records:
                newest[0] = float(records[-1].get("ApproximateArrivalTimestamp") or 0)
            if writer:
                writer.add(records)

        try:
            last, n, ended, behind = read_ahead(self.s, info.stream, info.shard_id, position, cap, info.closed,
                                                keep)
        except BaseException:
            if writer:
                writer.abort()
            raise
        end = SHARD_END if ended and info.closed else last
        if writer and n and end != position:
            try:
                writer.finish(end)
            except OSError as e:  # the spill only saves a read: the executor reads Kinesis
                log.warning("%s: could not publish the spill of %s/%s (%s); its task reads Kinesis",
                            NAME, info.stream, info.shard_id, e)
                writer.abort()
        elif writer:
            writer.abort()
        at_tip = cap is None or n < cap or ended or (
            self._available_now is not None and newest[0] > self._available_now[0])
        age = max(0, int((time.time() - newest[0]) * 1000)) if newest[0] else 0
        self._lag_ms[(info.stream, info.shard_id)] = 0 if behind == 0 else max(behind, age)
        return end, at_tip

    def reportLatestOffset(self) -> dict | None:
        """Shown in Spark's progress as the source's ``latestOffset``: ``{"lagMillis": {stream:
        {shard: ms}}}``, how far each shard's planned end is behind its tip: 0 when the batch
        reads to the tip, otherwise Kinesis's MillisBehindLatest or the age of the last record
        it planned (the iterator age, the driver's clock against ApproximateArrivalTimestamp),
        whichever is larger."""
        if not self._lag_ms:
            return None
        out: dict[str, dict[str, int]] = {}
        for (stream, shard), ms in sorted(self._lag_ms.items()):
            out.setdefault(stream, {})[shard] = ms
        return {LAG_MS_KEY: out}

    def _report_throttled(self) -> None:
        n = THROTTLED.value
        if n > self._throttled_reported:
            record_event(self.s, "source_throttled", where="driver", requests=n - self._throttled_reported,
                         total=n)
            self._throttled_reported = n

    # -- driver: planning -------------------------------------------------------------------
    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, stop = from_json(start), from_json(end)
        parts: list[InputPartition] = []
        for (st, sh), hi in sorted(stop.items()):
            lo = begin.get((st, sh), TRIM_HORIZON)
            if self._replaced.get((st, sh)) == lo:  # counted when planned: read the new shard
                lo = TRIM_HORIZON
            if hi != lo and (is_seq(hi) or hi == SHARD_END):
                parts.append(KinesisInputPartition(st, sh, lo, hi))
        return parts

    # -- executor ---------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KinesisInputPartition)
        return read_range(self.s, self.schema, partition)

    def commit(self, end: dict) -> None:
        """Nothing is stored outside Spark's checkpoint (no KCL lease table); the spilled
        records of committed ranges are deleted."""
        cleanup(self.s, from_json(end))

    def stop(self) -> None:
        pass
