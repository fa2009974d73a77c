"""Where and how often a job's micro-batches are checkpointed: :class:`CheckpointConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from onceflow.durations import seconds
from onceflow.errors import ConfigError

#: How often Spark's state maintenance runs (it uploads RocksDB snapshots under changelog
#: checkpointing). Spark's default, 60 s, leaves a driver that dies sooner every changelog since
#: the last uploaded snapshot to replay when the next one loads the state, and a job that keeps
#: failing replays more each time: 200,000 keys, 3 kills 35 s apart, recovery median 11.8 s with
#: 60 s and 7.0 s with 10 s; 2,000,000 keys: 9.1 s with 10 s, 7.0 s with 2 s, 7.1 s with 1 s
#: (benchmarks/bench_recovery.py --pipelines state). A round with nothing new to upload costs
#: next to nothing. A job's own ``spark.sql.streaming.stateStore.maintenanceInterval`` wins.
MAINTENANCE_INTERVAL = "2s"


@dataclass
class CheckpointConfig:
    """Where and how often micro-batches are checkpointed.

    ``directory``: any filesystem URL Spark and fsspec understand (local path in tests).
    ``interval``: trigger interval (Flink's checkpoint interval). ``state_backend``:
    ``hashmap`` (Spark's HDFS-backed store) or ``rocksdb``; ``incremental`` turns on RocksDB
    changelog checkpointing (and state maintenance every 2 s instead of Spark's 60, so that
    snapshots keep the changelog a restart replays short). ``batches_retained``: Spark's ``minBatchesToRetain``.
    ``batch_timeout``: a batch running longer fails the attempt (restart strategy applies).
    ``min_pause``: at least this long between the end of one batch's sink commit and the
    start of the next batch (enforced by the sink after its commit).
    """

    #: any filesystem URL Spark and fsspec understand
    directory: str
    #: the trigger interval (Flink's checkpoint interval): seconds or a duration such as "10 s"
    interval: float | str = "1 s"
    #: ``hashmap`` (Spark's HDFS-backed store) or ``rocksdb``
    state_backend: Literal["hashmap", "rocksdb"] = "hashmap"
    #: RocksDB changelog checkpointing
    incremental: bool = True
    #: Spark's ``minBatchesToRetain``
    batches_retained: int = 100
    #: a batch running longer fails the attempt (the restart strategy applies)
    batch_timeout: float | str | None = None
    #: at least this long between one batch's sink commit and the next batch
    min_pause: float | str = 0

    def __post_init__(self) -> None:
        if not self.directory:
            raise ConfigError("CheckpointConfig.directory is empty; give a directory path or URL")
        if self.state_backend not in ("hashmap", "rocksdb"):
            raise ConfigError(
                f"CheckpointConfig.state_backend={self.state_backend!r}: use 'hashmap' or 'rocksdb'"
            )
        if self.batches_retained < 1:
            raise ConfigError("CheckpointConfig.batches_retained must be at least 1")
        self.interval_s = seconds(self.interval, "CheckpointConfig.interval") or 0.0
        self.batch_timeout_s = seconds(self.batch_timeout, "CheckpointConfig.batch_timeout")
        self.min_pause_s = seconds(self.min_pause, "CheckpointConfig.min_pause") or 0.0

    def spark_conf(self) -> dict[str, str]:
        conf = {
            "spark.sql.streaming.minBatchesToRetain": str(self.batches_retained),
            "spark.sql.streaming.stateStore.providerClass":
                "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
        }
        if self.state_backend == "rocksdb":
            conf["spark.sql.streaming.stateStore.providerClass"] = (
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
            )
            conf["spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"] = str(
                self.incremental
            ).lower()
            if self.incremental:
                conf["spark.sql.streaming.stateStore.maintenanceInterval"] = MAINTENANCE_INTERVAL
        return conf
