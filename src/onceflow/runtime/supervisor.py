"""The process supervisor behind ``onceflow run``: restarts the driver process when it crashes.

It runs ``python -m onceflow.runtime.driver TARGET`` in its own session and process group,
with ``ONCEFLOW_DRIVER_PGID`` set to that group, and reads the exit:

* 0: finished or stopped on request -> return 0;
* 2: configuration or user error (the driver printed it) -> return 2, no restart;
* 3: the driver's in-process restart strategy gave up -> return 3, no restart;
* 4: the driver was stopped on request but its savepoint failed -> return 4, no restart;
* 5: the driver was fenced (a newer driver took over its lineage) -> return 5 while another
  driver holds the checkpoint's lease; restart per strategy when nobody holds it;
* anything else, or death by a signal (kill -9, OOM killer): a crash -> the restart strategy
  decides; when it gives up -> return 3.

With ``standby=True`` (``onceflow run --standby``, the default) a warm standby driver (see
:mod:`onceflow.runtime.standby`) starts once each active driver committed its first batch
(or ``standby_delay`` seconds after it started, at the latest), so that its warm-up does not
slow the active driver's start;
when the active driver dies it is promoted at once (the restart strategy still counts the
crash and its delay is still waited), a new standby starts behind it, and a standby that dies
is replaced. Events: ``standby_start``, ``standby_ready`` (warm-up seconds, RSS of both
drivers), ``standby_exit``, and ``process_start`` with ``standby=True`` for a promotion.

Guarantees: at most one *active* driver group runs at a time (after the driver dies, whatever
is left of its process group, the Spark JVM and Python workers, is SIGKILLed, and the
supervisor waits for it to go before the next start or promotion; a standby touches no lease,
checkpoint or sink until promoted); SIGTERM or SIGINT is forwarded to the driver as
SIGTERM (it finishes the in-flight batch, then takes a savepoint unless disabled, see
:mod:`onceflow.runtime.driver`), the supervisor waits up to ``stop_timeout`` then SIGKILLs
the group. The exit code of a stop is the driver's: 0 stopped cleanly (savepoint taken when
asked), the driver's own non-zero code when it failed while stopping (e.g. 4: the savepoint
failed), 128+N when it had to be killed by signal N after ``stop_timeout``; a second SIGINT
kills at once (returns 130); a stop or the supervisor's exit also ends the standby. Every start, restart, give-up and stop is appended to the
checkpoint's event log (``process_start`` with host, supervisor pid and its start time,
``restart``, ``gave_up``, ``stop``, all with ``scope="process"``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.checkpoint.lease import DriverLease
from onceflow.checkpoint.lease.identity import process_start, written_by
from onceflow.errors import (
    EXIT_CONFIG,
    EXIT_FENCED,
    EXIT_FORCED,
    EXIT_GAVE_UP,
    EXIT_OK,
    EXIT_SAVEPOINT_FAILED,
)
from onceflow.outages import short
from onceflow.process import group_members, group_rss_mb, start_time
from onceflow.runtime.restart import RestartStrategy
from onceflow.runtime.standby import GO_ENV, promote

log = logging.getLogger("onceflow.supervisor")
T = TypeVar("T")

PGID_ENV = "ONCEFLOW_DRIVER_PGID"
# With start_new_session the shell's pid is the new group's id; exec keeps that pid.
_LAUNCH = ["/bin/sh", "-c", f'{PGID_ENV}=$$; export {PGID_ENV}; exec "$@"', "onceflow-driver"]


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL`` for a signal death, ``exited with code N`` otherwise."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclasses.dataclass
class _Standby:
    proc: subprocess.Popen
    go: str  # created by the supervisor to promote it

    def ready(self) -> dict | None:
        try:
            with open(f"{self.go}.ready") as f:
                return dict(kv.split("=", 1) for kv in f.read().split())
        except (OSError, ValueError):
            return None

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass


class Supervisor:
    """Runs the driver for ``target`` until it finishes, is stopped, or restarts run out.

    ``strategy`` counts process crashes only (query failures are restarted inside the driver
    by the job's own strategy). ``env``: the driver's environment (default: this process's).
    ``child_cmd`` replaces ``python -m onceflow.runtime.driver TARGET`` (tests); ``extra_args``
    are appended to either.
    """

    def __init__(
        self,
        target: str,
        strategy: RestartStrategy,
        checkpoint: CheckpointDir | str,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        child_cmd: Sequence[str] | None = None,
        stop_timeout: float = 120.0,
        poll_interval: float = 0.05,
        standby: bool = False,
        standby_delay: float = 60.0,
    ):
        self.target, self.strategy = target, strategy
        self.extra_args, self.env = tuple(extra_args), env
        self.child_cmd = tuple(child_cmd) if child_cmd else None
        self.stop_timeout, self.poll_interval = stop_timeout, poll_interval
        self.checkpoint = CheckpointDir.of(checkpoint)
        self.events = EventLog(self.checkpoint)
        self._proc: subprocess.Popen | None = None
        self._proc_done = False  # the driver has exited (its pid may be reaped any moment)
        self._stop_signal: str | None = None
        self._stop_ts = 0.0
        self._stop_deadline = float("inf")
        self._force = False
        self.standby, self.standby_delay = standby, standby_delay
        self._standby: _Standby | None = None
        self._standby_n = 0
        self._standby_dir: str | None = None
        self._last_standby_start = float("-inf")
        self._memory_shown = False
        self._active_started = 0.0
        self._commit_checked = 0.0
        #: pid -> process start of the drivers and standbys this supervisor started (the last few)
        self._mine: dict[int, str | None] = {}
        self._log_offset = 0  # event log size when the active driver started

    # ---- the checkpoint store: an outage never ends the supervisor (appends never raise) -----

    def _read(self, read: Callable[[], T], unknown: T) -> T:
        """``read()`` of the checkpoint store, or ``unknown`` (logged) during an outage."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - any storage or network error
            log.warning("checkpoint store of %s unreachable (%s); going on without it",
                        self.checkpoint.url, short(e))
            return unknown

    def command(self) -> list[str]:
        base = self.child_cmd or (sys.executable, "-m", "onceflow.runtime.driver", self.target)
        return [*base, *self.extra_args]

    # ---- main loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until done; returns the exit code for ``onceflow run`` (see module doc)."""
        log.info("supervising %s, process restarts: %s; events: %s",
                 self.target, self.strategy.describe(), self.events.url)
        with self._signal_handlers():
            try:
                return self._loop()
            finally:
                self._stop_standby()

    def _loop(self) -> int:
        attempt = 0
        while True:
            attempt += 1
            if attempt > 1 and self._standby_alive():
                proc, started = self._promote(attempt)
            else:
                proc, started = self._start(attempt)
            rc = self._wait(proc)
            crashed_at, uptime = time.time(), time.monotonic() - started
            if self._stop_signal is not None:
                return self._stopped(rc)
            if rc == EXIT_OK:
                log.info("driver finished (exit 0)")
                self.events.append("stop", reason="finished", exit_code=rc, scope="process")
                return EXIT_OK
            if rc in (EXIT_CONFIG, EXIT_GAVE_UP, EXIT_SAVEPOINT_FAILED):
                why = {EXIT_CONFIG: "a configuration or user error",
                       EXIT_GAVE_UP: "its in-process restart strategy gave up",
                       EXIT_SAVEPOINT_FAILED: "it was stopped but its savepoint failed"}[rc]
                log.error("driver exited with code %d (%s, see its message above); not restarting", rc, why)
                reason = {EXIT_CONFIG: "config_error", EXIT_GAVE_UP: "gave_up_in_process",
                          EXIT_SAVEPOINT_FAILED: "savepoint_failed"}[rc]
                self.events.append("stop", reason=reason, exit_code=rc, scope="process")
                return rc
            if rc == EXIT_FENCED:
                holder = self._read(DriverLease(self.checkpoint, "onceflow-supervisor").holder, None)
                if holder is not None:
                    log.error("driver was fenced: pid %s on %s holds the lineage now; not "
                              "restarting", holder.get("pid"), holder.get("host"))
                    self.events.append("stop", reason="fenced", exit_code=rc, scope="process",
                                       holder=f"{holder.get('host')}:{holder.get('pid')}")
                    return EXIT_FENCED
            cause = describe_exit(rc)
            delay = self.strategy.on_failure()
            crash = {"cause": cause, "exit_code": rc, "crashed_at": round(crashed_at, 3),
                     "uptime_s": round(uptime, 3), "scope": "process"}
            if delay is None:
                log.error("driver %s after %.1fs; restart strategy %s gave up after %d restart(s); "
                          "not restarting", cause, uptime, self.strategy.describe(), attempt - 1)
                self.events.append("gave_up", attempts=attempt, **crash)
                return EXIT_GAVE_UP
            log.warning("driver %s after %.1fs; restart %d in %.1fs (%s)",
                        cause, uptime, attempt, delay, self.strategy.describe())
            self.events.append("restart", delay_s=round(delay, 3), attempt=attempt, **crash)
            if self._sleep(delay):
                return self._stopped(None)

    def _start(self, attempt: int) -> tuple[subprocess.Popen, float]:
        env = dict(os.environ if self.env is None else self.env)
        cmd = self.command()
        proc = subprocess.Popen([*_LAUNCH, *cmd], env=env, start_new_session=True)
        self._started(proc)
        started = time.monotonic()
        self._proc, self._proc_done, self._active_started = proc, False, started
        self._log_offset = self._read(self.events.size, None)
        log.info("driver started: pid %d, attempt %d: %s", proc.pid, attempt, " ".join(cmd))
        self.events.append("process_start", attempt=attempt, pid=proc.pid, host=socket.gethostname(),
                           supervisor_pid=os.getpid(), supervisor_started=start_time(os.getpid()),
                           scope="process")
        if self._stop_signal is not None:  # a stop arrived while starting
            self._forward_stop()
        return proc, started

    def _wait(self, proc: subprocess.Popen) -> int:
        """Wait for the driver, kill what is left of its group, reap it; its returncode."""
        killed = False
        while not self._exited(proc):
            self._tend_standby()
            if not killed and (self._force or time.monotonic() > self._stop_deadline):
                why = "second SIGINT" if self._force else f"not stopped after {self.stop_timeout:g}s"
                log.warning("%s: killing the driver's process group %d", why, proc.pid)
                self._killpg(proc.pid)
                killed = True
            time.sleep(self.poll_interval)
        self._proc_done = True
        self._kill_leftovers(proc.pid)  # the unreaped driver keeps its pgid from being reused
        return proc.wait()

    @staticmethod
    def _exited(proc: subprocess.Popen) -> bool:
        if hasattr(os, "waitid"):  # look without reaping
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        return proc.poll() is not None

    @staticmethod
    def _killpg(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_leftovers(self, pgid: int, wait_s: float = 10.0) -> None:
        left = group_members(pgid)
        if left == []:
            return
        if left:
            log.info("killing %d leftover process(es) of the driver's group: %s",
                     len(left), " ".join(map(str, left)))
        self._killpg(pgid)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = group_members(pgid)
        if left:
            log.warning("processes %s of group %d survive SIGKILL after %gs", left, pgid, wait_s)

    def _sleep(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; True if a stop was requested meanwhile."""
        end = time.monotonic() + delay
        while self._stop_signal is None and (remaining := end - time.monotonic()) > 0:
            time.sleep(min(self.poll_interval, remaining))
        return self._stop_signal is not None

    def _stopped(self, rc: int | None) -> int:
        if rc is None:
            log.info("stopped (%s) while waiting to restart", self._stop_signal)
        elif rc == EXIT_OK:
            taken = [e.get("path") for e in self._read(self.events.read, []) if e.get("event") == "savepoint"
                     and e.get("reason") == "stop" and float(e.get("ts", 0)) >= self._stop_ts]
            log.info("driver stopped cleanly (%s)%s", self._stop_signal,
                     f"; savepoint on stop: {taken[-1]}" if taken else "")
        else:
            log.warning("driver %s while stopping (%s)", describe_exit(rc), self._stop_signal)
        self.events.append("stop", reason="signal", signal=self._stop_signal, exit_code=rc,
                           forced=self._force, scope="process")
        if self._force:
            return EXIT_FORCED
        if rc is None or rc == EXIT_OK:
            return EXIT_OK
        return rc if rc > 0 else 128 - rc  # killed by signal N after the stop timeout: 128+N

    # ---- the warm standby (see onceflow.runtime.standby) -----------------------------------

    def _standby_alive(self) -> bool:
        return self._standby is not None and not self._exited(self._standby.proc)

    def _tend_standby(self) -> None:
        """Start the standby once the active driver is up (see :meth:`_active_committed`),
        replace one that died (at most one start per 5 s), show the pair's memory once."""
        if not self.standby or self._stop_signal is not None or self._proc is None:
            return
        sb = self._standby
        if sb is not None and self._exited(sb.proc):
            self._kill_leftovers(sb.proc.pid)  # while unreaped, its pgid cannot be reused
            rc = sb.proc.wait()
            log.warning("standby driver pid %d %s; replacing it", sb.proc.pid, describe_exit(rc))
            self.events.append("standby_exit", pid=sb.proc.pid, exit_code=rc, scope="process")
            self._standby = sb = None
        now = time.monotonic()
        if sb is None and now - self._last_standby_start >= min(5.0, self.standby_delay) \
                and self._active_committed(now):
            self._start_standby()
        elif sb is not None and not self._memory_shown and sb.ready() is not None:
            self._memory_shown = True
            active, standby = group_rss_mb(self._proc.pid), group_rss_mb(sb.proc.pid)
            log.info("standby driver pid %d ready (warm-up %s s); memory (RSS): active driver %s MB, "
                     "standby %s MB", sb.proc.pid, sb.ready().get("warm_s", "?"), active, standby)
            self.events.append("standby_ready", pid=sb.proc.pid, warm_s=float(sb.ready().get("warm_s", 0)),
                               active_rss_mb=active, standby_rss_mb=standby, scope="process")

    def _active_committed(self, now: float) -> bool:
        """True once the active driver committed a batch (checked each second), or after
        ``standby_delay`` seconds at the latest: the standby then warms up without slowing
        the active driver's own start on a small machine."""
        if now - self._active_started >= self.standby_delay:
            return True
        if now - self._commit_checked < 1.0:
            return False
        self._commit_checked = now
        offset = self._log_offset
        return offset is not None and any(
            e.get("event") == "sink_commit" for e in self._read(lambda: self.events.read_from(offset), []))

    def _start_standby(self) -> None:
        if self._standby_dir is None:
            self._standby_dir = tempfile.mkdtemp(prefix="onceflow-standby-")
        self._standby_n += 1
        go = os.path.join(self._standby_dir, f"go-{self._standby_n}")
        env = {**(os.environ if self.env is None else self.env), GO_ENV: go}
        proc = subprocess.Popen([*_LAUNCH, *self.command()], env=env, start_new_session=True)
        self._started(proc)
        self._standby, self._memory_shown = _Standby(proc, go), False  # each standby reports ready
        self._last_standby_start = time.monotonic()
        log.info("standby driver started: pid %d", proc.pid)
        self.events.append("standby_start", pid=proc.pid, host=socket.gethostname(), scope="process")

    def _started(self, proc: subprocess.Popen) -> None:
        """Remember a process this supervisor started, by pid and start (see :meth:`_takeover`)."""
        self._mine[proc.pid] = process_start(proc.pid)
        while len(self._mine) > 64:  # the lease's holder is one of the last few started
            del self._mine[next(iter(self._mine))]

    def _takeover(self) -> int | None:
        """The lease epoch the promoted standby takes over at once, if any: only that of a
        driver this supervisor started (it has died, or it would not be promoting), and only
        while that epoch is still the lease's newest. A lease of another supervisor's driver (a
        second pod on this checkpoint, whatever its host name or PID namespace) is waited for
        like any driver waits, never taken: two supervisors must not fence each other in turn.
        Unreadable store: no takeover (the standby waits it out)."""
        rec = self._read(DriverLease(self.checkpoint, "onceflow-supervisor").top, None)
        if rec is None or not any(written_by(rec, pid, st) for pid, st in self._mine.items()):
            return None
        epoch = rec.get("epoch")
        return epoch if isinstance(epoch, int) and epoch > 0 else None

    def _promote(self, attempt: int) -> tuple[subprocess.Popen, float]:
        """The standby becomes the active driver: with takeover when the lease is ours."""
        sb = self._standby
        assert sb is not None
        self._standby, self._memory_shown = None, False
        holder = self._takeover()
        promote(sb.go, holder)
        takeover = holder is not None
        started = time.monotonic()
        self._proc, self._proc_done, self._active_started = sb.proc, False, started
        self._log_offset = self._read(self.events.size, None)
        warm = sb.ready()
        log.info("standby driver pid %d promoted (attempt %d, %s; %s)", sb.proc.pid, attempt,
                 f"warm; its warm-up took {warm.get('warm_s')} s" if warm else "still warming up",
                 "taking over the lease" if takeover else "the lease is not ours: it waits for it")
        self.events.append("process_start", attempt=attempt, pid=sb.proc.pid, host=socket.gethostname(),
                           supervisor_pid=os.getpid(), supervisor_started=start_time(os.getpid()),
                           standby=True, warm=warm is not None, takeover=takeover, scope="process")
        if self._stop_signal is not None:
            self._forward_stop()
        return sb.proc, started

    def _stop_standby(self) -> None:
        sb, self._standby = self._standby, None
        if sb is not None:
            sb.signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not self._exited(sb.proc) and time.monotonic() < deadline:
                time.sleep(self.poll_interval)
            self._kill_leftovers(sb.proc.pid)
            sb.proc.wait()
        if self._standby_dir is not None:
            shutil.rmtree(self._standby_dir, ignore_errors=True)

    # ---- signals -------------------------------------------------------------------------

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self._stop_signal is None:
            self._stop_signal = name
            self._stop_ts = time.time()
            self._stop_deadline = time.monotonic() + self.stop_timeout
            log.info("%s received: stopping the driver (SIGTERM, then SIGKILL after %gs; "
                     "press Ctrl-C again to kill now)", name, self.stop_timeout)
            self._forward_stop()
        elif signum == signal.SIGINT:
            self._force = True
        else:
            log.info("%s received again: still waiting for the driver to stop", name)

    def _forward_stop(self) -> None:
        if self._standby is not None:
            self._standby.signal(signal.SIGTERM)
        if self._proc is not None and not self._proc_done:
            try:  # not Popen.send_signal: it would reap the driver before its group is killed
                os.kill(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
