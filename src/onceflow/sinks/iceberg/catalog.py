"""The Iceberg catalog an :class:`~onceflow.sinks.iceberg.IcebergSink` commits through.

One small surface, resolved once per process and handed down:

* a SQLAlchemy URL -> pyiceberg's SQL catalog on that database: ``sqlite:///path/catalog.db``
  (the embedded default: one file next to the warehouse, nothing to run) or
  ``postgresql+psycopg://user:pw@host/db`` (a shared catalog; psycopg 3 is onceflow's PostgreSQL
  driver). ``warehouse`` is where new tables' files go; for SQLite it defaults to the directory
  ``warehouse`` beside the database file.
* a mapping of pyiceberg catalog properties (``{"type": "rest", "uri": ...}``, ``{"type":
  "glue"}``, ...) -> ``pyiceberg.catalog.load_catalog(name, **properties)``.

The exactly-once guarantee rests on the catalog's conditional commit: every commit of the sink
requires the ``main`` branch to still be at the snapshot it was based on. pyiceberg's SQL
catalog checks that against the current metadata and then swaps the metadata pointer only if
no one swapped it meanwhile (``UPDATE ... WHERE metadata_location = <the one it checked>``); a
REST catalog checks it on the server. Either way a commit based on stale metadata raises
``CommitFailedException`` and changes nothing.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from onceflow.errors import ConfigError, SinkError

_CATALOGS: dict[str, Any] = {}  # per process: spec -> pyiceberg Catalog
_LOCK = threading.Lock()


def catalog_spec(catalog: str | Mapping[str, Any], warehouse: str | None, name: str) -> dict[str, Any]:
    """The catalog as pyiceberg properties (``type``, ``uri``, ``warehouse``...), checked.

    Raises ConfigError naming what to give when ``catalog`` is neither a SQLAlchemy URL nor a
    mapping, or when a PostgreSQL catalog has no warehouse."""
    if isinstance(catalog, Mapping):
        props = {str(k): str(v) for k, v in catalog.items()}
        if warehouse:
            props.setdefault("warehouse", warehouse)
        return {"name": name, **props}
    if not isinstance(catalog, str) or "://" not in catalog:
        raise ConfigError(
            f"IcebergSink: catalog={catalog!r}; give a SQLAlchemy URL (sqlite:///path/catalog.db "
            "or postgresql+psycopg://user:pw@host/db) or a dict of pyiceberg catalog properties"
        )
    scheme = catalog.split("://", 1)[0]
    if scheme == "sqlite":
        db = catalog.split("sqlite:///", 1)[-1]
        if not db or db == catalog or db.startswith(":memory:"):
            raise ConfigError(
                f"IcebergSink: catalog={catalog!r}; an SQLite catalog must be a file every driver "
                "and executor reaches: sqlite:///absolute/path/catalog.db"
            )
        path = os.path.abspath(db)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        catalog = f"sqlite:///{path}"
        warehouse = warehouse or os.path.join(os.path.dirname(path), "warehouse")
    elif scheme.startswith("postgresql"):
        if scheme == "postgresql":  # SQLAlchemy's default driver is psycopg2; ours is psycopg 3
            catalog = "postgresql+psycopg://" + catalog.split("://", 1)[1]
        if not warehouse:
            raise ConfigError("IcebergSink: a PostgreSQL catalog needs warehouse= (a directory or "
                              "object-store URL every driver and executor reaches)")
    else:
        raise ConfigError(
            f"IcebergSink: catalog URL scheme {scheme!r} is not supported; use sqlite:///... or "
            "postgresql+psycopg://..., or a dict of pyiceberg catalog properties (REST, Glue, Hive)"
        )
    if warehouse and "://" not in warehouse:
        warehouse = "file://" + os.path.abspath(warehouse)
    return {"name": name, "type": "sql", "uri": catalog, "warehouse": warehouse}


def load(spec: Mapping[str, Any]) -> Any:
    """The pyiceberg catalog for ``spec`` (from :func:`catalog_spec`), one per process.

    A catalog that cannot be reached raises SinkError (an outage: the restart strategy waits
    it out); one that pyiceberg cannot build raises ConfigError."""
    key = json.dumps(dict(spec), sort_keys=True)
    with _LOCK:
        if key in _CATALOGS:
            return _CATALOGS[key]
        try:
            from pyiceberg.catalog import load_catalog
        except ImportError:
            raise ConfigError("IcebergSink needs pyiceberg: pip install 'onceflow[iceberg]'") from None
        props = {k: v for k, v in spec.items() if k != "name"}
        try:
            catalog = load_catalog(spec["name"], **props)
        except ImportError as e:
            raise ConfigError(f"IcebergSink: the catalog needs a package that is missing: {e}; "
                              "pip install 'onceflow[iceberg]' (PostgreSQL: 'onceflow[postgres]')") from None
        except ValueError as e:
            raise ConfigError(f"IcebergSink: pyiceberg cannot build the catalog: {e}") from None
        except Exception as e:  # noqa: BLE001 - database errors: the catalog is down or unreachable
            if type(e).__module__.startswith("sqlalchemy") and "already exists" in str(e):
                # Two processes created the catalog's own tables at once: they exist now.
                catalog = load_catalog(spec["name"], **props)
            else:
                raise SinkError(f"IcebergSink: cannot open the catalog {redacted(spec)}: {e}") from e
        _CATALOGS[key] = catalog
        return catalog


def redacted(spec: Mapping[str, Any]) -> str:
    """The catalog for messages: its URI without a password, never credentials."""
    uri = str(spec.get("uri", spec.get("type", "?")))
    if "@" in uri and "://" in uri:
        scheme, rest = uri.split("://", 1)
        uri = f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return uri
