"""A verify run's report: terminal table, JSON, and a PNG chart with a marker at each fault."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from onceflow.extras import require
from onceflow.verify.harness import VerifyResult


def summary(result: VerifyResult) -> dict:
    r = result.report
    recoveries = [f.recovery_s for f in result.faults if f.recovery_s is not None]
    return {
        "verdict": result.verdict,
        "shortfall": result.shortfall or None,
        "seed": result.seed,
        "pipeline": f"{result.spec.source} -> {result.spec.sink}",
        "events_generated": r.expected,
        "events_committed": r.committed,
        "duplicates": r.duplicates,
        "missing": r.missing,
        "unexpected_ids": r.unexpected,
        "corrupted_payloads": r.corrupted,
        "state_errors": r.state_errors,
        "records_processed_incl_replays": result.processed,
        "restarts": result.restarts,
        "faults": len(result.faults),
        "recovery_s_median": round(statistics.median(recoveries), 2) if recoveries else None,
        "recovery_s_max": max(recoveries) if recoveries else None,
        "dangling": result.dangling,
        "anomalies": result.anomalies,
        "supervisor_exit": result.supervisor_rc,
        "wall_s": round(result.ended - result.started, 1),
        "samples": {"missing": r.sample_missing, "duplicated": r.sample_duplicates,
                    "corrupted": r.sample_corrupted},
        "fault_log": [{**asdict(f), "recovery_s": f.recovery_s} for f in result.faults],
    }


def to_json(result: VerifyResult) -> str:
    return json.dumps(summary(result), indent=1)


def print_report(result: VerifyResult, console: Console) -> None:
    s = summary(result)
    t = Table(title=f"onceflow verify: {s['pipeline']} (seed {s['seed']}), independent check", show_header=False)
    upsert = result.spec.sink.endswith("-upsert")  # one row per key: see check_upserts
    rows = [
        ("keys expected (last event no delete)" if upsert else "events generated", f"{s['events_generated']:,}"),
        ("rows in the table" if upsert else "events committed", f"{s['events_committed']:,}"),
        ("duplicates (a key twice)" if upsert else "duplicates", f"{s['duplicates']:,}"),
        ("missing", f"{s['missing']:,}"),
        ("corrupted payloads", f"{s['corrupted_payloads']:,}"),
        ("deleted or unknown keys present" if upsert else "ids never generated", f"{s['unexpected_ids']:,}"),
        *([("stale rows + batches not applied once", f"{s['state_errors']:,}")] if upsert else []),
        ("records processed incl. replays", f"{s['records_processed_incl_replays']:,}"),
        ("faults injected", str(s["faults"])),
        ("restarts (driver and query)", str(s["restarts"])),
        ("recovery, fault -> next commit", f"median {s['recovery_s_median']} s, max {s['recovery_s_max']} s"
         if s["recovery_s_median"] is not None else "-"),
        ("dangling transactions/files", str(len(s["dangling"]))),
        ("wall time", f"{s['wall_s']} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if result.faults:
        f = Table(title="faults")
        for col in ("#", "at (s)", "fault", "what it hit", "recovery (s)"):
            f.add_column(col)
        for i, rec in enumerate(result.faults, 1):
            f.add_row(str(i), f"{rec.start - result.started:.1f}", rec.kind, rec.detail,
                      "-" if rec.recovery_s is None else f"{rec.recovery_s:.1f}")
        console.print(f)
    for a in result.anomalies:
        console.print(f"[red]anomaly: {a}[/red]")
    if result.dangling:
        console.print(f"[red]dangling: {', '.join(result.dangling[:5])}[/red]")
    if result.ok:
        console.print("[green]EXACTLY ONCE: every event committed once with its own payload, nothing "
                      "dangling.[/green]")
    elif result.clean:
        console.print(f"[yellow]INCONCLUSIVE: the data is clean, but {result.shortfall}.[/yellow]")
    else:
        r = result.report
        console.print(f"[red]FAILED: missing {r.sample_missing}, duplicated {r.sample_duplicates}, "
                      f"corrupted {r.sample_corrupted}; supervisor exit {result.supervisor_rc}[/red]")


def chart(result: VerifyResult, path: str) -> None:
    """Committed events (cumulative) and throughput per second, a vertical line per fault."""
    require("charts", "onceflow verify's chart")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t0 = result.started
    ts = np.array([c[0] - t0 for c in result.commits], dtype=float)
    rows = np.array([c[1] for c in result.commits], dtype=float)
    order = np.argsort(ts)
    ts, rows = ts[order], rows[order]
    end = max(result.ended - t0, float(ts[-1]) if ts.size else 1.0)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6))
    top.step(ts, np.cumsum(rows), where="post", color="tab:blue")
    top.set_ylabel("events committed")
    bins = np.arange(0, end + 1.0, 1.0)
    per_s, _ = np.histogram(ts, bins=bins, weights=rows)
    bottom.bar(bins[:-1], per_s, width=1.0, align="edge", color="tab:green")
    bottom.set_ylabel("events/s committed")
    bottom.set_xlabel("seconds since start")
    colors = {}
    for f in result.faults:
        color = colors.setdefault(f.kind, f"C{(len(colors) + 3) % 10}")
        for ax in (top, bottom):
            ax.axvspan(f.start - t0, max(f.end - t0, f.start - t0 + 0.3), color=color, alpha=0.35)
        top.annotate(f.kind, (f.start - t0, 0), rotation=90, fontsize=7, va="bottom", color=color)
    top.set_title(f"onceflow verify {result.spec.source} -> {result.spec.sink}, seed {result.seed}: "
                  f"{result.verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
