"""What every ``onceflow verify`` fault shares: the :class:`Fault` interface and the view of
the running harness a fault acts on.

A fault's :meth:`Fault.inject` blocks for the fault's whole duration and returns one line
describing what it hit; :meth:`Fault.unavailable` says, before the run starts, why the fault
cannot run with the given options.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.verify.proxy import FaultProxy
    from onceflow.verify.spec import Options, VerifySpec


class Harness(Protocol):
    """What a fault acts on: the running verify (:class:`onceflow.verify.harness.Harness`)."""

    spec: VerifySpec
    options: Options
    rng: random.Random
    log: EventLog
    slow_file: str
    supervisors: list[subprocess.Popen]
    #: processes started by a fault beside the job (a standing-by successor host); stopped at the end
    extras: list[subprocess.Popen]
    anomalies: list[str]
    settled: float | None
    #: set by a fault after which only commits logged later count as its recovery (a clock
    #: skew: commits logged during it carry skewed timestamps)
    settled_seq: int | None
    #: the job's libfaketime file (``+0s`` normally) when clock_skew is among the faults
    faketime_file: str | None
    #: fault proxies in front of the job's servers, by kind (``postgres``)
    proxies: dict[str, FaultProxy]
    #: ids (negative) of the rows a concurrent writer committed to the sink's table
    foreign: list[int]
    workdir_log: str

    @property
    def supervisor(self) -> subprocess.Popen: ...

    def start_supervisor(self, host: str | None = None, pid_namespace: bool = False,
                         faketime: str | None = None, extra: bool = False) -> subprocess.Popen: ...

    def wait_commit(self, after: float, proc: subprocess.Popen, timeout: float = 180.0) -> bool: ...

    def events(self) -> list[dict]: ...


class Fault(ABC):
    name: ClassVar[str]
    help: ClassVar[str]
    #: the fault ends the active driver (its next commit comes from another process)
    kills_driver: ClassVar[bool] = False
    #: seconds of stream one injection takes on a busy machine (a standby's warm-up, the gap,
    #: the fault itself, a recovery): verify's default ``--events`` (:func:`stream_seconds`)
    stream_s: ClassVar[float] = 40

    def unavailable(self, h: Harness) -> str | None:
        """Why this fault cannot run in this setup, or None."""
        return None

    @abstractmethod
    def inject(self, h: Harness) -> str:
        """Inject the fault; return what it hit. Raises :class:`FaultMissed` when no target."""


def stream_seconds(faults: dict[str, Fault], kinds: list[str], count: int) -> float:
    """Seconds of stream ``count`` faults of ``kinds`` take, at most, in any seeded order (each
    round of the schedule has every kind once; a partial last round is counted with the
    slowest kinds)."""
    if not kinds or count <= 0:
        return 0.0
    secs = sorted((faults[k].stream_s for k in kinds if k in faults), reverse=True) or [Fault.stream_s]
    rounds, rest = divmod(count, len(secs))
    return rounds * sum(secs) + sum(secs[:rest])


class FaultMissed(Exception):
    """The fault found nothing to hit at this instant (e.g. no Python worker running)."""


def can_unshare(*flags: str) -> bool:
    """``unshare FLAGS true`` works here (root, namespaces allowed)."""
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", *flags, "true"], capture_output=True).returncode == 0
