"""Options several commands share: ``--log-level`` and ``--log-format``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from onceflow import logs


def _set(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Hand the option to this process and, by the environment, to every process it starts."""
    if value is None or ctx.resilient_parsing:
        return
    logs.apply_to_environ(value if param.name == "log_level" else None,
                          value if param.name == "log_format" else None)
    logs.configure(logs.current_role())


def log_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--log-level`` and ``--log-format`` (also taken after a subcommand: 'onceflow run
    --log-level DEBUG JOB')."""
    f = click.option("--log-format", "log_format", type=click.Choice(logs.FORMATS, case_sensitive=False),
                     expose_value=False, is_eager=True, callback=_set,
                     help="text, or json: one JSON object per line (time, level, logger, message, "
                     "role, job, pid), also from the driver and standby processes. "
                     "[env: ONCEFLOW_LOG_FORMAT]")(f)
    return click.option("--log-level", "log_level", type=click.Choice(logs.LEVELS, case_sensitive=False),
                        expose_value=False, is_eager=True, callback=_set,
                        help="Log level of onceflow and of the processes it starts (Spark's JVM: "
                        "ONCEFLOW_SPARK_LOG_LEVEL). [env: ONCEFLOW_LOG_LEVEL]")(f)
