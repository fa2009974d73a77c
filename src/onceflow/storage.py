"""Object stores: one ``storage_options`` mapping for fsspec and delta-rs.

onceflow reaches a URL two ways: fsspec (checkpoint reading, event log, lease, savepoints, the
Delta sink's task files) and delta-rs (the Delta log). Both take options, in two vocabularies:
s3fs says ``key``/``secret``/``endpoint_url``/``client_kwargs={"region_name": ...}``, delta-rs
says ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_ENDPOINT_URL``/``AWS_REGION``. A
``storage_options`` mapping may use either (or both); :func:`fsspec_options` and
:func:`delta_options` translate it for each side. ``s3a://`` and ``s3n://`` URLs (what Spark
users write) are read as ``s3://``.

Where the options come from, first match wins:

1. the component's own (``DeltaSink(storage_options=...)``);
2. the job's (``Job(storage_options=...)``, registered for the process by :func:`configure`);
3. the environment variable ``ONCEFLOW_STORAGE_OPTIONS`` (JSON; what the CLI commands that
   have no job, ``onceflow savepoint``/``checkpoints``/``stop``, use).

Each is either one flat mapping, which applies to every URL that is not local, or a mapping
from URL prefixes to flat mappings (``{"s3://lake": {...}, "gs://archive": {...}}``; the
longest matching prefix wins). Local paths never get options.

Secrets (S3 ``secret``/``key``/``token``, Azure ``account_key``/``connection_string``/
``sas_token``/``client_secret``, GCS ``token``/credentials, their delta-rs spellings) are
redacted by one function, :func:`redact`, wherever onceflow shows them: ``repr`` of a
:class:`StorageOptions`, log records and event-log lines of a process that has seen storage
options (every secret value it parsed is masked in any text), and, through
:func:`spark_redaction_conf`, Spark's own plans, UI, event log and Spark Connect statements,
whose default ``spark.redaction.regex`` misses ``account_key`` and ``connection_string``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, overload

from onceflow.errors import ConfigError

ENV = "ONCEFLOW_STORAGE_OPTIONS"
SECRET = re.compile(r"(?i)secret|password|token|key|credential|sas|connection[_-]?string|signature")
#: Spark's default ``spark.redaction.regex`` (matched against setting/option names and values)
SPARK_DEFAULT_REDACTION = r"(?i)secret|password|token|access[.]?key"
#: what onceflow adds to it: object-store secrets Spark's default misses, and onceflow's own
#: ``storage_options`` option (its whole JSON value is hidden), also in pyiceberg's hyphenated
#: spelling (``adls.account-key``, ``adls.connection-string``) that an Iceberg ``catalog`` may carry
SPARK_REDACTION = (SPARK_DEFAULT_REDACTION + r"|account[._-]?key|connection[._-]?string"
                   r"|sas[._-]?token|credential|storage_options")
#: a secret inside free text: ``name: value``/``name=value`` (JSON, dict repr, connection
#: strings, SAS query strings, the JSON escaped inside a Spark Connect plan) and PEM private
#: keys. Valid for Python's ``re`` and Java's regex alike (``spark.sql.redaction.string.regex``).
SECRET_TEXT = (
    r"(?i)(?:((?:account[_.-]?key|accountkey|connection[_.-]?string|sas[_.-]?token|client[_.-]?secret"
    r"|secret[_.-]?access[_.-]?key|session[_.-]?token|private[_.-]?key|sharedaccesssignature|secret"
    r"|token|password|credentials?|sig|(?<=['\x22])key(?=\\*['\x22]))\\*['\x22]?\s*[:=]\s*\\*['\x22]?)"
    r"[^'\x22\\;&,}\s]+"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)
_SECRET_TEXT = re.compile(SECRET_TEXT)
_KNOWN: set[str] = set()  # secret values this process has parsed (masked in any text)
_KNOWN_LOCK = threading.Lock()
_LOCAL = {"", "file", "local"}
_ALIASES = {"s3a": "s3", "s3n": "s3"}
#: scheme -> (extra, package) for the "pip install" hint
_EXTRAS = {"s3": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
           "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"), "az": ("azure", "adlfs"),
           "adl": ("azure", "adlfs")}
#: (fsspec key, dotted for nested, delta-rs key) per scheme family
_S3 = (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"),
       ("token", "AWS_SESSION_TOKEN"), ("endpoint_url", "AWS_ENDPOINT_URL"),
       ("client_kwargs.region_name", "AWS_REGION"), ("profile", "AWS_PROFILE"),
       ("anon", "AWS_SKIP_SIGNATURE"))
_GCS = (("token", "GOOGLE_SERVICE_ACCOUNT"),)  # gcsfs token as a path to a service-account JSON
_AZURE = (("account_name", "AZURE_STORAGE_ACCOUNT_NAME"), ("account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
          ("sas_token", "AZURE_STORAGE_SAS_TOKEN"), ("client_id", "AZURE_CLIENT_ID"),
          ("client_secret", "AZURE_CLIENT_SECRET"), ("tenant_id", "AZURE_TENANT_ID"))
_KEYS = {"s3": _S3, "gs": _GCS, "gcs": _GCS, "abfs": _AZURE, "abfss": _AZURE, "az": _AZURE}


def _is_delta_key(key: str) -> bool:
    """delta-rs (object_store) keys: ``AWS_*``/``GOOGLE_*``/``AZURE_*`` in any case, or upper case."""
    return bool(re.match(r"(?i)(?:aws|google|azure)_", key)) or (key.isupper() and key.replace("_", "").isalnum())


_configured: dict[str, Any] | None = None


class StorageOptions(dict):
    """A plain dict (fsspec, delta-rs and JSON take it as is) whose repr hides secret values."""

    def __repr__(self) -> str:
        return f"StorageOptions({redact(self)!r})"

    __str__ = __repr__


@overload
def redact(value: Mapping[str, Any]) -> dict[str, Any]: ...
@overload
def redact(value: str) -> str: ...
def redact(value: Mapping[str, Any] | str) -> dict[str, Any] | str:
    """Secrets masked with ``***``: of a mapping, a copy with every value whose key looks secret
    masked (nested too, and secrets inside the other string values); of a text, every
    ``name=value``/``"name": "value"`` whose name looks secret, PEM private keys, and every
    secret value this process has parsed from storage options, in whatever form it appears."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(v, Mapping):
                out[k] = redact(v)
            elif SECRET.search(str(k)):
                out[k] = "***"
            else:
                out[k] = redact(v) if isinstance(v, str) else v
        return out
    text = _SECRET_TEXT.sub(lambda m: f"{m.group(1)}***" if m.group(1) else "***", str(value))
    for secret in sorted(_KNOWN, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _remember(options: Mapping[str, Any]) -> None:
    """Note the secret values of ``options`` (and of connection strings in them) so that
    :func:`redact` masks them in any text, and mask them in this process's log records."""
    found = set()

    def walk(d: Mapping[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, Mapping):
                walk(v)
            elif isinstance(v, str) and SECRET.search(str(k)):
                found.add(v)
                found.update(m.group(0)[len(m.group(1) or ""):] for m in _SECRET_TEXT.finditer(v))
    walk(options)
    found = {f for f in found if len(f) >= 8}  # short values ("true", a region) are no secrets
    with _KNOWN_LOCK:
        new = found - _KNOWN
        if new and not _KNOWN:
            _redact_log_records()
        _KNOWN.update(new)


def _redact_log_records() -> None:
    """From now on every log record of this process is created with its secrets masked."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: leave it to logging's own report
            return record
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    logging.setLogRecordFactory(factory)


def spark_redaction_conf(conf: Mapping[str, str], *, connect: bool = False) -> dict[str, str]:
    """``conf`` plus the settings that make Spark redact object-store secrets:
    ``spark.redaction.regex`` (settings and options by name or value: UI, event log, plans;
    a setting of the Spark application, so not on Spark Connect) extended with
    :data:`SPARK_REDACTION`, ``spark.sql.redaction.options.regex`` likewise (per session), and
    ``spark.sql.redaction.string.regex`` = :data:`SECRET_TEXT` (plan and statement text, e.g.
    the Spark Connect UI's statements). A value the user gave is kept and extended, not replaced."""
    out = dict(conf)

    def extend(key: str, ours: str, default: str | None) -> None:
        given = out.get(key) or default
        out[key] = ours if not given or given == ours else f"(?:{given})|(?:{ours})"

    if not connect:
        extend("spark.redaction.regex", SPARK_REDACTION, None)
    extend("spark.sql.redaction.options.regex", SPARK_REDACTION, "(?i)url")
    extend("spark.sql.redaction.string.regex", SECRET_TEXT, None)
    return out


def as_options(options: Mapping[str, Any] | str | None, what: str) -> StorageOptions | None:
    """Validate ``options`` (a mapping, or its JSON text) into :class:`StorageOptions`."""
    if options is None:
        return None
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError as e:
            raise ConfigError(f"{what} is not valid JSON ({e}); give a JSON object of options") from None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"{what} must be a mapping of option names to values (or of URL prefixes "
                          "to such mappings)")
    _remember(options)
    return StorageOptions(options)


def configure(options: Mapping[str, Any] | None) -> StorageOptions | None:
    """Register the job's storage options for this process (``Job(storage_options=...)``)."""
    global _configured
    _configured = as_options(options, "Job.storage_options")
    return _configured


def in_effect(own: Mapping[str, Any] | None = None) -> StorageOptions | None:
    """The whole mapping that applies in this process: ``own``, else the job's, else
    ``ONCEFLOW_STORAGE_OPTIONS`` (what a sink ships to its executors, which have no job, when
    the URLs it will reach are not known yet)."""
    for candidate in (own, _configured, as_options(os.environ.get(ENV) or None, ENV)):
        if candidate:
            return StorageOptions(candidate)
    return None


def normalize_url(url: str) -> str:
    """``s3a://b/k`` and ``s3n://b/k`` -> ``s3://b/k``; anything else unchanged."""
    scheme, sep, rest = str(url).partition("://")
    return f"{_ALIASES[scheme.lower()]}://{rest}" if sep and scheme.lower() in _ALIASES else str(url)


def scheme_of(url: str) -> str:
    scheme, sep, _ = normalize_url(url).partition("://")
    return scheme.lower() if sep else ""


def _pick(options: Mapping[str, Any] | None, url: str) -> dict[str, Any] | None:
    """The flat options of ``options`` that apply to ``url`` (None: the mapping does not apply)."""
    if not options:
        return None
    if all("://" in k for k in options):  # keyed by URL prefix
        url = normalize_url(url)
        hits = [k for k in options if url.startswith(normalize_url(k).rstrip("/"))]
        return dict(options[max(hits, key=len)]) if hits else None
    return dict(options)


def resolve(url: str, own: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The storage options for ``url``: ``own``, else the job's, else ``ONCEFLOW_STORAGE_OPTIONS``."""
    if scheme_of(url) in _LOCAL:
        return {}
    for candidate in (own, _configured, as_options(os.environ.get(ENV) or None, ENV)):
        picked = _pick(candidate, url)
        if picked is not None:
            return picked
    return {}


def get_dotted(d: Mapping[str, Any], dotted: str) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``; None where a level is missing."""
    for part in dotted.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return None
        d = d[part]
    return d


def _delta_value(options: Mapping[str, Any], key: str) -> Any:
    for k, v in options.items():
        if k.upper() == key:
            return v
    return None


def fsspec_options(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` in fsspec's vocabulary for ``url``'s filesystem (delta-rs keys translated,
    untranslatable delta-rs keys dropped). Listings are not cached (another process's lease
    records and events must be seen), unless ``use_listings_cache`` is given."""
    scheme = scheme_of(url)
    if scheme in _LOCAL:
        return {}
    out: dict[str, Any] = {k: v for k, v in options.items() if not _is_delta_key(k)}
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in out.items()}
    for fs_key, delta_key in _KEYS.get(scheme, ()):
        value = _delta_value(options, delta_key)
        if value is None or get_dotted(out, fs_key) is not None:
            continue
        if delta_key == "AWS_SKIP_SIGNATURE":
            value = str(value).lower() == "true"
        *parents, leaf = fs_key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    out.setdefault("use_listings_cache", False)
    return out


def delta_options(url: str, options: Mapping[str, Any]) -> dict[str, str]:
    """``options`` in delta-rs's vocabulary (string values) for ``url``: fsspec keys translated,
    fsspec-only keys dropped. An ``http://`` S3 endpoint turns on ``AWS_ALLOW_HTTP``."""
    scheme = scheme_of(url)
    if scheme in _LOCAL:
        return {}
    out = {k: v for k, v in options.items() if _is_delta_key(k)}
    for fs_key, delta_key in _KEYS.get(scheme, ()):
        value = get_dotted(options, fs_key)
        if value is not None and _delta_value(out, delta_key) is None:
            out[delta_key] = value
    endpoint = _delta_value(out, "AWS_ENDPOINT_URL")
    if scheme == "s3" and str(endpoint or "").startswith("http://") and _delta_value(out, "AWS_ALLOW_HTTP") is None:
        out["AWS_ALLOW_HTTP"] = "true"
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in out.items()}


def url_to_fs(url: str, storage_options: Mapping[str, Any] | None = None):
    """``fsspec.core.url_to_fs`` with the resolved storage options (see the module doc);
    a missing filesystem package is one line naming the extra to install."""
    from fsspec.core import url_to_fs as _url_to_fs

    url = normalize_url(url)
    try:
        return _url_to_fs(url, **fsspec_options(url, resolve(url, storage_options)))
    except ImportError as e:
        extra, package = _EXTRAS.get(scheme_of(url), (None, None))
        if extra is None:
            raise ConfigError(f"cannot open {url}: {e}") from None
        raise ConfigError(f"{url} needs the {package} package: pip install 'onceflow[{extra}]'") from None


def delta_target(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, str]]:
    """(table URL, delta-rs storage options) for ``DeltaTable``/``write_deltalake``."""
    url = normalize_url(url)
    return url, delta_options(url, resolve(url, storage_options))


def is_local(fs) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def write_whole(fs, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a
    part: locally a temporary file renamed over it; on an object store one PUT (an object
    appears whole; no rename, which object stores emulate by copy and delete)."""
    if is_local(fs):
        import uuid

        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)
