"""``onceflow demo``: exactly-once under real driver crashes, no server needed."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from onceflow.extras import require


@click.command()
@click.option("--events", default=3_000_000, show_default=True, type=click.IntRange(1000),
              help="Event ids 0..N-1 to push through the pipeline.")
@click.option("--rate", default=100_000, show_default=True, type=click.IntRange(100),
              help="Events per second the source makes available.")
@click.option("--kills", default=2, show_default=True, type=click.IntRange(0),
              help="How many times to SIGKILL the driver at random moments.")
@click.option("--dir", "workdir", default="onceflow-demo", show_default=True,
              help="Work directory (table, checkpoint, logs); wiped at start.")
@click.option("--seed", type=int, default=None, help="Random seed for the kill moments.")
@click.option("--wait-standby/--any-time", default=True, show_default=True,
              help="Kill once the warm standby driver is ready again (steady state, at most 45 s "
              "after the driver came up), or as soon as the driver commits.")
def demo(events: int, rate: int, kills: int, workdir: str, seed: int | None, wait_standby: bool) -> None:
    """Run a failover scenario: crash the driver, restart, prove exactly-once."""
    require("delta", "onceflow demo (it writes a Delta table)")
    from onceflow.demo import DemoRunner, print_result

    console = Console()
    console.print(f"onceflow demo: {events:,} events at {rate:,}/s -> running count per key -> "
                  f"Delta table in {workdir}/events; {kills} driver SIGKILLs")
    result = DemoRunner(workdir, events, rate, kills, seed, console, wait_standby).run()
    print_result(result, console)
    if len(result.kills) < kills:
        console.print(f"note: {len(result.kills)} of {kills} kills: the stream ended before the next kill "
                      "could wait for a ready standby (use a larger --events, or --any-time)")
    sys.exit(0 if result.ok else 1)
