"""Finding the processes a fault hits: the active driver, its JVM, executors and Python workers.

The active driver is the process that wrote the newest runner ``start`` event to the job's
event log (it holds the lease). Its JVM is its ``java`` child; on ``local-cluster`` the
executors are ``CoarseGrainedExecutorBackend`` JVMs below that JVM; Python workers are the
processes forked by a daemon (:data:`DAEMONS`: Spark's, and onceflow's that local masters
fork their task workers from; the daemon itself is the parent of each worker).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

import psutil

from onceflow.checkpoint.eventlog import EventLog

#: the modules Spark's Python worker daemons run as: Spark's (planners, and task workers on
#: clusters) and :mod:`onceflow.runtime.daemon` (task workers on local masters)
DAEMONS = ("pyspark.daemon", "onceflow.runtime.daemon")


def active_driver(log: EventLog, within: int | None = None) -> int | None:
    """Pid (as this process sees it) of the newest driver that started a runner and is still
    alive, else None. With ``within`` (a supervisor's pid), only a process of that supervisor's
    tree counts, and pids the event log recorded inside a PID namespace (a container restart)
    are mapped to this process's: a bare pid from the log could name anything here."""
    starts = [int(e["pid"]) for e in reversed(list(log.read())) if e.get("event") == "start"]
    if within is None:
        return next((pid for pid in starts if psutil.pid_exists(pid)), None)
    seen = ns_pids(within)
    return next((seen[pid] for pid in starts if pid in seen), None)


def ns_pids(root: int) -> dict[int, int]:
    """The processes of ``root``'s tree: their pid in their own PID namespace -> their pid here."""
    return {ns_pid(p.pid): p.pid for p in tree(root)}


def ns_pid(pid: int) -> int:
    """``pid`` as its own (innermost) PID namespace knows it (``NSpid`` in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((ln for ln in f if ln.startswith("NSpid:")), "")
        return int(line.split()[-1]) if line else pid
    except (OSError, ValueError):
        return pid


def parent(pid: int) -> int | None:
    """Parent pid of ``pid``, or None when it is gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (those that still exist)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def with_env(key: str, value: str) -> list[psutil.Process]:
    """Every process whose environment has ``key=value`` (inherited down a job's whole tree, so
    this also finds what outlived its parent: a JVM or worker whose driver or supervisor died)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def driver_jvm(driver: int) -> psutil.Process | None:
    for p in tree(driver)[1:]:
        if "java" in p.name() or _cmdline(p).startswith(("java", "/usr/lib/jvm")):
            return p
    return None


def executors(driver: int) -> list[psutil.Process]:
    return [p for p in tree(driver) if "CoarseGrainedExecutorBackend" in _cmdline(p)]


def python_workers(driver: int) -> list[psutil.Process]:
    """Python workers (children of a daemon, :data:`DAEMONS`); the daemons themselves when none
    runs."""
    procs = tree(driver)
    daemons = [p for p in procs if any(f"-m {d} " in f"{_cmdline(p)} " for d in DAEMONS)]
    daemon_pids = {p.pid for p in daemons}
    workers = [p for p in daemons if p.ppid() in daemon_pids]
    return workers or [p for p in daemons if p.ppid() not in daemon_pids]


def freeze(pid: int, rounds: int = 5) -> list[psutil.Process]:
    """SIGSTOP ``pid`` and all its descendants, again until no new process appears (one may
    fork between listing and stopping); returns the stopped processes (for SIGCONT)."""
    stopped: dict[int, psutil.Process] = {}
    for _ in range(rounds):
        fresh = [p for p in tree(pid) if p.pid not in stopped]
        if not fresh:
            break
        signal_all(fresh, signal.SIGSTOP)
        stopped.update((p.pid, p) for p in fresh)
    return list(stopped.values())


def signal_all(procs: Iterable[psutil.Process], sig: signal.Signals) -> int:
    """Send ``sig`` to each process; returns how many got it."""
    n = 0
    for p in procs:
        try:
            p.send_signal(sig)
            n += 1
        except psutil.NoSuchProcess:
            pass
    return n


def terminate(popen_pid: int) -> None:
    """SIGTERM the program a started process runs, through ``unshare --fork`` wrappers: such a
    wrapper ignores SIGTERM while it waits for its child (util-linux 2.38), so signalling it
    alone stopped nothing and every stop waited out its timeout."""
    try:
        p = psutil.Process(popen_pid)
        while "unshare" in (p.cmdline()[:1] or [""])[0] and "--fork" in p.cmdline():
            kids = p.children()
            if not kids:
                break
            p = kids[0]
        p.send_signal(signal.SIGTERM)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        pass
