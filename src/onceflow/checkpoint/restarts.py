"""Where each restart spent its time, from the checkpoint's event log.

A restart begins when a failure is seen: the supervisor's ``restart`` event for a driver
process that died (``crashed_at``: when it noticed, within 50 ms), or the runner's
``restart`` event for a query restarted inside a live driver. The phases that follow, each
as seconds after that moment (``None`` when the log does not have it):

* ``driver_ready``: the new driver holds the lease and its SparkSession (``start``; a promoted
  standby has both at once, a cold start pays the JVM here); ``lease_s``: taking the lease;
* ``sink_recovered``: the sink took a new fencing epoch and recovered (``sink_open``);
* ``query_started``: ``writeStream.start()`` returned (state is restored inside the first batch);
* ``first_planned``: the first batch's offsets, source batch and plan were ready;
* ``first_commit``: the first batch committed by the sink (``sink_commit``).

``kill_ts`` (the demo and benchmarks know when they killed) moves the start to the kill.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass
class Restart:
    at: float  # failure seen (or kill time), epoch seconds
    scope: str  # process | query
    cause: str
    standby: bool = False
    lease_s: float | None = None
    driver_ready: float | None = None
    sink_recovered: float | None = None
    query_started: float | None = None
    first_planned: float | None = None
    first_commit: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    PHASES = ("driver_ready", "sink_recovered", "query_started", "first_planned", "first_commit")

    def describe(self) -> str:
        parts = [f"{p.replace('_', ' ')} +{getattr(self, p):.1f}s" for p in self.PHASES
                 if getattr(self, p) is not None]
        return ", ".join(parts) + (" (standby)" if self.standby else "")


def _after(events: Sequence[dict], kind: str, ts: float, until: float) -> dict | None:
    return next((e for e in events if e["event"] == kind and ts <= e["ts"] < until), None)


def restarts(events: Iterable[dict], kill_ts: Sequence[float] = ()) -> list[Restart]:
    """Every restart in ``events`` (oldest first), or one per ``kill_ts`` when given."""
    events = sorted(events, key=lambda e: e["ts"])
    starts = [e for e in events if e["event"] == "restart"]
    if kill_ts:
        marks = [(k, next((s for s in starts if s["ts"] >= k), None)) for k in kill_ts]
    else:
        marks = [(s.get("crashed_at", s["ts"]), s) for s in starts]
    out = []
    for i, (at, mark) in enumerate(marks):
        until = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        r = Restart(at=at, scope=(mark or {}).get("scope", "process"), cause=(mark or {}).get("cause", "killed"))
        begin = mark["ts"] if mark else at
        proc = _after(events, "process_start", begin, until)
        r.standby = bool(proc and proc.get("standby"))
        start = _after(events, "start", begin, until) if r.scope == "process" else None
        if start is not None:
            r.driver_ready, r.lease_s = start["ts"] - at, start.get("lease_s")
        opened = _after(events, "sink_open", begin, until)
        if opened is not None:
            r.sink_recovered = opened["ts"] - at
            rec = _after(events, "recovered", opened["ts"], until)
            phases = (rec or {}).get("phases", {})
            if "query_start_s" in phases:
                r.query_started = r.sink_recovered + phases["query_start_s"]
                if "plan_s" in phases:
                    r.first_planned = r.query_started + phases["plan_s"]
            commit = _after(events, "sink_commit", opened["ts"], until)
            if commit is not None:
                r.first_commit = commit["ts"] - at
        out.append(r)
    return out


def restart_table(recent: Sequence[Restart]):
    """Restarts with their phases, in seconds after the failure was seen (or the kill)."""
    from rich.table import Table

    table = Table("at", "restart", "cause", "ready", "sink", "query", "planned", "commit",
                  title="restarts (seconds after the failure was seen)",
                  caption="ready: the driver holds the lease and its SparkSession; sink: recovered; "
                          "query: started; planned: first batch planned; commit: first batch committed")

    def sec(v: float | None) -> str:
        return "" if v is None else f"{v:.1f}"
    for r in recent:
        how = "in-process" if r.scope == "query" else "standby" if r.standby else "cold"
        table.add_row(time.strftime("%H:%M:%S", time.localtime(r.at)), how, r.cause[:40],
                      sec(r.driver_ready), sec(r.sink_recovered), sec(r.query_started),
                      sec(r.first_planned), sec(r.first_commit))
    return table
