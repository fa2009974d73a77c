"""``onceflow list ROOT``: the jobs under a checkpoint root (Flink's ``flink list``)."""

from __future__ import annotations

import json
import time

import click


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


@click.command("list")
@click.argument("root", default=".", required=False)
@click.option("--depth", default=4, show_default=True, type=click.IntRange(0),
              help="How many directory levels below ROOT to search for checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one object per job).")
def list_(root: str, depth: int, as_json: bool) -> None:
    """Jobs whose checkpoint directories are at or under ROOT: name, lease holder (host, pid,
    epoch), state (running, restarting, stopped, fenced, failed), last committed batch, its
    age, and the source's lag where it reports one ('-' otherwise)."""
    from onceflow.checkpoint.jobs import list_jobs
    from onceflow.errors import CheckpointError
    from onceflow.storage import url_to_fs

    fs, path = url_to_fs(root.rstrip("/") or "/")
    if not fs.exists(path):
        raise CheckpointError(f"{root} does not exist: give a directory holding checkpoint directories")
    jobs = list_jobs(root, depth)
    if as_json:
        click.echo(json.dumps([j.to_dict() for j in jobs], indent=1))
        return
    if not jobs:
        click.echo(f"no jobs under {root} (searched {depth} levels down)")
        return
    from rich.console import Console
    from rich.table import Table

    now = time.time()
    table = Table("job", "state", "holder (host, pid, epoch)", "last batch", "age", "lag", "checkpoint")
    colors = {"running": "green", "restarting": "yellow", "failed": "red", "fenced": "magenta"}
    for j in jobs:
        holder = "-" if j.holder_pid is None else f"{j.holder_host} {j.holder_pid} e{j.holder_epoch}"
        state = f"[{colors[j.state]}]{j.state}[/]" if j.state in colors else j.state
        table.add_row(j.name, state, holder, "-" if j.last_batch is None else str(j.last_batch),
                      _age(j.age_s(now)), _lag(j), j.checkpoint)
    Console(width=200).print(table)


def _lag(j) -> str:
    if j.lag is not None:
        return f"{j.lag:g}"
    return "-" if j.lag_s is None else f"{j.lag_s:.1f} s"
