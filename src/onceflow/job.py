"""The Job API: a plain PySpark pipeline handed to onceflow.

A :class:`Job` names a source (any Spark streaming DataFrame factory), an optional
``transform(df) -> df`` (each may take a :class:`~onceflow.RestoreContext` as a second
argument), a transactional sink, a :class:`CheckpointConfig` and a
:class:`~onceflow.runtime.restart.RestartStrategy`. ``job.run()`` blocks until the source is
exhausted (bounded sources), a stop is requested, or the restart strategy gives up.

The job is a description: how it runs is :mod:`onceflow.runtime`'s business (which works on
any :class:`~onceflow.runtime.spec.JobSpec` and never imports this module); ``run()`` hands the
job to :func:`onceflow.runtime.launch.run_in_process`, the same steps ``onceflow run`` takes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from onceflow.checkpoint.config import CheckpointConfig
from onceflow.durations import seconds  # noqa: F401 - importable from here, as before
from onceflow.errors import ConfigError
from onceflow.runtime.launch import restore_request, run_in_process
from onceflow.runtime.metrics.progress import observe_event_time
from onceflow.runtime.restart import RestartStrategy, default_strategy
from onceflow.savepoint.context import RestoreContext, check_arity
from onceflow.savepoint.context import call as call_with_context
from onceflow.storage import configure

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.sinks.base import Sink

__all__ = ["CheckpointConfig", "Job"]


@dataclass
class Job:
    """A streaming pipeline run by onceflow with exactly-once effects in its sink."""

    #: the query's name, in logs, metrics and savepoint names (letters, digits, ``_-.``)
    name: str
    #: ``spark -> streaming DataFrame``, or ``(spark, RestoreContext) -> ...``
    source: Callable[..., DataFrame]
    #: where the rows go, exactly once: ``DeltaSink``, ``PostgresSink``, ``KafkaSink``, ``IcebergSink``
    sink: Sink
    #: where and how often batches are checkpointed (:class:`CheckpointConfig`)
    checkpoint: CheckpointConfig
    #: ``df -> DataFrame``, or ``(df, RestoreContext) -> DataFrame``
    transform: Callable[..., DataFrame] | None = None
    #: how query failures and driver crashes are retried (``fixed_delay``, ``exponential_delay``, ...)
    restart_strategy: RestartStrategy = field(default_factory=default_strategy)
    #: Spark's output mode of the query (onceflow's Python data sources take append and complete;
    #: update needs DeltaSink(writer="jvm"))
    output_mode: Literal["append", "complete", "update"] = "append"
    #: the Spark master of the driver (``onceflow run --master`` overrides it)
    master: str = "local[2]"
    #: a Spark Connect URL (``sc://host:15002``): run the query on that server instead
    remote: str | None = None
    #: Spark settings of the job's session (``onceflow run --conf`` overrides them)
    spark_conf: dict[str, str] = field(default_factory=dict)
    #: stop once no data has been available for this many seconds (bounded inputs, demos, tests)
    stop_when_idle: float | None = None
    #: the source column whose newest value per committed batch is the freshness metric
    #: (``onceflow_newest_event_age_seconds``): ``"auto"`` takes the source's first timestamp
    #: column (Kafka's ``timestamp``), a name that column, ``None`` none
    event_time: str | None = "auto"
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
            self.storage_options = configure(self.storage_options)

    def dataframe(self, spark: SparkSession, context: RestoreContext | None = None) -> DataFrame:
        """The job's DataFrame: ``source`` (observed for its ``event_time``), then ``transform``,
        each given ``context`` when it takes a second argument (see :class:`onceflow.RestoreContext`)."""
        context = context or RestoreContext("fresh")
        df = observe_event_time(call_with_context(self.source, spark, context), self.event_time)
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
        run_in_process(self, spark, stop, takeover=takeover,
                       restore=restore_request(from_savepoint, fork, rescale, allow_non_restored_state))
