"""onceflow's log output: one configuration for the CLI, the supervisor, drivers and standbys.

``onceflow --log-level LEVEL --log-format text|json`` sets ``ONCEFLOW_LOG_LEVEL`` and
``ONCEFLOW_LOG_FORMAT``, which every process it starts inherits; each process calls
:func:`configure` with its role. ``json`` writes one object per line (``time`` in UTC ISO 8601,
``level``, ``logger``, ``message``, ``role``, ``job``, ``pid``, and ``exc`` with a traceback)
for log shippers; ``text`` is ``<time> <role> <LEVEL> <message>``. The Spark JVM's own lines
(log4j, on the same stderr) are not onceflow's to format: ``ONCEFLOW_SPARK_LOG_LEVEL`` sets
their level.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

from onceflow.settings import LOG_FORMAT_ENV, LOG_LEVEL_ENV, setting

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
_state: dict[str, str | None] = {"job": None, "role": "onceflow"}
_MARK = "_onceflow_handler"


def set_job(name: str | None) -> None:
    """Name the job in every later record (the ``job`` field of JSON lines)."""
    _state["job"] = name


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "role": _state["role"], "job": _state["job"], "pid": record.process,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def current_role() -> str:
    return _state["role"] or "onceflow"


def level() -> str:
    value = (setting(LOG_LEVEL_ENV) or "INFO").upper()
    return value if value in LEVELS else "INFO"


def json_format() -> bool:
    return (setting(LOG_FORMAT_ENV) or "text").lower() == "json"


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (a test runner or
    click's CliRunner may swap it), like logging's own last-resort handler."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def configure(role: str, stream: TextIO | None = None) -> None:
    """(Re)configure the root logger for this process as ``role`` (supervisor, driver,
    standby, onceflow), from ``ONCEFLOW_LOG_LEVEL`` and ``ONCEFLOW_LOG_FORMAT``. Replaces the
    handler an earlier call installed; handlers others installed are left alone."""
    _state["role"] = role
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)
    handler: logging.StreamHandler = logging.StreamHandler(stream) if stream else _Stderr()
    setattr(handler, _MARK, True)
    handler.setFormatter(JsonFormatter() if json_format()
                         else logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(level())
    for noisy in ("py4j", "urllib3", "botocore", "s3fs", "fsspec", "aiobotocore"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))


def error_line(text: str, prefix: str = "error") -> None:
    """A one-line error for the user on stderr: ``error: text``, or a JSON line (level ERROR)
    when the log format is json, so that a log shipper reads every line of stderr."""
    if json_format():
        message = text if prefix == "error" else f"{prefix}: {text}"
        record = logging.LogRecord("onceflow", logging.ERROR, "", 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
    else:
        print(f"{prefix}: {text}", file=sys.stderr, flush=True)


def env_for(level_name: str | None, fmt: str | None) -> dict[str, str]:
    """The environment entries that hand ``--log-level`` / ``--log-format`` to child processes."""
    out = {}
    if level_name:
        out[LOG_LEVEL_ENV] = level_name.upper()
    if fmt:
        out[LOG_FORMAT_ENV] = fmt.lower()
    return out


def apply_to_environ(level_name: str | None, fmt: str | None) -> None:
    os.environ.update(env_for(level_name, fmt))
