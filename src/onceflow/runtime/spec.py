"""What the runtime needs of a job: :class:`JobSpec`.

``onceflow.Job`` is the job description users write; the runtime works on this protocol and
never imports it, so that the description can offer ``Job.run()`` (which calls
:func:`onceflow.runtime.launch.run_in_process`) without an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pyspark.sql import DataFrame

    from onceflow.checkpoint.config import CheckpointConfig
    from onceflow.runtime.restart import RestartStrategy
    from onceflow.savepoint.context import RestoreContext
    from onceflow.sinks.base import Sink


@runtime_checkable
class JobSpec(Protocol):
    """A streaming pipeline with a transactional sink and a checkpoint (``onceflow.Job``)."""

    name: str
    sink: Sink
    checkpoint: CheckpointConfig
    restart_strategy: RestartStrategy
    output_mode: str
    master: str | None
    remote: str | None
    spark_conf: dict[str, str]
    stop_when_idle: float | None
    storage_options: Mapping[str, Any] | None

    def dataframe(self, spark: Any, context: RestoreContext | None = None) -> DataFrame:
        """The job's streaming DataFrame, built with ``context``."""
        ...
