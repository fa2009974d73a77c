"""Who holds a lease, and the one clock a lease decides by.

A holder is named by its host, the kernel's boot id, its PID namespace and its process start
time, never by a pid alone: after a container restart or a reboot the same pid is often some
other live process. A pid is looked up only where the lookup means something: in the
reader's own PID namespace on the same boot (same boot id, same namespace inode), through a
``/proc`` that shows that namespace. Everywhere else (another host, another container on
the same host, whatever their host names) liveness is left to the record's renewals.

:func:`clock` is this process's monotonic clock: CLOCK_BOOTTIME on Linux (it keeps counting
while the machine is suspended, so a holder that slept gives itself up rather than too
late), ``time.monotonic`` elsewhere. It is system-wide on one boot, so two processes of one
host (the Spark Connect server's Python workers) can compare readings; no other host's clock
is ever compared with it.
"""

from __future__ import annotations

import functools
import os
import socket
import time

import psutil

from onceflow.process import stat_fields

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def clock() -> float:
    """Seconds on this host's monotonic clock (including suspend on Linux)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """The kernel's boot id (Linux), else the boot time (psutil): differs after a reboot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"boot-time:{psutil.boot_time():.0f}"


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), None where there is none to read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def clock_domain() -> str:
    """Where readings of :func:`clock` are comparable: this boot (and time namespace)."""
    try:
        timens = os.readlink("/proc/self/ns/time")
    except OSError:
        timens = ""
    return f"{boot_id()}/{timens}"


def process_start(pid: int | str) -> str | None:
    """An identity of process ``pid``'s start that no later process with that pid shares:
    its start in clock ticks since boot (Linux; immune to wall-clock steps), else psutil's
    creation time. None when there is no such process, or it is a zombie."""
    fields = stat_fields(pid)
    if fields is not None and len(fields) > 19:
        return None if fields[0] == b"Z" else f"ticks:{fields[19].decode()}"
    if os.path.isdir("/proc/self"):
        return None  # Linux, and the process is gone
    try:
        proc = psutil.Process(None if pid == "self" else int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"created:{proc.create_time():.3f}"
    except (psutil.Error, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _procfs_shows_own_namespace() -> bool:
    """False after ``unshare --pid`` without ``--mount-proc``: /proc then shows another
    namespace's pids, and a lookup by pid would find the wrong process."""
    own, by_pid = stat_fields("self"), stat_fields(os.getpid())
    return own is None or (by_pid is not None and len(by_pid) > 19 and by_pid[19] == own[19])


def own() -> dict:
    """This process's identity fields for a lease record."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot_id(),
            "pidns": pid_namespace(), "started": process_start("self")}


def local_liveness(record: dict) -> bool | None:
    """True: the holder's process runs (same boot, same PID namespace, same start); False:
    it is gone or its pid now belongs to another process; None: this process cannot tell (the
    holder is in another namespace or on another host, or the record predates these fields)."""
    started = record.get("started")
    if not started or record.get("boot_id") != boot_id():
        return None
    ns = pid_namespace()
    if ns is None:  # no namespaces to compare (not Linux): the host name must match too
        if record.get("host") != socket.gethostname() or record.get("pidns") is not None:
            return None
    elif record.get("pidns") != ns or not _procfs_shows_own_namespace():
        return None
    try:
        pid = int(record.get("pid", 0))
    except (TypeError, ValueError):
        return None
    return pid > 0 and process_start(pid) == started


def written_by(record: dict, pid: int, started: str | None) -> bool:
    """Whether ``record`` names process ``pid`` of this boot and PID namespace that started at
    ``started`` (:func:`process_start`, read while it ran): true of that process only, even
    after it is gone and its pid is reused."""
    return (started is not None and record.get("pid") == pid and record.get("started") == started
            and record.get("boot_id") == boot_id() and record.get("pidns") == pid_namespace())
