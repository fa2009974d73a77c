"""``onceflow run path/to/job.py[:name]``: run a job under the process supervisor."""

from __future__ import annotations

import math

import click

from onceflow import logs
from onceflow.errors import OnceflowError
from onceflow.runtime.launch import LaunchOptions, launch
from onceflow.spark import parse_conf


@click.command("run")
@click.argument("target", metavar="PATH/TO/JOB.PY[:NAME]")
@click.argument("job_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- JOB ARGS...]")
@click.option(
    "--restart-strategy", "restart_spec", metavar="SPEC",
    help="Override the job's restart strategy, e.g. 'fixed_delay:attempts=5,delay=2s', "
    "'exponential_delay', 'failure_rate:max_failures_per_interval=3,failure_rate_interval=5min,"
    "delay=10s', 'none'.",
)
@click.option("--checkpoint", "checkpoint_url", metavar="URL",
              help="Override the job's checkpoint directory (any fsspec URL).")
@click.option("--from-savepoint", metavar="SP",
              help="Restore savepoint SP into the (empty) checkpoint directory, then run.")
@click.option("--fork", is_flag=True,
              help="Run the restored savepoint under a new lineage (required to roll back).")
@click.option("--rescale", type=int, metavar="N",
              help="Repartition the restored state into N partitions (RocksDB state).")
@click.option("--allow-non-restored-state", is_flag=True,
              help="Drop savepoint state of operators the job no longer has.")
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
              help="Serve Prometheus metrics (onceflow_batches_total, onceflow_last_commit_age_seconds, "
              "batch and commit duration histograms, source lag, state size; Flink's names too) at "
              "http://HOST:PORT/metrics from the active driver (docs/metrics.md).")
@click.option("--standby/--no-standby", default=True, show_default=True,
              help="Keep a warm standby driver (JVM, SparkSession and Python workers started) "
              "that takes over within seconds when the active driver dies; costs its memory.")
@click.option("--wait-for-lease", "wait_for_lease", type=click.FloatRange(0), default=math.inf,
              metavar="SECONDS", show_default="forever",
              help="When another driver holds the checkpoint's lease (a second pod on the same "
              "checkpoint, an overlapping rollout), stand by up to SECONDS for it to end or lapse, "
              "then take over; a line every 30 s says who holds it. 0: exit 5 at once instead.")
@click.option("--dry-run", is_flag=True,
              help="Load the job, build its query plan and open its sink read-only (options, "
              "target, permissions); print the plan and the sink's guarantee, then exit 0 "
              "without running a batch or writing anything.")
@click.pass_context
def run(ctx: click.Context, target: str, job_args: tuple[str, ...], restart_spec: str | None, checkpoint_url: str | None,
        from_savepoint: str | None, fork: bool, rescale: int | None, allow_non_restored_state: bool,
        savepoint_dir: str | None, no_savepoint_on_stop: bool, standby: bool, wait_for_lease: float,
        master: str | None, remote: str | None, conf: tuple[str, ...], metrics_port: int | None,
        dry_run: bool) -> None:
    """Run a job; restart its driver process after crashes per the restart strategy.

    Query failures restart inside the driver, process crashes (kill -9, OOM) restart the
    process; both follow the same strategy and are logged with their cause. SIGTERM or
    Ctrl-C stops with a savepoint: the in-flight batch finishes, the query stops, a savepoint
    of the last committed batch is written to --savepoint-dir/<job>-<batch>-<time> and its
    path printed (Ctrl-C twice kills at once, no savepoint). Exit code 0 only if that worked.

    Arguments after '--' are the job's: 'onceflow run job.py -- --topic a' runs job.py with
    sys.argv == ['job.py', '--topic', 'a'] in every process that loads it (as spark-submit).
    """
    logs.configure("supervisor")
    try:
        options = LaunchOptions(
            checkpoint=checkpoint_url, restart_strategy=restart_spec, from_savepoint=from_savepoint,
            fork=fork, rescale=rescale, allow_non_restored_state=allow_non_restored_state,
            savepoint_dir=savepoint_dir, savepoint_on_stop=not no_savepoint_on_stop, master=master,
            remote=remote, conf=parse_conf(conf), metrics_port=metrics_port, standby=standby,
            wait_for_lease=wait_for_lease, args=job_args)
        if dry_run:
            from onceflow.runtime.dryrun import dry_run as check

            check(target, options, click.echo)
            ctx.exit(0)
        rc = launch(target, options)
    except OnceflowError as e:
        logs.error_line(str(e))
        ctx.exit(2)
    ctx.exit(rc)
