"""``onceflow savepoint create|list|inspect|dispose``, ``onceflow stop [--savepoint]``,
``onceflow cancel`` and the
``--from-savepoint/--fork/--rescale/--allow-non-restored-state`` options of ``onceflow run``."""

from __future__ import annotations

import json
import sys
import time

import click

from onceflow import logs
from onceflow.savepoint.manifest import Manifest


def _logging() -> None:
    logs.configure("onceflow")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@click.group("savepoint")
def savepoint() -> None:
    """User-owned snapshots of a stopped job: create, list, inspect, dispose.

    Restore one with 'onceflow run JOB --from-savepoint SP [--fork] [--rescale N]'.
    """


@savepoint.command("create")
@click.argument("checkpoint_dir")
@click.argument("target", required=False)
@click.option("--batch", type=int, help="A retained committed batch instead of the last one.")
@click.option("--job-name", help="Job name to record (default: from the event log).")
def create(checkpoint_dir: str, target: str | None, batch: int | None, job_name: str | None) -> None:
    """Savepoint of the stopped job on CHECKPOINT_DIR (default TARGET: ../savepoints/sp-<batch>-<time>)."""
    from onceflow.checkpoint.layout import require_checkpoint
    from onceflow.savepoint.create import create_savepoint

    _logging()
    require_checkpoint(checkpoint_dir)
    url, m = create_savepoint(checkpoint_dir, target, batch=batch, job_name=job_name)
    click.echo(f"savepoint {url}: job {m.job}, batch {m.batch}, {len(m.files)} files, {_size(m.total_bytes)}")


