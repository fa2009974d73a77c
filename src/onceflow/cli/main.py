"""The ``onceflow`` command. Each subcommand lives in its own module and is added below."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from onceflow import __version__, logs
from onceflow.cli import apidoc
from onceflow.cli.checkpoints import checkpoints, state
from onceflow.cli.demo import demo
from onceflow.cli.docgen import render
from onceflow.cli.doctor import doctor
from onceflow.cli.jobs import list_
from onceflow.cli.run import run
from onceflow.cli.savepoint import cancel, savepoint, stop
from onceflow.cli.verify import verify
from onceflow.errors import OnceflowError


def _set(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Hand the option to this process and, by the environment, to every process it starts."""
    if value is None or ctx.resilient_parsing:
        return
    logs.apply_to_environ(value if param.name == "log_level" else None,
                          value if param.name == "log_format" else None)
    logs.configure(logs.current_role())


F = TypeVar("F", bound=Callable[..., Any])


def log_options(f: F) -> F:
    """``--log-level`` and ``--log-format`` (the group's, and again on ``run``)."""
    f = click.option("--log-format", "log_format", type=click.Choice(logs.FORMATS, case_sensitive=False),
                     expose_value=False, is_eager=True, callback=_set,
                     help="text, or json: one JSON object per line (time, level, logger, message, "
                     "role, job, pid), also from the driver and standby processes. "
                     "[env: ONCEFLOW_LOG_FORMAT]")(f)
    return click.option("--log-level", "log_level", type=click.Choice(logs.LEVELS, case_sensitive=False),
                        expose_value=False, is_eager=True, callback=_set,
                        help="Log level of onceflow and of the processes it starts (Spark's JVM: "
                        "ONCEFLOW_SPARK_LOG_LEVEL). [env: ONCEFLOW_LOG_LEVEL]")(f)


class _Main(click.Group):
    """Turns any :class:`OnceflowError` into ``error: ...`` on stderr and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OnceflowError as e:
            logs.error_line(str(e))
            ctx.exit(2)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="onceflow")
@log_options
def main() -> None:
    """Exactly-once machinery for PySpark Structured Streaming.

    Object stores (s3://, s3a://, gs://, abfs://): every command reads its storage options
    from ONCEFLOW_STORAGE_OPTIONS, a JSON object of fsspec or delta-rs keys, e.g.
    '{"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}'
    (docs/object-stores.md); credentials come best from the usual AWS_* variables.
    """


@click.command("config-reference", hidden=True)
def config_reference() -> None:
    """Print docs/configuration.md (every option and ONCEFLOW_* variable) as generated."""
    click.echo(render(main), nl=False)


@click.command("api-reference", hidden=True)
def api_reference() -> None:
    """Print docs/api.md (the public API from its docstrings) as generated."""
    click.echo(apidoc.render(), nl=False)


# One line per command.
main.add_command(log_options(run))  # 'onceflow run --log-level DEBUG JOB' as well
main.add_command(config_reference)
main.add_command(api_reference)
main.add_command(demo)
main.add_command(savepoint)
main.add_command(stop)
main.add_command(cancel)
main.add_command(list_)
main.add_command(checkpoints)
main.add_command(state)
main.add_command(doctor)
main.add_command(verify)
