"""``onceflow run path/to/job.py[:name]``: run a job under the process supervisor."""

from __future__ import annotations

import logging
import os
import sys

import click

from onceflow.cli.savepoint import restore_env_for_run, restore_options
from onceflow.errors import OnceflowError
from onceflow.runtime.restart import parse
from onceflow.runtime.supervisor import CHECKPOINT_ENV, RESTART_STRATEGY_ENV, Supervisor


@click.command("run")
@click.argument("target", metavar="PATH/TO/JOB.PY[:NAME]")
@click.option(
    "--restart-strategy", "restart_spec", metavar="SPEC",
    help="Override the job's restart strategy, e.g. 'fixed_delay:attempts=5,delay=2s', "
    "'exponential_delay', 'failure_rate:max_failures_per_interval=3,failure_rate_interval=5min,"
    "delay=10s', 'none'.",
)
@click.option("--checkpoint", "checkpoint_url", metavar="URL",
              help="Override the job's checkpoint directory (any fsspec URL).")
@restore_options  # --from-savepoint SP, --fork, --rescale N, --allow-non-restored-state
@click.pass_context
def run(ctx: click.Context, target: str, restart_spec: str | None, checkpoint_url: str | None,
        **restore) -> None:
    """Run a job; restart its driver process after crashes per the restart strategy.

    Query failures restart inside the driver, process crashes (kill -9, OOM) restart the
    process; both follow the same strategy and are logged with their cause. SIGTERM or
    Ctrl-C stops after the in-flight batch (Ctrl-C twice kills at once).
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s supervisor %(levelname)s %(message)s")
    from onceflow.runtime.loader import load_job

    env = dict(os.environ)
    try:
        override = parse(restart_spec) if restart_spec else None
        job = load_job(target)
        strategy = override or job.restart_strategy
        url = checkpoint_url or job.checkpoint.directory
        env.update(restore_env_for_run(url, **restore))  # restored by the driver before its query
    except OnceflowError as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(2)
    if restart_spec:
        env[RESTART_STRATEGY_ENV] = strategy.describe()
    if checkpoint_url:
        env[CHECKPOINT_ENV] = checkpoint_url
    ctx.exit(Supervisor(target, strategy, url, env=env).run())
