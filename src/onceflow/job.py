"""The Job API: a plain PySpark pipeline handed to onceflow.

A :class:`Job` names a source (any Spark streaming DataFrame factory), an optional
``transform(df) -> df`` (each may take a :class:`~onceflow.RestoreContext` as a second
argument), a transactional sink, a :class:`CheckpointConfig` and a
:class:`~onceflow.runtime.restart.RestartStrategy`. ``job.run()`` blocks until the source is
exhausted (bounded sources), a stop is requested, or the restart strategy gives up.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from onceflow.durations import seconds
from onceflow.errors import ConfigError, OnceflowError
from onceflow.runtime.context import RestoreContext, check_arity
from onceflow.runtime.context import call as call_with_context
from onceflow.runtime.restart import RestartStrategy, default_strategy

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.sinks.base import Sink

@dataclass
class CheckpointConfig:
    """Where and how often micro-batches are checkpointed.

    ``directory``: any filesystem URL Spark and fsspec understand (local path in tests).
    ``interval``: trigger interval (Flink's checkpoint interval). ``state_backend``:
    ``hashmap`` (Spark's HDFS-backed store) or ``rocksdb``; ``incremental`` turns on RocksDB
    changelog checkpointing. ``batches_retained``: Spark's ``minBatchesToRetain``.
    ``batch_timeout``: a batch running longer fails the attempt (restart strategy applies).
    ``min_pause``: at least this long between the end of one batch's sink commit and the
    start of the next batch (enforced by the sink after its commit).
    """

    directory: str
    interval: float | str = "1 s"
    state_backend: Literal["hashmap", "rocksdb"] = "hashmap"
    incremental: bool = True
    batches_retained: int = 100
    batch_timeout: float | str | None = None
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
        return conf


@dataclass
class Job:
    """A streaming pipeline run by onceflow with exactly-once effects in its sink."""

    name: str
    #: ``spark -> streaming DataFrame``, or ``(spark, RestoreContext) -> ...``
    source: Callable[..., DataFrame]
    sink: Sink
    checkpoint: CheckpointConfig
    #: ``df -> DataFrame``, or ``(df, RestoreContext) -> DataFrame``
    transform: Callable[..., DataFrame] | None = None
    restart_strategy: RestartStrategy = field(default_factory=default_strategy)
    output_mode: Literal["append", "complete", "update"] = "append"
    master: str = "local[2]"
    #: a Spark Connect URL (``sc://host:15002``): run the query on that server instead
    remote: str | None = None
    spark_conf: dict[str, str] = field(default_factory=dict)
    #: stop once no data has been available for this many seconds (bounded inputs, demos, tests)
    stop_when_idle: float | None = None
    #: options for object-store URLs (checkpoint's event log and lease, savepoints, sinks without
    #: their own), fsspec or delta-rs keys; registered for the process (docs/object-stores.md)
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"Job.name {self.name!r}: use letters, digits, '_', '-', '.'")
        if not callable(self.source):
            raise ConfigError("Job.source must be a function spark -> streaming DataFrame")
        check_arity(self.source, "Job.source")
        if self.transform is not None:
            if not callable(self.transform):
                raise ConfigError("Job.transform must be a function df -> DataFrame")
            check_arity(self.transform, "Job.transform")
        if self.output_mode not in ("append", "complete", "update"):
            raise ConfigError(f"Job.output_mode {self.output_mode!r}: use append, complete or update")
        if self.storage_options is not None:
            from onceflow.storage import configure

            self.storage_options = configure(self.storage_options)

    def dataframe(self, spark: SparkSession, context: RestoreContext | None = None) -> DataFrame:
        """The job's DataFrame: ``source`` then ``transform``, each given ``context`` when it
        takes a second argument (see :class:`onceflow.RestoreContext`)."""
        context = context or RestoreContext("fresh")
        df = call_with_context(self.source, spark, context)
        if self.transform is not None:
            df = call_with_context(self.transform, df, context)
        return df

    def run(self, spark: SparkSession | None = None, stop=None, *, from_savepoint: str | None = None,
            fork: bool = False, rescale: int | None = None, allow_non_restored_state: bool = False,
            takeover: bool = False) -> None:
        """Run until done, stopped (``stop``: a threading.Event) or out of restarts.

        ``from_savepoint``: first restore that savepoint into the (empty) checkpoint directory;
        ``fork`` (new lineage), ``rescale`` and ``allow_non_restored_state``: see
        :class:`onceflow.savepoint.RestoreRequest`. ``takeover``: take the checkpoint's lease
        even when its holder looks alive (a promoted standby: the supervisor saw it die; the
        sinks' fencing epochs stop it should it only have been paused).
        """
        from onceflow.runtime.runner import JobRunner
        from onceflow.savepoint.restore import RestoreRequest

        restore = (RestoreRequest(from_savepoint, fork, rescale, allow_non_restored_state)
                   if from_savepoint else None)
        absent = False
        if restore is not None:  # refuse a bad restore before anything is created on disk
            from onceflow.storage import url_to_fs

            fs, path = url_to_fs(self.checkpoint.directory)
            absent = not fs.exists(path)
            restore.check(self.checkpoint.directory, job=self, spark=spark)
        try:
            JobRunner(self, spark=spark, stop=stop, restore=restore, takeover=takeover).run()
        except OnceflowError:
            if absent:  # e.g. a checksum mismatch found while copying: leave it absent again
                from onceflow.savepoint.restore import remove_if_only_onceflow

                remove_if_only_onceflow(self.checkpoint.directory)
            raise
