"""``onceflow run path/to/job.py[:name]``: run a job under the process supervisor."""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from onceflow.cli.savepoint import restore_env_for_run, restore_options
from onceflow.errors import OnceflowError
from onceflow.runtime.driver import EXIT_CONFIG
from onceflow.runtime.metrics import PORT_ENV as METRICS_PORT_ENV
from onceflow.runtime.restart import parse
from onceflow.runtime.supervisor import (
    CHECKPOINT_ENV,
    MASTER_ENV,
    RESTART_STRATEGY_ENV,
    Supervisor,
    apply_overrides,
)
from onceflow.savepoint.operations import SAVEPOINT_DIR_ENV, SAVEPOINT_ON_STOP_ENV
from onceflow.savepoint.restore import remove_if_only_onceflow
from onceflow.spark import REMOTE_ENV, SPARK_CONF_ENV, cli_conf, parse_conf
from onceflow.storage import url_to_fs


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
@click.option("--savepoint-dir", metavar="URL",
              help="Where SIGTERM/Ctrl-C put the savepoint on stop (default: CHECKPOINT/../savepoints).")
@click.option("--no-savepoint-on-stop", is_flag=True,
              help="SIGTERM/Ctrl-C only stop; no savepoint is taken.")
@click.option("--master", metavar="URL",
              help="Spark master for the drivers (spark://host:7077, yarn, k8s://..., local[N]); "
              "overrides the job's master.")
@click.option("--remote", metavar="sc://HOST:PORT",
              help="Run the queries on a Spark Connect server instead of a Spark of the driver's "
              "own; overrides the job's remote. Not with --master.")
@click.option("--conf", "conf", metavar="KEY=VALUE", multiple=True,
              help="A Spark setting for the drivers (repeatable); overrides the job's spark_conf.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="Serve Prometheus metrics (Flink's names: numberOfCompletedCheckpoints, numRestarts, "
              "numRecordsIn, ...) at http://HOST:PORT/metrics from the active driver.")
@click.option("--standby/--no-standby", default=True, show_default=True,
              help="Keep a warm standby driver (JVM, SparkSession and Python workers started) "
              "that takes over within seconds when the active driver dies; costs its memory.")
@click.option("--wait-for-lease", "wait_for_lease", type=click.FloatRange(0), default=0, metavar="SECONDS",
              help="When another driver holds the checkpoint's lease, wait up to SECONDS for it to end "
              "or lapse (it died, or hangs on another host) and then take over, instead of exiting.")
@click.pass_context
def run(ctx: click.Context, target: str, restart_spec: str | None, checkpoint_url: str | None,
        savepoint_dir: str | None, no_savepoint_on_stop: bool, standby: bool, wait_for_lease: float,
        master: str | None, remote: str | None, conf: tuple[str, ...], metrics_port: int | None,
        **restore) -> None:
    """Run a job; restart its driver process after crashes per the restart strategy.

    Query failures restart inside the driver, process crashes (kill -9, OOM) restart the
    process; both follow the same strategy and are logged with their cause. SIGTERM or
    Ctrl-C stops with a savepoint: the in-flight batch finishes, the query stops, a savepoint
    of the last committed batch is written to --savepoint-dir/<job>-<batch>-<time> and its
    path printed (Ctrl-C twice kills at once, no savepoint). Exit code 0 only if that worked.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s supervisor %(levelname)s %(message)s")
    from onceflow.runtime.loader import load_job

    env = dict(os.environ)
    try:
        spark_conf = parse_conf(conf)
        if master and remote:
            raise OnceflowError("--master and --remote contradict each other: a Spark Connect "
                                "server has its own master; give one")
        if remote and not remote.startswith("sc://"):
            raise OnceflowError(f"--remote {remote!r}: give a Spark Connect URL, e.g. sc://host:15002")
        override = parse(restart_spec) if restart_spec else None
        job = load_job(target)
        strategy = override or job.restart_strategy
        url = checkpoint_url or job.checkpoint.directory
        if not restore.get("from_savepoint"):  # a restore checks its (empty) target itself
            from onceflow.runtime.runner import check_checkpoint_dir

            check_checkpoint_dir(url)  # unwritable: one line now, not a traceback later
        if checkpoint_url:
            job = apply_overrides(job, {CHECKPOINT_ENV: checkpoint_url})
        env.update(restore_env_for_run(url, **restore, job=job))  # restored by the driver before its query
        if savepoint_dir and no_savepoint_on_stop:
            raise OnceflowError("--savepoint-dir and --no-savepoint-on-stop contradict each other; give one")
    except OnceflowError as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(2)
    if restart_spec:
        env[RESTART_STRATEGY_ENV] = strategy.describe()
    if checkpoint_url:
        env[CHECKPOINT_ENV] = checkpoint_url
    env[SAVEPOINT_ON_STOP_ENV] = "0" if no_savepoint_on_stop else "1"
    if master:
        env[MASTER_ENV] = master
    if remote:
        env[REMOTE_ENV] = remote
    if metrics_port:
        env[METRICS_PORT_ENV] = str(metrics_port)
    if spark_conf:
        env[SPARK_CONF_ENV] = json.dumps({**cli_conf(), **spark_conf})
    if wait_for_lease:
        env["ONCEFLOW_LEASE_WAIT_S"] = str(wait_for_lease)
    if savepoint_dir:
        env[SAVEPOINT_DIR_ENV] = savepoint_dir if "://" in savepoint_dir else os.path.abspath(savepoint_dir)
    fs, path = url_to_fs(url)
    absent = not fs.exists(path)
    rc = Supervisor(target, strategy, url, env=env, standby=standby).run()
    if restore.get("from_savepoint") and rc == EXIT_CONFIG and absent and remove_if_only_onceflow(url):
        logging.getLogger("onceflow.supervisor").info(
            "the restore was refused; removed %s, which this run had created", url)
    ctx.exit(rc)

