"""How this run of a job started: the answer to Flink's ``isRestored``, given to the job.

A job's ``source`` and ``transform`` may take a second positional argument: a
:class:`RestoreContext`. One-argument functions keep working (they are called as before).

Exactly-once never depends on it: a source's start position is decided by Spark's checkpoint
(offsets planned in ``offsets/N``), never by the job code. The context is for what the job
itself chooses, e.g. logging, a side input to load, or refusing to start fresh in production.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from onceflow.checkpoint.eventlog import EVENTS_DIR
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import ConfigError, OnceflowError

log = logging.getLogger("onceflow.context")

Start = Literal["fresh", "resumed", "restored"]

#: the restore record of a checkpoint (written by :mod:`onceflow.savepoint.restore`)
MARKER = f"{EVENTS_DIR}/restore.json"


@dataclass(frozen=True)
class RestoreContext:
    """How the query now starting was started.

    ``start``: ``"fresh"`` (no batch was ever planned in the checkpoint), ``"resumed"`` (the
    checkpoint's own progress: after a crash, a stop, a restart or a standby takeover) or
    ``"restored"`` (this run has just restored a savepoint into the checkpoint).
    ``savepoint``, ``restore_mode`` (``resume``, ``fork`` or ``rollback``) and ``rescaled_to``
    describe the savepoint the checkpoint was restored from, on that run and on every later
    run of the same checkpoint (``None`` when it never was). ``lineage`` is the query id in the
    checkpoint (``None`` until a fresh query first starts). ``attempt`` counts restarts since
    ``onceflow run`` (or ``job.run()``) began: 0 on the first start, then +1 per driver or
    query restart.
    """

    start: Start
    attempt: int = 0
    lineage: str | None = None
    savepoint: str | None = None
    restore_mode: str | None = None
    rescaled_to: int | None = None

    @property
    def is_restored(self) -> bool:
        """Flink's ``isRestored()``: the job continues from a checkpoint or a savepoint."""
        return self.start != "fresh"

    @property
    def from_savepoint(self) -> bool:
        """The checkpoint's state came from a savepoint (on this run or an earlier one)."""
        return self.savepoint is not None

    @property
    def forked(self) -> bool:
        """The savepoint was restored under a new lineage (``--fork``, or a roll back)."""
        return self.restore_mode in ("fork", "rollback")


def checkpoint_context(checkpoint: CheckpointDir | str, *, restored_now: bool = False,
                       attempt: int = 0) -> RestoreContext:
    """The context of a query about to start on ``checkpoint``.

    ``restored_now``: this run has just restored a savepoint (the first query after it)."""
    ckpt = CheckpointDir.of(checkpoint)
    try:
        lineage = ckpt.read_lineage() if ckpt.exists() else None
        planned = bool(ckpt.offset_batches()) if lineage else False
    except (OSError, OnceflowError):
        lineage, planned = None, False
    marker = restore_marker(ckpt) or {}
    start: Start = "restored" if restored_now else "resumed" if planned else "fresh"
    return RestoreContext(start, attempt, lineage, marker.get("savepoint"), marker.get("mode"),
                          marker.get("rescaled_to"))


def restore_marker(checkpoint: CheckpointDir | str) -> dict | None:
    """The completed restore record of a checkpoint (savepoint, mode, lineage, rescaled_to), if any."""
    ckpt = CheckpointDir.of(checkpoint)
    marker = read_marker(ckpt.fs, ckpt._p(MARKER))
    return marker if marker and marker.get("status") == "done" else None


def read_marker(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _positional(fn: Callable) -> tuple[int, int, bool] | None:
    """(required, total, var) positional parameters of ``fn``; None when not inspectable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    pos = [p for p in params if p.kind in kinds]
    required = sum(p.default is inspect.Parameter.empty for p in pos)
    var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return required, len(pos), var


def check_arity(fn: Callable, what: str) -> None:
    """Refuse a ``source``/``transform`` that cannot be called with one or two arguments."""
    shape = _positional(fn)
    if shape is not None and shape[0] > 2:
        raise ConfigError(f"{what} takes {shape[0]} required arguments: give it one "
                          f"({'spark' if what.endswith('source') else 'df'}) or two (and the "
                          "RestoreContext)")
    if shape is not None and shape[1] == 0 and not shape[2]:
        raise ConfigError(f"{what} takes no argument: it must take "
                          f"{'spark' if what.endswith('source') else 'df'} (and, optionally, "
                          "the RestoreContext)")


def call(fn: Callable, arg: Any, context: RestoreContext) -> Any:
    """``fn(arg, context)`` when ``fn`` has a second required positional parameter (or
    ``*args``), else ``fn(arg)``."""
    shape = _positional(fn)
    if shape is not None and (shape[0] >= 2 or shape[2]):
        return fn(arg, context)
    return fn(arg)
