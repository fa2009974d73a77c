"""The JSON-lines event log kept beside the checkpoint (``<checkpoint>/_onceflow/events.jsonl``).

One object per line, each with ``ts`` (UTC epoch seconds), ``event`` and event fields:
``batch`` (a committed micro-batch with its progress figures), ``start``, ``restart``
(with ``cause`` and ``delay_s``), ``recovered`` (with ``recovery_s``), ``stop``,
``savepoint``. Appends are whole lines; a torn last line after a crash is skipped on read.
An append that fails (a full disk) is logged as a warning and dropped: never an error.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator

from fsspec.core import url_to_fs

log = logging.getLogger("onceflow.eventlog")

EVENTS_DIR = "_onceflow"
EVENTS_FILE = "events.jsonl"


def events_url(checkpoint_url: str) -> str:
    return f"{checkpoint_url.rstrip('/')}/{EVENTS_DIR}/{EVENTS_FILE}"


class EventLog:
    """Append-only event log for one checkpoint."""

    def __init__(self, checkpoint_url: str):
        self.url = events_url(checkpoint_url)
        self.fs, self.path = url_to_fs(self.url)

    def append(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, "pid": os.getpid(), **fields}
        line = json.dumps(record, default=str) + "\n"
        try:
            self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            if self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol:
                # O_APPEND keeps concurrent writers (supervisor + driver) line-atomic.
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            else:
                with self.fs.open(self.path, "a") as f:
                    f.write(line)
        except OSError as e:  # a full or failing disk: the log is for humans, never fail a job over it
            log.warning("event log %s: %s event not written (%s)", self.path, event, e)
        return record

    def size(self) -> int:
        """Bytes in the log now (0 when it does not exist): an offset for :meth:`read_from`."""
        try:
            return int(self.fs.size(self.path))
        except FileNotFoundError:
            return 0

    def read_from(self, offset: int) -> Iterator[dict]:
        """The events appended at or after byte ``offset`` (from :meth:`size`)."""
        yield from self.tail(offset)[0]

    def tail(self, offset: int) -> tuple[list[dict], int]:
        """The complete events appended at or after byte ``offset``, and the offset to read on
        from: a line still being written is left for the next call."""
        try:
            with self.fs.open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        complete = data[: data.rfind(b"\n") + 1]
        events = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # torn line from a crash mid-append
        return events, offset + len(complete)

    def read(self) -> Iterator[dict]:
        try:
            with self.fs.open(self.path, "r") as f:
                for line in f:
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue  # torn line from a crash mid-append
        except FileNotFoundError:
            return
