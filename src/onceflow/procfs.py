"""Linux ``/proc/PID/stat`` fields, shared by the supervisor, the fault injector and the Kafka
sink's turns. Each reader returns None where /proc is missing or the process is gone."""

from __future__ import annotations


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name: [0] is the state (``R``,
    ``S``, ``T`` stopped, ``t`` traced, ``Z`` zombie...), [1] the parent pid, [2] the process
    group, [19] the start time in clock ticks since boot. None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None
