"""Optional dependencies: which extra installs what, and one line when one is missing.

``pip install onceflow`` installs what every job needs (PySpark with pandas and pyarrow, the
lease, the CLI, metrics). Sinks, sources and tools whose libraries are heavy or rarely needed
come with extras (``pyproject.toml``); code that needs one calls :func:`require` first, so a
missing library is one ``error:`` line naming the extra to install, never an ImportError trace.
"""

from __future__ import annotations

import importlib.util

from onceflow.errors import ConfigError

# extra -> the top-level modules it installs (kept equal to pyproject.toml: tests/test_install.py)
EXTRAS: dict[str, tuple[str, ...]] = {
    "delta": ("deltalake",),
    "charts": ("matplotlib",),
    "verify": ("deltalake", "matplotlib", "psycopg", "confluent_kafka", "pyiceberg"),
    "postgres": ("psycopg",),
    "kafka": ("confluent_kafka",),
    "kinesis": ("boto3",),
    "iceberg": ("pyiceberg",),
    "s3": ("s3fs",),
    "gcs": ("gcsfs",),
    "azure": ("adlfs",),
}


class MissingExtra(ConfigError, ImportError):
    """A library of an extra is not installed (an ImportError too: optional sinks stay optional)."""


def missing(extra: str) -> str | None:
    """The first module of ``extra`` that is not installed, or None."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            return module
    return None


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` (one line: ``what`` needs X: pip install 'onceflow[extra]')
    unless every module of ``extra`` is installed."""
    module = missing(extra)
    if module is not None:
        raise MissingExtra(f"{what} needs {module}: pip install 'onceflow[{extra}]'", name=module)