@savepoint.command("list")
@click.argument("directory", default=".", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(directory: str, as_json: bool) -> None:
    """Savepoints in DIRECTORY (a checkpoint directory: those in its ../savepoints)."""
    from rich.console import Console
    from rich.table import Table

    from onceflow.errors import CheckpointError
    from onceflow.savepoint.operations import list_savepoints
    from onceflow.storage import url_to_fs

    fs, path = url_to_fs(directory.rstrip("/") or ".")
    if not fs.exists(path):
        raise CheckpointError(f"{directory} does not exist: give a savepoint directory, a "
                              "savepoint or a checkpoint directory")
    found = list_savepoints(directory)
    if as_json:
        click.echo(json.dumps([
            {"path": u, "error": str(m)} if not isinstance(m, Manifest) else
            {"path": u, "job": m.job, "batch": m.batch, "lineage": m.lineage, "created": m.created,
             "bytes": m.total_bytes, "files": len(m.files)}
            for u, m in found], indent=1))
        return
    if not found:
        click.echo(f"no savepoints in {directory}")
        return
    table = Table("savepoint", "job", "batch", "created", "size", "lineage")
    for url, m in found:
        if isinstance(m, Manifest):
            table.add_row(url, m.job, str(m.batch), _when(m.created), _size(m.total_bytes), m.lineage)
        else:
            table.add_row(url, "[red]unreadable[/red]", "", "", "", str(m)[:60])
    Console(width=200).print(table)


def _flat_offsets(offsets: list) -> list[tuple[str, str]]:
    """(source[i] partition, offset) rows; Kafka-shaped offsets {"topic": {"0": 42}} flattened."""
    rows = []
    for i, off in enumerate(offsets):
        if isinstance(off, dict) and off and all(isinstance(v, dict) for v in off.values()):
            rows += [(f"source[{i}] {t}/{p}", str(o)) for t, parts in off.items() for p, o in parts.items()]
        else:
            rows.append((f"source[{i}]", json.dumps(off)))
    return rows


@savepoint.command("inspect")
@click.argument("sp")
@click.option("--no-verify", is_flag=True, help="Skip reading every file to check its SHA-256.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(sp: str, no_verify: bool, as_json: bool) -> None:
    """Batch, offsets per source partition, state operators, sizes and checksum check of SP."""
    from onceflow.savepoint.operations import inspect_savepoint

    r = inspect_savepoint(sp, verify=not no_verify)
    m = r.manifest
    if as_json:
        click.echo(json.dumps({**json.loads(m.to_json()), "verified": r.verified, "problems": r.problems}, indent=1))
    else:
        click.echo(f"savepoint   {r.url}")
        click.echo(f"job         {m.job}   lineage {m.lineage}")
        click.echo(f"batch       {m.batch}   created {_when(m.created)} from {m.created_from}")
        click.echo(f"versions    Spark {m.spark_version}, onceflow {m.onceflow_version}, format {m.format_version}")
        for where, off in _flat_offsets(m.source_offsets):
            click.echo(f"offsets     {where} = {off}")
        if not m.operators:
            click.echo("state       none (stateless job)")
        for o in m.operators:
            click.echo(f"operator    {o.id} {o.name or '?'}: {o.partitions} partitions, stores {', '.join(o.stores)}")
        if m.state_provider:
            click.echo(f"provider    {m.state_provider}")
        state = sum(f.size for f in m.files if f.path.startswith("checkpoint/state/"))
        click.echo(f"size        {_size(m.total_bytes)} in {len(m.files)} files (state {_size(state)})")
        if r.verified is None:
            click.echo("checksums   not verified (--no-verify)")
        elif r.ok:
            click.echo(f"checksums   OK ({len(m.files)} files, SHA-256)")
        else:
            click.echo(f"checksums   FAILED: {len(r.problems)} problem(s)")
            for p in r.problems:
                click.echo(f"  {p}")
    if r.problems:
        sys.exit(1)


@savepoint.command("dispose")
@click.argument("sp")
def dispose(sp: str) -> None:
    """Delete savepoint SP (savepoints are never deleted by onceflow otherwise)."""
    from onceflow.savepoint.operations import dispose_savepoint

    m = dispose_savepoint(sp)
    click.echo(f"disposed savepoint {sp} (job {m.job}, batch {m.batch})")


@click.command("stop")
@click.argument("checkpoint_dir")
@click.option("--savepoint", "target", metavar="TARGET", is_flag=False, flag_value="",
              default=None, help="Stop with a savepoint at TARGET (TARGET optional: default "
              "the job's --savepoint-dir/<job>-<batch>-<time>, or CHECKPOINT_DIR/../savepoints).")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the stop.")
def stop(checkpoint_dir: str, target: str | None, timeout: float) -> None:
    """Stop the job running on CHECKPOINT_DIR after its in-flight batch; with --savepoint, the
    driver takes a savepoint of the last committed batch as it stops. Without it, no
    savepoint is taken (unlike a plain SIGTERM to 'onceflow run')."""
    from onceflow.checkpoint.layout import require_checkpoint
    from onceflow.savepoint.operations import stop_job, stop_with_savepoint

    _logging()
    require_checkpoint(checkpoint_dir)
    if target is None:
        click.echo(f"stopped {stop_job(checkpoint_dir, timeout)}")
        return
    url, m = stop_with_savepoint(checkpoint_dir, target or None, timeout)
    click.echo("stopped")
    click.echo(f"savepoint {url}: job {m.job}, batch {m.batch}, {len(m.files)} files, {_size(m.total_bytes)}")


@click.command("cancel")
@click.argument("checkpoint_dir")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the stop.")
def cancel(checkpoint_dir: str, timeout: float) -> None:
    """Stop the job running on CHECKPOINT_DIR now, without a savepoint (Flink's 'cancel'), even
    when 'onceflow run' would take one on SIGTERM. The in-flight batch's tasks are cancelled
    and the batch is replayed by the next run (one already in its sink commit finishes it):
    nothing is half-written either way."""
    from onceflow.checkpoint.layout import require_checkpoint
    from onceflow.savepoint.operations import stop_job

    _logging()
    require_checkpoint(checkpoint_dir)
    click.echo(f"cancelled {stop_job(checkpoint_dir, timeout, savepoint=False, immediate=True)}")
