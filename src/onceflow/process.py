"""Processes, through psutil: a process's start time, a process group's members and memory,
whether a process is stopped by a signal, the executor JVM a task runs under.

Shared by the supervisor, ``onceflow stop``, the fault injector and the Kafka sink's turns.
Each reader returns None (or an empty answer) when the process is gone or cannot be read; it
never raises for a process that exits while it looks.
"""

from __future__ import annotations

import os

import psutil


def start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch, as the kernel records it; stable for one
    process). With the host it tells a live process from a later one that reuses its pid."""
    try:
        return round(psutil.Process(pid).create_time(), 2)
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
