"""``onceflow checkpoints CHECKPOINT_DIR`` (batch history) and ``onceflow state export``."""

from __future__ import annotations

import json
import time

import click

from onceflow.extras import require


def _offsets(offsets: list) -> str:
    text = "; ".join(json.dumps(o, separators=(",", ":")) if not isinstance(o, str) else o for o in offsets)
    return text if len(text) <= 60 else text[:57] + "..."


@click.command("checkpoints")
@click.argument("checkpoint_dir")
@click.option("--limit", default=20, show_default=True, help="How many recent batches (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--chart", metavar="FILE.png", help="Also draw batch durations, rows and restarts over time.")
def checkpoints(checkpoint_dir: str, limit: int, as_json: bool, chart: str | None) -> None:
    """Recent batches of CHECKPOINT_DIR (time, duration, rows, offsets, state, sink commit),
    then recent restarts with where each spent its time (driver ready, sink recovered, query
    started, first batch planned, first commit)."""
    from rich.console import Console
    from rich.table import Table

    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.checkpoint.history import batch_history
    from onceflow.checkpoint.layout import require_checkpoint
    from onceflow.checkpoint.restarts import restart_table, restarts

    require_checkpoint(checkpoint_dir)
    if chart:
        require("charts", "onceflow checkpoints --chart")
    rows = batch_history(checkpoint_dir, limit or None)
    events = list(EventLog(checkpoint_dir).read())
    recent = restarts(events)
    if chart:
        drawn = _chart(batch_history(checkpoint_dir, None), events, chart, checkpoint_dir)
        click.echo(f"chart {chart}: {drawn} batches", err=True)
    recent = recent[-limit:] if limit else recent
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=1, default=str))
        return
    if not rows:
        click.echo(f"no batches in {checkpoint_dir}")
        return
    table = Table("batch", "status", "time", "duration", "input rows", "offsets", "state rows",
                  "state bytes (checkpoint)", "sink commit", title=f"checkpoint {checkpoint_dir}")
    for r in rows:
        commit = "" if r.sink_commit_s is None else f"{r.sink_commit_s:.3f}s"
        if r.replays:
            commit += f" ({r.replays} replay{'s' if r.replays > 1 else ''})"
        table.add_row(
            str(r.batch), r.status,
            time.strftime("%H:%M:%S", time.localtime(r.time)) if r.time else "",
            f"{r.duration_ms} ms" if r.duration_ms is not None else "",
            "" if r.input_rows is None else str(r.input_rows), _offsets(r.offsets),
            "" if r.state_rows is None else str(r.state_rows),
            "" if r.state_bytes is None else str(r.state_bytes), commit.strip(),
        )
    console = Console(width=200)
    console.print(table)
    for line in _state_lines(checkpoint_dir, events):
        console.print(line)
    if recent:
        console.print(restart_table(recent))


def _state_lines(checkpoint_dir: str, events: list[dict]) -> list[str]:
    """Per stateful operator: bytes on the checkpoint for the last committed batch (the files
    Spark loads; listed now) and keys as the last batch's progress reported them."""
    from onceflow.checkpoint.layout import CheckpointDir
    from onceflow.runtime.metrics import checkpoint_state_bytes

    ckpt = CheckpointDir(checkpoint_dir)
    try:
        batch = ckpt.last_committed()
        sizes = checkpoint_state_bytes(ckpt, batch) if batch is not None else {}
    except Exception as err:  # noqa: BLE001 - the table above is still worth showing
        return [f"state size: not measured ({err})"]
    ops: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "batch" and e.get("state"):
            ops = {int(o.get("id", 0)): o for o in e["state"]}
    return [f"state after batch {batch}, operator {op} ({ops.get(op, {}).get('name') or '?'}): "
            f"{n:,} bytes on the checkpoint, {ops[op]['rows']:,} keys" if op in ops and ops[op].get("rows") is not None
            else f"state after batch {batch}, operator {op}: {n:,} bytes on the checkpoint"
            for op, n in sorted(sizes.items())]


def _chart(rows: list, events: list[dict], path: str, title: str) -> int:
    """Batch duration and input rows over time (one point per batch run that logged its
    progress), a vertical line per restart (red: driver process, orange: query in the driver)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sorted((r for r in rows if r.time is not None), key=lambda r: r.time)
    if not done:
        raise click.ClickException(f"no batch progress in the event log of {title}: nothing to draw")
    t0 = min([done[0].time] + [e["ts"] for e in events if e.get("event") == "restart"])
    ts = [r.time - t0 for r in done]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6))
    top.plot(ts, [r.duration_ms or 0 for r in done], ".-", color="tab:blue", lw=0.8)
    top.set_ylabel("batch duration (ms)")
    bottom.bar(ts, [r.input_rows or 0 for r in done], width=0.8, color="tab:green")
    bottom.set_ylabel("input rows per batch")
    bottom.set_xlabel("seconds since the first batch or restart shown")
    for e in events:
        if e.get("event") == "restart":
            color = "tab:red" if e.get("scope") == "process" else "tab:orange"
            for ax in (top, bottom):
                ax.axvline(e["ts"] - t0, color=color, lw=1, alpha=0.8)
            top.annotate(str(e.get("cause", "restart"))[:40], (e["ts"] - t0, 0.03), rotation=90,
                         xycoords=("data", "axes fraction"), fontsize=8, va="bottom", ha="right",
                         color=color)
    top.set_title(f"checkpoint {title}: {len(done)} batches, "
                  f"{sum(e.get('event') == 'restart' for e in events)} restarts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(done)


@click.group("state")
def state() -> None:
    """Operator state (read side of Flink's State Processor API)."""


@state.command("export")
@click.argument("location", metavar="CHECKPOINT_OR_SAVEPOINT")
@click.option("--operator", "operator", type=int, required=True, help="Stateful operator id.")
@click.option("--out", required=True, metavar="FILE.parquet", help="Parquet file to write.")
@click.option("--store", help="State store name (joins have several; default: 'default').")
@click.option("--batch", type=int, help="Batch whose state to read (default: last committed/saved).")
def export(location: str, operator: int, out: str, store: str | None, batch: int | None) -> None:
    """Write one operator's state rows (key, value, partition_id) to a Parquet file."""
    from onceflow.savepoint.export import export_state, state_location
    from onceflow.spark import get_spark

    state_location(location)  # a typo fails here, before Spark starts
    spark = get_spark("local[2]", "onceflow-state-export")
    rows = export_state(spark, location, operator, out, store=store, batch=batch)
    click.echo(f"exported {rows} state rows of operator {operator} to {out}")
