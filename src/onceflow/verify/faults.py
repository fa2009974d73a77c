"""The faults ``onceflow verify`` injects. Each is a small class registered in :data:`FAULTS`.

A fault's :meth:`Fault.inject` blocks for the fault's whole duration (a kill is instant; a
database outage lasts until the database is back) and returns one line describing what it
hit. :meth:`Fault.unavailable` says, before the run starts, why a fault cannot run with the
given options (no restart command for the database, no cluster executors, not root, ...).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from typing import ClassVar

from onceflow.errors import ConfigError
from onceflow.verify import procs
from onceflow.verify.clock import ClockSkew
from onceflow.verify.fault_base import Fault, FaultMissed, Harness, can_unshare
from onceflow.verify.netfaults import LostReply, NetPartition
from onceflow.verify.writers import ConcurrentWriter

__all__ = ["FAULTS", "Fault", "FaultMissed", "Harness"]


def _driver(h: Harness) -> int:
    pid = procs.active_driver(h.log, h.supervisor.pid)
    if pid is None:
        raise FaultMissed("no driver is running")
    return pid


def _kill_one(h: Harness, found: list, what: str) -> str:
    """SIGKILL one of ``found``, chosen with the run's seeded RNG."""
    if not found:
        raise FaultMissed(f"no {what} is running")
    victim = h.rng.choice(found)
    victim.send_signal(signal.SIGKILL)
    return f"SIGKILL {what} {victim.pid}"


class DriverKill(Fault):
    name, help = "driver_kill", "SIGKILL the driver's process group (driver and JVM; the JVM's Python workers then exit)"
    kills_driver = True

    def inject(self, h: Harness) -> str:
        pid = _driver(h)
        os.killpg(pid, signal.SIGKILL)
        return f"SIGKILL process group {pid}"


class JvmKill(Fault):
    name, help = "jvm_kill", "SIGKILL only the driver's JVM, as the OOM killer does"
    kills_driver = True

    def inject(self, h: Harness) -> str:
        jvm = procs.driver_jvm(_driver(h))
        if jvm is None:
            raise FaultMissed("the driver has no JVM yet")
        jvm.send_signal(signal.SIGKILL)
        return f"SIGKILL JVM {jvm.pid}"


class ExecutorKill(Fault):
    name, help = "executor_kill", "SIGKILL one executor JVM (needs --master local-cluster[...])"

    def unavailable(self, h: Harness) -> str | None:
        if not h.spec.master.startswith("local-cluster"):
            return "needs executors in their own JVMs: run with --master 'local-cluster[2,1,1024]'"
        return None

    def inject(self, h: Harness) -> str:
        return _kill_one(h, procs.executors(_driver(h)), "executor JVM")


class WorkerKill(Fault):
    name, help = "worker_kill", "SIGKILL one Python worker (or its daemon when no task runs)"

    def inject(self, h: Harness) -> str:
        return _kill_one(h, procs.python_workers(_driver(h)), "Python worker")


