"""The event log kept beside the checkpoint (``<checkpoint>/_onceflow/``).

Each event is one JSON object with ``ts`` (UTC epoch seconds), ``event``, ``pid`` and event
fields: ``batch`` (a committed micro-batch with its progress figures), ``start``, ``restart``
(with ``cause`` and ``delay_s``), ``recovered`` (with ``recovery_s``), ``stop``,
``savepoint``. Two layouts, both always read:

* **local filesystem**: JSON lines in ``_onceflow/events.jsonl``. Appends are whole lines
  (``O_APPEND``, so the supervisor, drivers and tasks appending at once stay line-atomic); a
  torn last line after a crash is skipped on read.
* **object stores** (any other fsspec filesystem: ``s3://``, ``gs://``, ``abfs://``...), which
  have no append: one object per event, ``_onceflow/events/<ms>-<pid>-<seq>-<rand>.json``,
  each written with a single PUT, so an event is there whole or not at all and concurrent
  writers never overwrite each other. Events are ordered by their names (the writer's clock in
  milliseconds). :meth:`EventLog.tail` sees an event written up to :data:`LATE_S` seconds after
  a newer one was already read (slow PUTs, clocks of other hosts); a later one is missed by a
  tail (never by :meth:`EventLog.read`).

An append that fails (a full disk, an unreachable store) is logged as a warning and dropped:
never an error. Readers see events in order per writer; across writers, in time order
(objects) or append order (lines).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from onceflow.checkpoint.layout import CheckpointDir
from onceflow.storage import is_local, redact

log = logging.getLogger("onceflow.eventlog")

EVENTS_DIR = "_onceflow"
EVENTS_FILE = "events.jsonl"
EVENTS_OBJECTS = "events"
#: how late (seconds) an event object may appear after a newer one and still be tailed
LATE_S = 120.0
_SEQ = itertools.count()


def events_url(checkpoint_url: str) -> str:
    return f"{checkpoint_url.rstrip('/')}/{EVENTS_DIR}/{EVENTS_FILE}"


@dataclass(frozen=True)
class Cursor:
    """Where a tail of the event log stands: bytes of ``events.jsonl`` read, the event objects
    read whose time is within :data:`LATE_S` of the newest read, and that horizon (ms)."""

    lines: int = 0
    seen: frozenset[str] = frozenset()
    horizon_ms: int = -1


#: an offset into the log: bytes of the JSON-lines file (local), or a :class:`Cursor`
Offset = int | Cursor


def _ms(name: str) -> int:
    head = name.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() else 0


class EventLog:
    """Append-only event log for one checkpoint."""

    def __init__(self, checkpoint: CheckpointDir | str):
        ckpt = CheckpointDir.of(checkpoint)
        self.url = events_url(ckpt.url)
        self.fs, self.path = ckpt.fs, ckpt._p(EVENTS_DIR, EVENTS_FILE)
        self.objects = f"{self.path.rsplit('/', 1)[0]}/{EVENTS_OBJECTS}"
        self.local = is_local(self.fs)

    def append(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, "pid": os.getpid(), **fields}
        data = (redact(json.dumps(record, default=str)) + "\n").encode()  # no store secrets
        try:
            if self.local:
                self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
                # O_APPEND keeps concurrent writers (supervisor + driver) line-atomic.
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
            else:  # no append on object stores: one object, one PUT
                name = (f"{int(record['ts'] * 1000):013d}-{record['pid']}-{next(_SEQ):06d}-"
                        f"{uuid.uuid4().hex[:6]}.json")
                self.fs.pipe_file(f"{self.objects}/{name}", data)
        except Exception as e:  # noqa: BLE001 - the log is for humans: never fail a job over it
            log.warning("event log %s: %s event not written (%s)", self.url, event, e)
        return record

    # ---- reading -------------------------------------------------------------------------

    def _names(self) -> list[str]:
        """The event objects now, oldest first (none on a local filesystem)."""
        if self.local:
            return []
        self.fs.invalidate_cache(self.objects)
        try:
            names = self.fs.ls(self.objects, detail=False)
        except FileNotFoundError:
            return []
        return sorted((n for n in names if n.endswith(".json")), key=lambda n: (_ms(n), n))

    def _objects(self, names: list[str]) -> list[dict]:
        if not names:
            return []
        data = self.fs.cat(names, on_error="omit")  # fetched concurrently by async stores
        out = []
        for n in names:
            try:
                out.append(json.loads(data[n]))
            except (KeyError, ValueError):
                continue  # removed meanwhile, or not an event
        return out

    def _lines_from(self, offset: int) -> tuple[list[dict], int]:
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

    def size(self) -> Offset:
        """Where the log ends now (an offset for :meth:`read_from`): bytes of the JSON-lines
        file on a local filesystem, a :class:`Cursor` past every event object elsewhere."""
        try:
            lines = int(self.fs.size(self.path))
        except FileNotFoundError:
            lines = 0
        if self.local:
            return lines
        return self._advance(Cursor(lines), self._names())

    @staticmethod
    def _advance(cursor: Cursor, new: list[str]) -> Cursor:
        seen = cursor.seen | set(new)
        newest = max((_ms(n) for n in seen), default=-1)
        horizon = max(cursor.horizon_ms, newest - int(LATE_S * 1000))
        return Cursor(cursor.lines, frozenset(n for n in seen if _ms(n) >= horizon), horizon)

    def read_from(self, offset: Offset) -> Iterator[dict]:
        """The events appended at or after ``offset`` (from :meth:`size`)."""
        yield from self.tail(offset)[0]

    def tail(self, offset: Offset) -> tuple[list[dict], Offset]:
        """The complete events appended at or after ``offset`` (0: the beginning), and the
        offset to read on from: a line still being written is left for the next call."""
        cursor = offset if isinstance(offset, Cursor) else Cursor(offset)
        events, lines = self._lines_from(cursor.lines)
        if self.local:
            return events, lines
        new = [n for n in self._names() if n not in cursor.seen and _ms(n) >= cursor.horizon_ms]
        events += self._objects(new)
        return events, self._advance(Cursor(lines, cursor.seen, cursor.horizon_ms), new)

    def read(self) -> Iterator[dict]:
        """Every event: the JSON lines, then the event objects in time order."""
        try:
            with self.fs.open(self.path, "r") as f:
                for line in f:
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue  # torn line from a crash mid-append
        except FileNotFoundError:
            pass
        names = self._names()
        for i in range(0, len(names), 500):
            yield from self._objects(names[i:i + 500])
