"""Processes: a process's start, a process group's members and memory, whether a process is
stopped by a signal, the executor JVM a task runs under.

Shared by the supervisor, the lease, ``onceflow stop``, scratch space, the fault injector and
the Kafka sink's turns. Each reader returns None (or an empty answer) when the process is gone
or cannot be read; it never raises for a process that exits while it looks.

All through psutil, except a process's start: it is read as the kernel keeps it, in clock
ticks since boot (``/proc/PID/stat``). psutil turns that into wall-clock seconds with the boot
time, which the kernel derives from the wall clock: after a clock step the same process
would get another start time, and a live process would pass for a reused pid.
"""

from __future__ import annotations

import os

import psutil


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name ([0] the state, [19] the start
    in clock ticks since boot); None when unreadable (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def start_time(pid: int | str) -> int | None:
    """When ``pid`` (or ``"self"``) started, in clock ticks since boot: stable for one process
    whatever the wall clock does, and different for a later process that reuses the pid. Where
    there is no /proc, psutil's creation time in centiseconds."""
    fields = stat_fields(pid)
    if fields is not None and len(fields) > 19:
        return int(fields[19])
    try:
        return round(psutil.Process(None if pid == "self" else int(pid)).create_time() * 100)
    except (psutil.Error, ValueError):
        return None


def is_stopped(pid: int | None) -> bool:
    """Whether ``pid`` is stopped by a signal (SIGSTOP, or traced)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) pids of process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                members.append(proc.pid)
        except (psutil.Error, OSError):
            continue  # exited meanwhile
    return sorted(members)


def group_rss_mb(pgid: int) -> int:
    """Resident memory of process group ``pgid`` in MB."""
    total = 0
    for pid in group_members(pgid):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total // 2**20


def executor_jvm() -> int | None:
    """The pid of the Spark executor JVM (CoarseGrainedExecutorBackend) this process descends
    from; None outside one."""
    try:
        for parent in psutil.Process().parents():
            try:
                if any("CoarseGrainedExecutorBackend" in arg for arg in parent.cmdline()):
                    return parent.pid
            except psutil.Error:
                return None
    except psutil.Error:
        return None
    return None
