"""``onceflow verify``: prove exactly-once on your own stack, under faults you choose."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import click
from rich.console import Console

from onceflow.errors import OnceflowError
from onceflow.extras import require
from onceflow.verify.fault_base import stream_seconds
from onceflow.verify.faults import FAULTS
from onceflow.verify.spec import SINKS, SOURCES

FAULT_HELP = "; ".join(f"{f.name}: {f.help}" for f in FAULTS.values())


def _gap(_ctx, _param, value: str) -> tuple[float, float]:
    try:
        lo, _, hi = value.partition("-")
        lo_f, hi_f = float(lo), float(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{value!r}: give seconds as MIN-MAX, e.g. 2-6") from None
    if not 0 <= lo_f <= hi_f:
        raise click.BadParameter(f"{value!r}: need 0 <= MIN <= MAX")
    return lo_f, hi_f


#: ``onceflow verify``'s exit code when the data is clean but not every fault was injected
EXIT_INCONCLUSIVE = 3


@click.command()
@click.option("--source", type=click.Choice(SOURCES), default="sequence", show_default=True)
@click.option("--sink", type=click.Choice(SINKS), default="delta", show_default=True,
              help="delta: the Delta sink's Python (arrow) write path; delta-jvm: its JVM write path, which "
                   "DeltaSink(path) runs for a local table in a Job; delta-upsert and iceberg-upsert: events upserted "
                   "on key = id % K (every 11th id a delete), checked per key and per batch. kafka-at_least_once is a control that "
                   "is NOT exactly-once: verify must fail it.")
@click.option("--faults", "faults", default="driver_kill,jvm_kill,worker_kill", show_default=True,
              help=f"Comma-separated fault kinds, injected in a seeded random order. {FAULT_HELP}.")
@click.option("--count", default=6, show_default=True, type=click.IntRange(0), help="How many faults.")
@click.option("--seed", type=int, default=None, help="Seed of the fault schedule (printed when chosen at random).")
@click.option("--events", type=click.IntRange(1000), default=None,
              help="Event ids 0..N-1 (default: enough for the faults at --rate: 40-90 s of stream each, by kind).")
@click.option("--rate", default=10_000, show_default=True, type=click.IntRange(100), help="Events per second.")
@click.option("--partitions", default=2, show_default=True, type=click.IntRange(1))
@click.option("--master", default="local[2]", show_default=True,
              help="Spark master; executor_kill needs 'local-cluster[2,1,1024]'.")
@click.option("--postgres", metavar="DSN", help="PostgreSQL for the postgres sinks (a table is created).")
@click.option("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers for a Kafka source or sink.")
@click.option("--gap", default="2-6", show_default=True, callback=_gap, metavar="MIN-MAX",
              help="Seconds between the job committing again and the next fault.")
@click.option("--outage-s", default=15.0, show_default=True, type=click.FloatRange(0),
              help="How long pg_down, disk_full, slow_sink, store_outage and net_partition last "
              "(clock_skew: at least 3 lease TTLs).")
@click.option("--slow-s", default=3.0, show_default=True, type=click.FloatRange(0),
              help="Extra seconds per commit during slow_sink.")
@click.option("--skew-s", default=300.0, show_default=True, type=click.FloatRange(1),
              help="How far clock_skew jumps a host's wall clock (forward or back, seeded).")
@click.option("--pg-stop", metavar="CMD", help="Stops your PostgreSQL; '{mode}' becomes fast or immediate, "
              "e.g. 'pg_ctl -D /data -m {mode} -w stop'.")
@click.option("--pg-start", metavar="CMD", help="Starts it again, e.g. 'pg_ctl -D /data -l log -w start'.")
@click.option("--broker-stop", metavar="CMD", help="Stops your Kafka broker (its log must survive); '{mode}' "
              "becomes fast (graceful) or immediate (killed).")
@click.option("--broker-start", metavar="CMD", help="Starts it again.")
@click.option("--checkpoint-fs", metavar="SIZE", help="Put the checkpoint on a tmpfs of SIZE (e.g. 64m; root "
              "only); needed by disk_full.")
@click.option("--lease-ttl", default=6.0, show_default=True, type=click.FloatRange(1),
              help="Driver lease TTL for the run; a zombie pause lasts at least this long.")
@click.option("--recovery-timeout", default=180.0, show_default=True, type=click.FloatRange(10),
              help="Seconds the job may take to commit again after a fault (or after its start) "
              "before verify reports an anomaly; raise it on a loaded machine.")
@click.option("--standby/--no-standby", default=True, show_default=True,
              help="Run with onceflow run's warm standby driver (the default of onceflow run).")
@click.option("--wait-standby/--any-time", default=True, show_default=True,
              help="Inject each fault once the standby is warm again (steady state), or as soon as "
              "the job commits (faults also hit while the standby still warms up).")
@click.option("--dir", "workdir", default="onceflow-verify", show_default=True,
              help="Work directory (checkpoint, Delta table, logs); wiped at start.")
@click.option("--json", "json_out", metavar="FILE", help="Write the report as JSON ('-' for stdout).")
@click.option("--chart", "chart_out", metavar="FILE.png", help="Chart path (default: DIR/verify.png).")
def verify(source, sink, faults, count, seed, events, rate, partitions, master, postgres, kafka, gap,
           outage_s, slow_s, skew_s, pg_stop, pg_start, broker_stop, broker_start, checkpoint_fs, lease_ttl,
           recovery_timeout, standby, wait_standby, workdir, json_out, chart_out) -> None:
    """Run a pipeline of checksummed event ids under faults; check the sink independently.

    Exit status 0 only when every event was committed exactly once with its own payload and
    nothing (prepared transaction, orphan file) was left dangling; 1 FAILED; 3 INCONCLUSIVE
    (clean, but fewer faults than --count could be injected).
    """
    require("verify", "onceflow verify")  # before the run, not after it: the chart needs matplotlib
    from onceflow.verify import report
    from onceflow.verify.harness import Harness
    from onceflow.verify.spec import Options, VerifySpec

    console = Console(stderr=json_out == "-")
    kinds = [k.strip() for k in faults.split(",") if k.strip()]
    workdir = os.path.abspath(workdir)
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, "spec.json")):
            raise OnceflowError(f"--dir {workdir} exists and is not a verify work directory (no spec.json); "
                                "verify wipes its directory at start: give a new or earlier --dir")
        if os.path.ismount(os.path.join(workdir, "checkpoint-fs")):
            subprocess.run(["umount", "-l", os.path.join(workdir, "checkpoint-fs")], capture_output=True)
        shutil.rmtree(workdir)
    if events is None:  # room for each fault: a standby warm-up, the gap, the fault, a recovery
        events = int(rate * (30 + stream_seconds(FAULTS, kinds, count)))
    spec = VerifySpec(workdir=workdir, name=uuid.uuid4().hex[:8], source=source, sink=sink, events=events,
                      rate=rate, partitions=partitions, master=master, postgres=postgres, kafka=kafka)
    options = Options(faults=kinds, count=count if kinds else 0, seed=seed, gap=gap, outage_s=outage_s,
                      slow_s=slow_s, skew_s=skew_s, pg_stop=pg_stop, pg_start=pg_start, broker_stop=broker_stop,
                      broker_start=broker_start, checkpoint_fs=checkpoint_fs, lease_ttl_s=lease_ttl,
                      recovery_timeout=recovery_timeout,
                      standby=standby, wait_standby=wait_standby)
    # SIGTERM (a CI timeout, kill) ends the run through its clean-up: every process it started
    # is stopped, none is left running (or spinning) after verify is gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    result = Harness(spec, options, console).run()
    report.print_report(result, console)
    chart_path = chart_out or os.path.join(workdir, "verify.png")
    report.chart(result, chart_path)
    console.print(f"chart: {chart_path}")
    if json_out == "-":
        click.echo(report.to_json(result))
    elif json_out:
        with open(json_out, "w") as f:
            f.write(report.to_json(result))
    sys.exit(0 if result.ok else EXIT_INCONCLUSIVE if result.clean else 1)