class Zombie(Fault):
    """Pause the whole "host" (supervisor, driver, standby, JVMs, workers) for longer than the
    lease, start a successor on another host name, let it commit, then resume the old host. The
    woken driver must be fenced (exit 5) and commit nothing."""

    name, help = "zombie", "SIGSTOP the job's host past the lease; a successor takes over; SIGCONT"
    kills_driver = True

    def unavailable(self, h: Harness) -> str | None:
        if not can_unshare("--uts"):
            return "needs unshare(1) allowed to make a UTS namespace (root) for the successor's host name"
        return None

    def inject(self, h: Harness) -> str:
        old = h.supervisor
        frozen = procs.freeze(old.pid)
        paused_at = h.settled = time.time()
        new = h.start_supervisor(host=f"verify-host-{len(h.supervisors)}")
        committed = h.wait_commit(paused_at, new, timeout=h.options.recovery_timeout)
        procs.signal_all(frozen, signal.SIGCONT)
        try:
            rc = old.wait(timeout=h.options.recovery_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        paused = time.time() - paused_at
        if not committed:
            h.anomalies.append(f"zombie: the successor (supervisor {new.pid}) never committed while "
                               f"the old host was frozen; see supervisor-{len(h.supervisors) - 1}.log")
        if rc != 5:
            h.anomalies.append(f"zombie: the paused job's supervisor {old.pid} exited with {rc}, "
                               "not 5 (fenced)")
        got = "committed" if committed else "did NOT commit"
        return f"paused {len(frozen)} processes {paused:.1f}s; successor {got}; zombie exit {rc}"


class _Command(Fault):
    """A fault driven by the user's own stop/start commands."""

    stop_opt: ClassVar[str]
    start_opt: ClassVar[str]

    def unavailable(self, h: Harness) -> str | None:
        if not getattr(h.options, self.stop_opt) or not getattr(h.options, self.start_opt):
            flag = lambda o: "--" + o.replace("_", "-")  # noqa: E731
            return f"needs {flag(self.stop_opt)} and {flag(self.start_opt)} commands"
        return None

    def _run(self, h: Harness, opt: str, mode: str = "fast") -> None:
        cmd = getattr(h.options, opt).replace("{mode}", mode)
        res = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise ConfigError(f"verify: {cmd!r} failed ({res.returncode}): {(res.stderr or res.stdout).strip()[-300:]}")

    def _bounce(self, h: Harness, mode: str = "fast", hold_s: float = 0.0) -> None:
        """Stop, stay down ``hold_s``, start again (also when the stop command failed)."""
        try:
            self._run(h, self.stop_opt, mode)
            time.sleep(hold_s)
        finally:
            self._run(h, self.start_opt)


class PgRestart(_Command):
    name, help = "pg_restart", "restart PostgreSQL (fast or immediate shutdown, chosen at random)"
    stop_opt, start_opt = "pg_stop", "pg_start"

    def inject(self, h: Harness) -> str:
        mode = h.rng.choice(["fast", "immediate"])
        self._bounce(h, mode)
        return f"PostgreSQL {mode} shutdown and restart"


class PgDown(_Command):
    name, help = "pg_down", "PostgreSQL down for longer than the sink's commit deadline"
    stream_s = 70
    stop_opt, start_opt = "pg_stop", "pg_start"

    def inject(self, h: Harness) -> str:
        self._bounce(h, hold_s=h.options.outage_s)
        return f"PostgreSQL down {h.options.outage_s:.0f}s"


class BrokerRestart(_Command):
    name, help = "broker_restart", "restart the Kafka broker, graceful or killed (its log must survive)"
    stream_s = 70
    stop_opt, start_opt = "broker_stop", "broker_start"

    def inject(self, h: Harness) -> str:
        mode = h.rng.choice(["fast", "immediate"])
        self._bounce(h, mode)
        return f"broker {mode} stop and restart"


class DiskFull(Fault):
    """Fill the checkpoint's filesystem (the tmpfs ``--checkpoint-fs`` mounted) until writes
    fail with ENOSPC, hold it full, then free the space."""

    name, help = "disk_full", "fill the checkpoint filesystem, hold it full, free it"
    stream_s = 70

    def unavailable(self, h: Harness) -> str | None:
        if not h.options.checkpoint_fs:
            return "needs --checkpoint-fs SIZE (a tmpfs of that size holds the checkpoint; root only)"
        return None

    def inject(self, h: Harness) -> str:
        filler = os.path.join(os.path.dirname(h.spec.checkpoint), "onceflow-verify-filler")
        written, block = 0, b"\0" * (1 << 16)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                while True:
                    written += os.write(fd, block)
            except OSError:  # ENOSPC: full
                pass
            time.sleep(h.options.outage_s)
        finally:
            os.close(fd)
            os.unlink(filler)
        return f"filled {written >> 20} MiB, full for {h.options.outage_s:.0f}s"


class SlowSink(Fault):
    name, help = "slow_sink", "every commit waits --slow-s seconds for --outage-s seconds"

    def inject(self, h: Harness) -> str:
        path = h.slow_file
        with open(path + ".tmp", "w") as f:
            f.write(str(h.options.slow_s))
        os.replace(path + ".tmp", path)
        time.sleep(h.options.outage_s)
        os.unlink(path)
        return f"commits +{h.options.slow_s:.1f}s for {h.options.outage_s:.0f}s"


class ContainerRestart(Fault):
    """The job's whole process tree (supervisor, drivers, standby, JVMs, workers) is SIGKILLed
    at once, as a container's is, and ``onceflow run`` starts again as the init of a fresh PID
    namespace with the same host name: the pids in the lease and the event log may now name
    other processes, or be reused by the new ones."""

    name, help = "container_restart", ("SIGKILL the job's whole process tree; restart it in a fresh "
                                       "PID namespace with the same host name")
    stream_s = 75
    kills_driver = True

    def unavailable(self, h: Harness) -> str | None:
        if not can_unshare("--pid", "--fork", "--mount-proc"):
            return "needs unshare(1) allowed to make a PID namespace (root)"
        return None

    def inject(self, h: Harness) -> str:
        old = h.supervisor
        killed = procs.freeze(old.pid)  # nothing may fork or restart while the tree is killed
        procs.signal_all(killed, signal.SIGKILL)
        old.wait(30)
        new = h.start_supervisor(pid_namespace=True)
        return f"killed {len(killed)} processes; restarted as supervisor {new.pid} in a new PID namespace"


class StoreOutage(Fault):
    """The checkpoint's filesystem (the ``--checkpoint-fs`` tmpfs) turns read-only for
    ``--outage-s`` seconds, longer than the lease: every write of the checkpoint, the event log
    and the lease fails, then works again."""

    name, help = "store_outage", "make the checkpoint filesystem read-only past the lease, then writable"
    stream_s = 70

    def unavailable(self, h: Harness) -> str | None:
        if not h.options.checkpoint_fs:
            return "needs --checkpoint-fs SIZE (a tmpfs of that size holds the checkpoint; root only)"
        return None

    def inject(self, h: Harness) -> str:
        mount = os.path.dirname(h.spec.checkpoint)
        res = self._remount(mount, "ro")
        if res.returncode != 0 and "busy" in res.stderr:  # a file open for writing: try again later
            raise FaultMissed(f"remount,ro of {mount}: {res.stderr.strip().splitlines()[0]}")
        if res.returncode != 0:
            raise ConfigError(f"verify: remount,ro of {mount} failed: {res.stderr.strip()}")
        time.sleep(h.options.outage_s)
        deadline = time.monotonic() + 60
        while (res := self._remount(mount, "rw")).returncode != 0:  # never leave it read-only
            if time.monotonic() > deadline:
                raise ConfigError(f"verify: remount,rw of {mount} failed: {res.stderr.strip()}")
            time.sleep(0.5)
        return f"checkpoint filesystem read-only for {h.options.outage_s:.0f}s"

    @staticmethod
    def _remount(mount: str, mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", "-o", f"remount,{mode}", mount], capture_output=True, text=True)


FAULTS: dict[str, Fault] = {f.name: f for f in (
    DriverKill(), JvmKill(), Zombie(), ExecutorKill(), WorkerKill(), PgRestart(), PgDown(),
    BrokerRestart(), DiskFull(), SlowSink(), ContainerRestart(), StoreOutage(), ClockSkew(),
    NetPartition(), LostReply(), ConcurrentWriter(),
)}
