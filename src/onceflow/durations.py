"""Durations as users write them: ``10``, ``2.5``, ``"10 s"``, ``"500ms"``, ``"1 min"``, ``"1 h"``.

Shared by :mod:`onceflow.job` and :mod:`onceflow.runtime.restart` (kept apart from both to
avoid an import cycle). A bare number means seconds.
"""

from __future__ import annotations

import re

from onceflow.errors import ConfigError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|sec|seconds?|m|min|minutes?|h|hours?)?\s*$")
_UNIT = {"ms": 0.001, "s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60,
         "minute": 60, "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600}


def seconds(value: float | int | str | None, what: str) -> float | None:
    """Parse ``10``, ``"10 s"``, ``"500ms"``, ``"1 min"`` into seconds (None stays None).

    Raises ConfigError naming ``what`` when the text is not a duration.
    """
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise ConfigError(f"{what}: cannot read {value!r} as a duration; use e.g. 10, '10 s', '500 ms', '1 min'")
    return float(m.group(1)) * _UNIT[m.group(2) or "s"]
