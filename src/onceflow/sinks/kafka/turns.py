"""One Kafka transaction end at a time per broker on this host (option ``serialize_commits``).

Why: tansu 0.6 (the test suite's broker) finalizes a transaction only once every transaction
overlapping it on a shared partition is prepared, and the end that finds them so finalizes
all of them. When two transactions on one partition end at the same moment, one of them can
be finalized by the other while it is still writing its own commit marker; that marker then
re-attaches its offsets to the finalized transaction, and every later transaction on those
partitions waits for it for ever (tansu logs ``otherwise=Some(Committed)``). The marker
partition's last stable offset stops for good: every marker read times out. Kafka itself has
no such coupling. ``benchmarks/tansu_wedge.py`` reproduces it: four producers that commit at
once wedged the partition in 2 of 3 rounds of 40 batches, and never when their ends took turns.

Isolated from the producers' code path: :func:`serialize` registers :func:`ending` as the end
guard of one broker (:func:`onceflow.sinks.kafka.producers.guard_ends`); a sink on a broker
that passed the probe never calls it, and its transaction ends run unguarded.

Guarantees of :func:`ending`:
- transaction ends of this host's processes and threads on that broker
  (``init_transactions``, which aborts an older attempt's open transaction, ``commit``,
  ``abort``) run one at a time, under a file lock in the temporary directory;
- it never blocks for good: a holder that dies releases the lock with its file descriptor, a
  holder that is stopped (SIGSTOP, a paused zombie) is passed by at once, and after
  :data:`TURN_WAIT_S` an end goes ahead alone. Passing by only re-opens the window above;
  exactly-once does not depend on it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from onceflow.process import is_stopped
from onceflow.sinks.kafka.producers import guard_ends

log = logging.getLogger("onceflow.sinks.kafka")

#: the longest an end waits for its turn before it goes ahead alone
TURN_WAIT_S = 5.0


def serialize(bootstrap: str) -> None:
    """From now on, this process's transaction ends on ``bootstrap`` take turns."""
    guard_ends(bootstrap, lambda: ending(bootstrap))


def lock_path(bootstrap: str) -> str:
    digest = hashlib.sha1(bootstrap.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"onceflow-kafka-ends-{digest}.lock")


@contextmanager
def ending(bootstrap: str) -> Iterator[None]:
    """Hold this host's turn to end a transaction on ``bootstrap`` (see module doc)."""
    try:
        fd = os.open(lock_path(bootstrap), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file, a read-only /tmp: go ahead alone
        yield
        return
    try:
        held = _take(fd)
        try:
            yield
        finally:
            if held:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take(fd: int) -> bool:
    """Lock ``fd`` and write this pid into it; False when the end goes ahead alone."""
    deadline = time.monotonic() + TURN_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if is_stopped(holder) or time.monotonic() > deadline:
                why = "is stopped" if is_stopped(holder) else f"held the turn over {TURN_WAIT_S:g}s"
                log.warning("onceflow-kafka-sink: a transaction end goes ahead without its turn: "
                            "pid %s %s (serialize_commits)", holder, why)
                return False
            time.sleep(0.002)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return True


def _holder(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 16, 0) or b"0") or None
    except ValueError:
        return None

