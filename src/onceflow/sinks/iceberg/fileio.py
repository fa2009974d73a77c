"""onceflow's ``storage_options`` as pyiceberg FileIO properties, so one mapping serves both.

The Iceberg sink reaches the warehouse two ways: its tasks write (and its clean-up lists and
deletes) data files through fsspec with the resolved ``storage_options``
(:func:`onceflow.storage.url_to_fs`), while pyiceberg reads those files' footers, writes
metadata and manifests, and scans the table through its own FileIO, which takes only its own
properties (``s3.endpoint``, ``s3.access-key-id``, ...) from the catalog's properties.
:func:`file_io_properties` translates the options that apply to the warehouse URL (either
vocabulary :mod:`onceflow.storage` accepts: s3fs's or delta-rs's ``AWS_*``) into those
properties; :func:`with_storage` adds them to a catalog spec, never overriding a property the
user's catalog already gives.

An option whose meaning pyiceberg's FileIO cannot take (an S3 ``profile``, a GCS
service-account file, an Azure connection string) is a one-line ConfigError naming what to
give instead, rather than a FileIO that silently uses other credentials than the tasks.
Options that only tune fsspec (``use_listings_cache``, block sizes, ...) go to fsspec only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from onceflow.errors import ConfigError
from onceflow.storage import as_options, fsspec_options, get_dotted, resolve, scheme_of

#: s3fs option (dotted: nested) -> pyiceberg property (the ``client.*`` alias it has, if any)
_S3 = (("key", "s3.access-key-id", "client.access-key-id"),
       ("secret", "s3.secret-access-key", "client.secret-access-key"),
       ("token", "s3.session-token", "client.session-token"),
       ("endpoint_url", "s3.endpoint", None),
       ("client_kwargs.endpoint_url", "s3.endpoint", None),
       ("client_kwargs.region_name", "s3.region", "client.region"),
       ("anon", "s3.anonymous", None))
_AZURE = (("account_name", "adls.account-name", None), ("account_key", "adls.account-key", None),
          ("sas_token", "adls.sas-token", None), ("client_id", "adls.client-id", None),
          ("client_secret", "adls.client-secret", None), ("tenant_id", "adls.tenant-id", None))
_KEYS = {"s3": _S3, "abfs": _AZURE, "abfss": _AZURE, "az": _AZURE}
#: options pyiceberg's FileIO (pyarrow's filesystems) cannot take -> what to give instead
_REFUSED = {
    "s3": {"profile": "set AWS_PROFILE in the environment of the driver and the executors (pyarrow's "
                      "S3 reads it), or give key/secret"},
    "gs": {"token": "set GOOGLE_APPLICATION_CREDENTIALS to that file on the driver and the executors "
                    "(pyarrow's GCS reads it), or give the catalog property gcs.oauth2.token"},
    "gcs": {"token": "set GOOGLE_APPLICATION_CREDENTIALS to that file on the driver and the executors "
                     "(pyarrow's GCS reads it), or give the catalog property gcs.oauth2.token"},
    "abfs": {"connection_string": "give account_name with account_key or sas_token"},
    "abfss": {"connection_string": "give account_name with account_key or sas_token"},
    "az": {"connection_string": "give account_name with account_key or sas_token"},
}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def file_io_properties(url: str, options: Mapping[str, Any],
                       given: Mapping[str, Any] | None = None) -> dict[str, str]:
    """pyiceberg FileIO properties equivalent to ``options`` (flat, already picked for ``url``)
    for ``url``'s store; properties in ``given`` (the user's catalog properties) and their
    ``client.*`` aliases are left out. An S3 endpoint without a region gets ``s3.region`` from
    ``AWS_REGION``/``AWS_DEFAULT_REGION``, else ``us-east-1`` (as s3fs signs; pyiceberg would
    otherwise ask AWS for the bucket's region). ConfigError for an option pyiceberg cannot take."""
    scheme, given = scheme_of(url), given or {}
    if not options or scheme not in _KEYS and scheme not in _REFUSED:
        return {}
    fs = fsspec_options(url, options)  # delta-rs keys translated to fsspec's
    for name, instead in _REFUSED.get(scheme, {}).items():
        if fs.get(name) is not None and not _covered(scheme, given):
            raise ConfigError(f"IcebergSink: storage option {name!r} has no pyiceberg FileIO counterpart "
                              f"for {scheme}:// (pyiceberg reads and writes the table's metadata and "
                              f"files with it); {instead}")
    out: dict[str, str] = {}
    for option, prop, alias in _KEYS.get(scheme, ()):
        value = get_dotted(fs, option)
        if value is None or prop in out or prop in given or (alias and alias in given):
            continue
        out[prop] = _text(value)
    if scheme == "s3" and "s3.endpoint" in out and not ({"s3.region", "client.region"} & (set(out) | set(given))):
        out["s3.region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return out


def _covered(scheme: str, given: Mapping[str, Any]) -> bool:
    """The user's catalog properties configure this store's FileIO themselves."""
    prefix = {"s3": ("s3.", "client."), "gs": ("gcs.",), "gcs": ("gcs.",)}.get(scheme, ("adls.",))
    return any(str(k).startswith(prefix) for k in given)


def with_storage(spec: Mapping[str, Any], storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``spec`` (:func:`~onceflow.sinks.iceberg.catalog.catalog_spec`) plus the FileIO
    properties of the storage options that apply to its warehouse (``storage_options``, else
    the job's, else ``ONCEFLOW_STORAGE_OPTIONS``; see :func:`onceflow.storage.resolve`). A
    local warehouse, or none (a REST catalog that keeps its own), adds nothing."""
    warehouse = spec.get("warehouse")
    if not warehouse:
        return dict(spec)
    options = resolve(str(warehouse), storage_options)
    props = file_io_properties(str(warehouse), options, spec)
    if props:
        as_options(props, "IcebergSink FileIO properties")  # remember the secrets: masked in logs
    return {**spec, **props}
