"""The ``onceflow`` command. Each subcommand lives in its own module and is added below."""

from __future__ import annotations

import click

from onceflow import __version__, logs
from onceflow.cli.checkpoints import checkpoints, state
from onceflow.cli.demo import demo
from onceflow.cli.doctor import doctor
from onceflow.cli.jobs import list_
from onceflow.cli.options import log_options
from onceflow.cli.run import run
from onceflow.cli.savepoint import cancel, savepoint, stop
from onceflow.cli.verify import verify
from onceflow.errors import OnceflowError


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


# One line per command.
main.add_command(run)
main.add_command(demo)
main.add_command(savepoint)
main.add_command(stop)
main.add_command(cancel)
main.add_command(list_)
main.add_command(checkpoints)
main.add_command(state)
main.add_command(doctor)
main.add_command(verify)
