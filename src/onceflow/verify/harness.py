"""The verify harness: run the pipeline under ``onceflow run``, inject faults, check the output.

Guarantees of the harness itself:
* The fault schedule (kinds and the pauses between faults) comes from one seeded RNG: the same
  seed and options give the same schedule. Fault *instants* still depend on when batches
  commit, so a repeat hits the same kinds in the same order, not the same microsecond.
* A fault is injected only while the job is up (it committed a batch since the previous fault
  ended), so every fault tests a recovery, not a pile-up on a job still starting.
* Nothing is concluded from onceflow's own view: the verdict comes from an independent reader
  of the sink (:mod:`onceflow.verify.readers`) and the event ids' payload checksums.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from onceflow.checkpoint.eventlog import EventLog
from onceflow.errors import ConfigError, OnceflowError
from onceflow.verify import netfaults, procs, setup
from onceflow.verify.clock import clock_shim, faketime_env, set_offset
from onceflow.verify.exactly_once import Report, check_events, check_upserts
from onceflow.verify.faults import FAULTS, FaultMissed
from onceflow.verify.readers import dangling, delta_decided, iceberg_decided, read_output
from onceflow.verify.spec import UPSERT_DELETE_EVERY, Options, VerifySpec, upsert_keys
from onceflow.verify.writers import split_foreign


@dataclass
class FaultRecord:
    kind: str
    start: float
    end: float
    detail: str
    #: commits after this instant count as the recovery (the fault's end; for a zombie, the
    #: moment the old host froze: the successor's first commit is the recovery)
    settled: float = 0.0
    #: a driver-level fault: the driver that was hit. Its in-flight commit may still land just
    #: after the kill (the commit runner is not in the driver's process group): not a recovery
    stale_driver: int | None = None
    recovered: float | None = None
    #: only commits logged at or after this position of the event log count (a clock skew:
    #: commits logged during it carry skewed timestamps)
    seq: int = 0

    def recovered_by(self, commit: dict) -> bool:
        return commit["ts"] > max(self.settled, self.start) and commit.get("_seq", 0) >= self.seq and (
            self.stale_driver is None or commit.get("driver") != self.stale_driver)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else round(self.recovered - self.start, 2)


@dataclass
class VerifyResult:
    spec: VerifySpec
    seed: int
    report: Report
    faults: list[FaultRecord]
    commits: list[tuple[float, int]]  # (ts, rows) of every non-replay sink commit
    started: float
    ended: float
    processed: int
    restarts: int
    dangling: list[str]
    anomalies: list[str]
    supervisor_rc: int | None
    #: why fewer faults than planned were injected ("" when all were)
    shortfall: str = ""

    @property
    def ok(self) -> bool:
        """Clean data and a clean job, every planned fault injected."""
        return self.clean and not self.shortfall

    @property
    def clean(self) -> bool:
        """No data anomaly, nothing dangling, no unfenced zombie, no stuck or failed job."""
        return self.report.ok and not self.dangling and not self.anomalies and self.supervisor_rc == 0

    @property
    def verdict(self) -> str:
        """``exactly-once``; ``FAILED`` (an anomaly of the data or the job); ``INCONCLUSIVE``
        (clean, but not every planned fault could be injected: the run proves less)."""
        if not self.clean:
            return "FAILED"
        return "INCONCLUSIVE" if self.shortfall else "exactly-once"


class Harness:
    """One verify run. Use :meth:`run`."""

    def __init__(self, spec: VerifySpec, options: Options, console: Console | None = None):
        unknown = [f for f in options.faults if f not in FAULTS]
        if unknown:
            raise ConfigError(f"verify: unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        self.spec, self.options = spec, options
        self.seed = options.seed if options.seed is not None else random.SystemRandom().randrange(10**6)
        self.rng = random.Random(self.seed)
        self.console = console or Console(stderr=True)
        self.slow_file = os.path.join(spec.workdir, "slow-commit")
        self.supervisors: list[subprocess.Popen] = []
        self.extras: list[subprocess.Popen] = []
        self.anomalies: list[str] = []
        self.shortfall = ""
        #: set by a fault whose recovery starts before it ends (see FaultRecord.settled)
        self.settled: float | None = None
        self.settled_seq: int | None = None
        self.proxies: dict = {}
        self.foreign: list[int] = []
        self.faketime_file = (os.path.join(spec.workdir, "faketime-job")
                              if "clock_skew" in options.faults else None)
        self._events: list[dict] = []
        self._offset = 0
        for name in dict.fromkeys(options.faults):
            why = FAULTS[name].unavailable(self)
            if why:
                raise ConfigError(f"verify: fault {name} {why}")

    @property
    def supervisor(self) -> subprocess.Popen:
        return self.supervisors[-1]

    # ---- processes ---------------------------------------------------------------------------

    def start_supervisor(self, host: str | None = None, pid_namespace: bool = False,
                         faketime: str | None = None, extra: bool = False) -> subprocess.Popen:
        """``onceflow run`` of the verify job; on another UTS host name when ``host`` is set,
        as the init of a new PID namespace with ``pid_namespace``, on ``faketime``'s clock (else
        the job's offset file when clock_skew runs). ``extra``: a process beside the job (no
        standby of its own, in :attr:`extras`, not the current supervisor)."""
        job_file = importlib.util.find_spec("onceflow.verify.job").origin  # not imported here
        cmd = [sys.executable, "-m", "onceflow", "run", job_file, "--no-savepoint-on-stop",
               "--wait-for-lease", str(self.options.recovery_timeout)]
        cmd.append("--standby" if self.options.standby and not extra else "--no-standby")
        if host:
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd]
        if pid_namespace:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", *cmd]
        env = {**os.environ, "ONCEFLOW_VERIFY_SPEC": os.path.join(self.spec.workdir, "spec.json"),
               "ONCEFLOW_TASK_EVENTS": "1", "ONCEFLOW_LEASE_TTL_S": str(self.options.lease_ttl_s),
               "ONCEFLOW_SLOW_COMMIT_FILE": self.slow_file}
        clock = faketime or self.faketime_file
        if clock:
            env.update(faketime_env(clock))
        name = f"successor-{len(self.extras)}" if extra else f"supervisor-{len(self.supervisors)}"
        log_path = os.path.join(self.spec.workdir, f"{name}.log")
        out = open(log_path, "w")
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        proc.log_path = log_path  # type: ignore[attr-defined]
        (self.extras if extra else self.supervisors).append(proc)
        return proc

    def events(self) -> list[dict]:
        """Every event logged so far (read incrementally: the log only grows)."""
        try:
            with open(self.log.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self._events
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            event["_seq"] = len(self._events)  # its position: timestamps of a skewed clock lie
            self._events.append(event)
        return self._events

    def _commits(self, after: float = 0.0) -> list[dict]:
        return [e for e in self.events() if e["event"] == "sink_commit" and e["ts"] > after]

    def wait_commit(self, after: float, proc: subprocess.Popen, timeout: float = 180.0) -> bool:
        """Wait until a batch commits after ``after``; False when ``proc`` ended first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(c["rows"] or c.get("replay") for c in self._commits(after)):
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.3)
        return False

    # ---- the run -----------------------------------------------------------------------------

    def schedule(self) -> list[tuple[str, float]]:
        """(fault kind, pause before it) for each fault: from the seed alone."""
        kinds = list(self.options.faults)
        out = []
        for i in range(self.options.count):
            if i % len(kinds) == 0:
                self.rng.shuffle(kinds)
            out.append((kinds[i % len(kinds)], round(self.rng.uniform(*self.options.gap), 2)))
        return out

    def run(self) -> VerifyResult:
        plan = self.schedule()
        self.console.print(f"onceflow verify: seed {self.seed} (repeat with --seed {self.seed}); "
                           f"{self.spec.events:,} events {self.spec.source} -> {self.spec.sink}; faults: "
                           + (", ".join(k for k, _ in plan) or "none"))
        started = time.time()
        with setup.environment(self.spec, self.options, self.console), \
                netfaults.proxies(self.spec, self.options) as self.proxies:
            if self.faketime_file:
                clock_shim(self.spec.workdir)
                set_offset(self.faketime_file, 0)
            self.log = EventLog(self.spec.checkpoint)
            if os.path.exists(self.spec.release_file):  # a previous run's, in the same work directory
                os.remove(self.spec.release_file)
            self.start_supervisor()
            try:
                records = self._inject_all(plan)
            finally:
                rc = self._finish()
            events = list(self.events())  # before a tmpfs checkpoint is unmounted
        ended = time.time()
        table, foreign_problems = split_foreign(read_output(self.spec), self.foreign)
        self.anomalies.extend(foreign_problems)
        if self.spec.sink.endswith("-upsert"):
            decided = iceberg_decided(self.spec) if self.spec.sink == "iceberg-upsert" else delta_decided(self.spec)
            report = check_upserts(table, self.spec.events, upsert_keys(self.spec.events), UPSERT_DELETE_EVERY,
                                   decided)
        else:
            report = check_events(table, self.spec.events)
        commits = [(e["ts"], e["rows"]) for e in events if e["event"] == "sink_commit" and not e.get("replay")]
        for r in records:
            r.recovered = next((c["ts"] for c in events if c["event"] == "sink_commit" and r.recovered_by(c)), None)
        processed = sum(e.get("rows", 0) for e in events if e["event"] == "task")
        restarts = sum(1 for e in events if e["event"] == "restart")
        return VerifyResult(self.spec, self.seed, report, records, commits, started, ended, processed,
                            restarts, dangling(self.spec), self.anomalies, rc, self.shortfall)

    def _inject_all(self, plan: list[tuple[str, float]]) -> list[FaultRecord]:
        records: list[FaultRecord] = []
        columns = (TextColumn("[bold]committed"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        last: FaultRecord | None = None
        with Progress(*columns, console=self.console) as progress:
            bar = progress.add_task("events", total=self.spec.events, info="starting Spark")
            queue, missed = list(plan), 0
            while queue:
                kind, pause = queue.pop(0)
                progress.update(bar, info=f"faults {len(records)}/{len(plan)} · waiting for a commit")
                if not self._wait_up(last, progress, bar):
                    break
                deadline = time.time() + pause
                while time.time() < deadline and not self._ended():
                    progress.update(bar, completed=self._committed())
                    time.sleep(0.2)
                if self._ended():
                    break  # the stream is (nearly) done: a fault now would test nothing
                start, self.settled, self.settled_seq = time.time(), None, None
                victim = procs.active_driver(self.log, self.supervisor.pid) if FAULTS[kind].kills_driver else None
                try:
                    detail = FAULTS[kind].inject(self)
                except (FaultMissed, ProcessLookupError, psutil.NoSuchProcess) as e:
                    # e.g. no driver at that instant (restarting): try again a second later
                    missed += 1
                    again = missed <= 3 * len(plan)
                    progress.console.print(f"[dim]{kind}: missed ({e or 'its target was gone'})"
                                           f"{'; retrying' if again else '; skipped'}[/dim]")
                    if again:
                        queue.insert(0, (kind, 1.0))
                    continue
                except (OnceflowError, OSError, subprocess.SubprocessError) as e:
                    self.anomalies.append(f"fault {kind} could not be injected: {e}")
                    continue
                end = time.time()
                last = FaultRecord(kind, start, end, detail, self.settled or end, victim, seq=self.settled_seq or 0)
                records.append(last)
                progress.console.print(f"[yellow]fault {len(records)}: {kind}: {detail}[/yellow]")
            if len(records) < len(plan):
                self.shortfall = (f"only {len(records)} of {len(plan)} faults were injected (skipped "
                                  "faults, or the stream ended first: raise --events or lower --rate)")
            if records:  # a run without faults keeps its --rate throughout
                self._release(last, progress, bar)
            progress_at, seen = time.time(), self._committed()
            while self.supervisor.poll() is None and time.time() - progress_at < self.options.recovery_timeout:
                progress.update(bar, completed=seen, info="draining the stream")
                time.sleep(0.5)
                if self._committed() != seen:
                    progress_at, seen = time.time(), self._committed()
            progress.update(bar, completed=self._committed(), info="done")
        return records

    def _release(self, last: FaultRecord | None, progress: Progress, bar) -> None:
        """Once a batch with rows committed after the ``last`` fault, let the sequence source
        make the rest of the stream available at once
        (:attr:`VerifySpec.release_file`): ``--events`` sizes the stream for the slowest
        recoveries, and a run whose faults are done early does not wait for its tail at
        ``--rate``. Every event is still checked."""
        deadline = time.time() + self.options.recovery_timeout
        while last is not None and time.time() < deadline and self.supervisor.poll() is None:
            if any(c["rows"] and last.recovered_by(c) for c in self._commits()):
                break
            progress.update(bar, completed=self._committed(), info="waiting for the last recovery")
            time.sleep(0.3)
        with open(self.spec.release_file, "w") as f:
            f.write(f"{time.time():.3f}\n")

    def _ended(self) -> bool:
        """The stream is (nearly) all committed, or the job's supervisor exited."""
        return self._committed() >= self.spec.events * 0.97 or self.supervisor.poll() is not None

    def _committed(self) -> int:
        return sum(c["rows"] for c in self._commits() if not c.get("replay"))

    def _standby_ready(self) -> bool:
        """The current supervisor has a warm standby that is not yet promoted."""
        events = self.events()
        ready = {e["pid"] for e in events if e["event"] == "standby_ready"}
        promoted = {e["pid"] for e in events if e["event"] == "process_start" and e.get("standby")}
        sup = self.supervisor.pid
        mine = procs.ns_pids(sup)  # pids as the event log knows them (a PID namespace's own)
        return any(pid not in promoted and pid in mine and mine[pid] != sup for pid in ready)

    def _wait_up(self, last: FaultRecord | None, progress: Progress, bar) -> bool:
        """Wait until a batch with rows committed after the ``last`` fault and, with
        ``wait_standby``, the standby is warm again (faults in steady state, not mid warm-up)."""
        deadline = time.time() + self.options.recovery_timeout
        while time.time() < deadline:
            progress.update(bar, completed=self._committed())
            if any(c["rows"] and (last is None or last.recovered_by(c)) for c in self._commits()) and (
                    not (self.options.standby and self.options.wait_standby) or self._standby_ready()):
                return True
            if self.supervisor.poll() is not None:
                return False
            time.sleep(0.3)
        self.anomalies.append(f"no batch committed within {self.options.recovery_timeout:.0f}s of "
                              + ("the job's start" if last is None else "the previous fault")
                              + " (--recovery-timeout)")
        return False

    def _finish(self) -> int | None:
        """The current supervisor's exit code; stops every supervisor still running."""
        rc = self.supervisor.poll()
        if rc is None:
            self.anomalies.append("the job did not finish after the stream ended")
        elif rc != 0:
            log = os.path.join(self.spec.workdir, f"supervisor-{len(self.supervisors) - 1}.log")
            with open(log, errors="replace") as f:
                tail = [line.rstrip() for line in f.readlines()[-3:]]
            self.anomalies.append(f"the job exited with {rc}; last lines of {log}: " + " | ".join(tail))
        left = [p for sup in self.supervisors + self.extras for p in procs.tree(sup.pid)]
        procs.signal_all(left, signal.SIGCONT)  # a frozen zombie host must be able to stop
        for sup in self.supervisors + self.extras:
            if sup.poll() is None:
                procs.terminate(sup.pid)  # stops its drivers and standby
                try:
                    sup.wait(30)
                except subprocess.TimeoutExpired:
                    pass
        procs.signal_all(left, signal.SIGKILL)  # whatever outlived its supervisor
        # ... and whatever left its tree before (a JVM whose driver was killed, a dead pod's tree)
        orphans = procs.with_env("ONCEFLOW_VERIFY_SPEC", os.path.join(self.spec.workdir, "spec.json"))
        procs.signal_all(orphans, signal.SIGCONT)
        procs.signal_all(orphans, signal.SIGKILL)
        if os.path.exists(self.slow_file):
            os.unlink(self.slow_file)
        return rc
