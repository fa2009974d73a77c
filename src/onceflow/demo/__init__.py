"""``onceflow demo``: a failover scenario (event ids, driver SIGKILLs, the proof), on embedded defaults, with real crashes.

A supervised driver runs :mod:`onceflow.demo.job` (consecutive event ids -> running count
per key -> Delta table). The demo SIGKILLs the driver's whole process group (driver, JVM,
Python workers: a machine crash) at random moments; the supervisor restarts it. At the end
an independent check reads the Delta table with delta-rs and reports expected, committed,
duplicates, missing, records processed including replays, restarts and recovery times.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.restarts import Restart, restart_table, restarts
from onceflow.verify.exactly_once import Report, check_delta_table


@dataclass
class DemoResult:
    report: Report
    processed: int
    restarts: int
    kills: list[float] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    supervisor_rc: int = 0
    phases: list[Restart] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.ok and self.supervisor_rc == 0


#: the longest a kill waits for the replacement standby to be ready: beside an active driver
#: that keeps both cores busy a standby needs 30-35 s from its start (process, JVM and session
#: about 10 s, then its warm-up batches); the first one, beside a cold driver, longer
STANDBY_WAIT_S = 45.0


class DemoRunner:
    """Runs the supervised demo job and kills its driver ``kills`` times at random moments."""

    def __init__(self, workdir: str, events: int, rate: int, kills: int, seed: int | None,
                 console: Console | None = None, wait_standby: bool = True):
        self.workdir = os.path.abspath(workdir)
        self.events, self.rate, self.kills = events, rate, kills
        self.wait_standby = wait_standby
        self.rng = random.Random(seed)
        self.console = console or Console(stderr=True)
        self.ckpt = os.path.join(self.workdir, "checkpoint")
        self.table = os.path.join(self.workdir, "events")
        self.log = EventLog(self.ckpt)

    def _events(self, kind: str) -> list[dict]:
        return [e for e in self.log.read() if e["event"] == kind]

    def _committed(self) -> int:
        return sum(e["rows"] for e in self._events("sink_commit") if not e.get("replay"))

    def run(self) -> DemoResult:
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.makedirs(self.workdir)
        from onceflow.demo import job as job_module

        env = {**os.environ, "ONCEFLOW_DEMO_DIR": self.workdir, "ONCEFLOW_TASK_EVENTS": "1",
               "ONCEFLOW_DEMO_EVENTS": str(self.events), "ONCEFLOW_DEMO_RATE": str(self.rate)}
        log_path = os.path.join(self.workdir, "supervisor.log")
        started = time.time()
        with open(log_path, "w") as out:
            sup = subprocess.Popen(
                [sys.executable, "-m", "onceflow", "run", job_module.__file__],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )
            kill_times = self._drive(sup)
            rc = sup.wait()
        if rc != 0:
            self.console.print(f"[red]supervisor exited with {rc}; see {log_path}[/red]")
        report = check_delta_table(self.table, self.events)
        processed = sum(e["rows"] for e in self._events("task"))
        phases = restarts(self.log.read(), kill_times)
        recovery = [round(r.first_commit, 1) for r in phases if r.first_commit is not None]
        n_restarts = len([e for e in self._events("restart")])
        return DemoResult(report, processed, n_restarts, kill_times, recovery,
                          round(time.time() - started, 1), rc, phases)

    def _drive(self, sup: subprocess.Popen) -> list[float]:
        """Show progress; kill the driver at random moments while data still flows."""
        kill_times: list[float] = []
        next_kill: float | None = None
        up_since: float | None = None
        columns = (TextColumn("[bold]committed"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=False) as progress:
            task = progress.add_task("events", total=self.events, info="starting Spark")
            while sup.poll() is None:
                time.sleep(0.5)
                committed = self._committed()
                starts = self._events("process_start")
                # "up": this driver incarnation has committed real data since it started.
                up = bool(starts) and any(
                    c["ts"] > starts[-1]["ts"] and (c["rows"] or c.get("replay"))
                    for c in self._events("sink_commit")
                )
                # Kill in steady state: once the warm standby is ready again (at most
                # STANDBY_WAIT_S after the driver came up), as a production job spends nearly all its time.
                if up and up_since is None:
                    up_since = time.time()
                elif not up:
                    up_since = None
                warm = any(e["ts"] > starts[-1]["ts"] for e in self._events("standby_ready")) if starts else False
                steady = up and (not self.wait_standby or warm or time.time() - up_since > STANDBY_WAIT_S)
                info = f"restarts {len(kill_times)}/{self.kills}" + (
                    "" if steady else " · standby warming up" if up else " · (re)starting driver")
                progress.update(task, completed=committed, info=info)
                if len(kill_times) >= self.kills or not steady or committed >= self.events * 0.95:
                    next_kill = None
                    continue
                if next_kill is None:
                    next_kill = time.time() + self.rng.uniform(1.0, 5.0)
                elif time.time() >= next_kill:
                    pid = starts[-1]["pid"]
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    kill_times.append(time.time())
                    progress.console.print(
                        f"[yellow]SIGKILL driver process group {pid} at {committed:,} committed events[/yellow]"
                    )
                    next_kill = None
            progress.update(task, completed=self._committed(), info=f"restarts {len(kill_times)}")
        return kill_times


def print_result(result: DemoResult, console: Console) -> None:
    r = result.report
    t = Table(title="onceflow demo: independent check of the Delta table", show_header=False)
    rows = [
        ("events expected", f"{r.expected:,}"),
        ("events committed", f"{r.committed:,}"),
        ("duplicates", f"{r.duplicates:,}"),
        ("missing", f"{r.missing:,}"),
        ("running counts off (state applied twice or lost)", f"{r.state_errors:,}"),
        ("records processed incl. replays", f"{result.processed:,}"),
        ("driver kills (SIGKILL)", str(len(result.kills))),
        ("restarts", str(result.restarts)),
        ("recovery time per restart (kill -> next commit)", ", ".join(f"{s}s" for s in result.recovery_s) or "-"),
        ("wall time", f"{result.elapsed_s}s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if result.phases:
        console.print(restart_table(result.phases))
    if result.ok:
        console.print("[green]EXACTLY ONCE: every event id committed once; records processed more than "
                      "once were replays whose effects were not duplicated.[/green]")
    else:
        console.print(f"[red]FAILED: missing {r.sample_missing}, duplicated {r.sample_duplicates}[/red]")
