"""Options of the Kinesis source: parsing, validation, and the positions Spark checkpoints.

A shard's position in the offset JSON ``{stream: {shardId: position}}`` is one of:

- a sequence number (digits): the last record read; reading continues after it;
- ``TRIM_HORIZON``: nothing read yet, start at the oldest record the shard keeps;
- ``AT_SEQUENCE_NUMBER:<seq>``: nothing read yet, start at record ``<seq>`` (a resolved
  ``AT_TIMESTAMP`` start);
- ``SHARD_END``: a closed shard read to its end (its children may then be read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pyspark.sql.types import BinaryType, StringType, StructField, StructType, TimestampType

from onceflow.errors import ConfigError, OnceflowError

NAME = "onceflow-kinesis"

SCHEMA = StructType([
    StructField("data", BinaryType()),
    StructField("stream", StringType()),
    StructField("shardId", StringType()),
    StructField("sequenceNumber", StringType()),
    StructField("partitionKey", StringType()),
    StructField("approximateArrivalTimestamp", TimestampType()),
])

TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END = "TRIM_HORIZON", "LATEST", "AT_TIMESTAMP", "SHARD_END"
AT_SEQ = "AT_SEQUENCE_NUMBER:"

OPTIONS = {
    "streams": "comma-separated Kinesis stream names (required)",
    "startingPosition": "TRIM_HORIZON | LATEST (default) | AT_TIMESTAMP | JSON "
                        "{\"stream\":{\"shardId-000000000000\":\"<sequence number>\"}}",
    "startingTimestamp": "with AT_TIMESTAMP: epoch ms or ISO-8601 time",
    "maxRecordsPerTrigger": "cap on records per micro-batch, split across readable shards (default none)",
    "failOnDataLoss": "true (default) | false: skip and count records trimmed before they were read",
    "region": "AWS region (default: the boto3 chain's, else us-east-1)",
    "endpointUrl": "Kinesis endpoint URL (kinesalite, LocalStack, VPC endpoints)",
    "awsAccessKeyId": "credentials (default: the boto3 chain: environment, profile, role)",
    "awsSecretAccessKey": "secret of awsAccessKeyId (never printed)",
    "awsSessionToken": "session token (never printed)",
    "profileName": "a profile of ~/.aws/config",
    "pollTimeoutMs": "max wait for a planned record while reading (default 120000)",
    "requestTimeoutMs": "timeout of one Kinesis request (default 10000)",
    "maxRetries": "attempts for throttled or failed requests, with back-off (default 10)",
    "eventLog": "the query's checkpoint directory (set by onceflow Jobs): data loss and throttling "
                "are counted in its event log, the initial positions of a new query are kept there",
}
_KNOWN = {k.lower(): k for k in OPTIONS}
#: Options whose values are never printed (repr, errors, logs).
SECRET_OPTIONS = ("awssecretaccesskey", "awssessiontoken", "awsaccesskeyid")

ShardKey = tuple[str, str]  # (stream, shardId)
Positions = dict[ShardKey, str]

_SEQ = re.compile(r"^\d{1,128}$")
_STREAM = re.compile(r"^[a-zA-Z0-9_.-]{1,128}$")
_SHARD = re.compile(r"^shardId-\d{12}$")


class KinesisDataLossError(OnceflowError):
    """Records the query still had to read are gone (trimmed by retention, stream re-created)."""


def _fail(msg: str) -> ConfigError:
    return ConfigError(f"{NAME}: {msg}")


def is_seq(position: str) -> bool:
    return bool(_SEQ.match(position))


@dataclass(frozen=True)
class Settings:
    """Validated source options (picklable: shipped to the Python workers)."""

    streams: tuple[str, ...]
    starting: str | dict[str, dict[str, str]] = LATEST
    starting_timestamp: float | None = None  # epoch seconds
    max_records_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    region: str | None = None
    endpoint_url: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    profile_name: str | None = None
    poll_timeout_ms: int = 120_000
    request_timeout_ms: int = 10_000
    max_retries: int = 10
    event_log: str | None = None

    def __repr__(self) -> str:  # never print credentials
        shown = {k: ("***" if k.startswith("aws_") and v else v) for k, v in self.__dict__.items()}
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def where(self) -> str:
        return self.endpoint_url or f"Kinesis in {self.region or 'the default region'}"


def _int_option(opts: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise _fail(f"option {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise _fail(f"option {name}={value} must be at least {minimum}")
    return value


def _timestamp(raw: str) -> float:
    text = raw.strip()
    if text.isdigit():
        return int(text) / 1000
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise _fail(f"startingTimestamp {raw!r} is neither epoch milliseconds nor an ISO-8601 "
                    "time like 2026-11-24T08:00:00Z") from None


def _parse_starting(raw: str, streams: tuple[str, ...]) -> str | dict[str, dict[str, str]]:
    text = raw.strip()
    if text.upper() in (TRIM_HORIZON, LATEST, AT_TIMESTAMP):
        return text.upper()
    hint = ("startingPosition must be TRIM_HORIZON, LATEST, AT_TIMESTAMP (with startingTimestamp) "
            "or JSON like {\"stream\":{\"shardId-000000000000\":\"4959...\"}} (a sequence number = "
            "the last record already consumed; or TRIM_HORIZON / LATEST per shard)")
    try:
        parsed = json.loads(text)
    except ValueError:
        raise _fail(f"{hint}; got {raw!r}") from None
    ok = isinstance(parsed, dict) and parsed and all(
        isinstance(shards, dict) and shards and all(
            isinstance(s, str) and _SHARD.match(s) and isinstance(p, str)
            and (is_seq(p) or p.upper() in (TRIM_HORIZON, LATEST)) for s, p in shards.items())
        for shards in parsed.values())
    if not ok:
        raise _fail(f"{hint}; got {raw!r}")
    extra = sorted(set(parsed) - set(streams))
    if extra:
        raise _fail(f"startingPosition names stream(s) {', '.join(extra)} that are not in streams")
    return {st: {s: (p if is_seq(p) else p.upper()) for s, p in shards.items()}
            for st, shards in parsed.items()}


def parse_options(options: Mapping[str, Any]) -> Settings:
    """Validate Spark options (no AWS contact); raise ConfigError naming the bad option."""
    opts = {str(k).lower(): str(v) for k, v in options.items() if str(k).lower() != "path"}
    unknown = sorted(k for k in opts if k not in _KNOWN)
    if unknown:
        raise _fail(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    streams = tuple(s.strip() for s in opts.get("streams", "").split(",") if s.strip())
    if not streams:
        raise _fail("option streams is required, e.g. 'orders' or 'orders,payments'")
    bad = [s for s in streams if not _STREAM.match(s)]
    if bad:
        raise _fail(f"{', '.join(map(repr, bad))} is not a valid stream name "
                    "(1-128 characters of a-z, A-Z, 0-9, _ . -)")
    starting = _parse_starting(opts.get("startingposition", LATEST), streams)
    ts_raw = opts.get("startingtimestamp")
    if (starting == AT_TIMESTAMP) != (ts_raw is not None):
        raise _fail("startingPosition=AT_TIMESTAMP needs startingTimestamp (epoch ms or ISO-8601), "
                    "and startingTimestamp is only used with AT_TIMESTAMP")
    fail_raw = opts.get("failondataloss", "true").strip().lower()
    if fail_raw not in ("true", "false"):
        raise _fail(f"option failOnDataLoss must be true or false, got {fail_raw!r}")
    key, secret = opts.get("awsaccesskeyid"), opts.get("awssecretaccesskey")
    if bool(key) != bool(secret):
        raise _fail("set both awsAccessKeyId and awsSecretAccessKey, or neither (boto3's chain)")
    endpoint = opts.get("endpointurl") or None
    if endpoint and not re.match(r"^https?://[^/\s]+", endpoint):
        raise _fail(f"endpointUrl {endpoint!r} must look like http://host:port or https://host")
    return Settings(
        streams=streams,
        starting=starting,
        starting_timestamp=_timestamp(ts_raw) if ts_raw is not None else None,
        max_records_per_trigger=_int_option(opts, "maxRecordsPerTrigger", None, 1),
        fail_on_data_loss=fail_raw == "true",
        region=opts.get("region") or None,
        endpoint_url=endpoint,
        aws_access_key_id=key or None,
        aws_secret_access_key=secret or None,
        aws_session_token=opts.get("awssessiontoken") or None,
        profile_name=opts.get("profilename") or None,
        poll_timeout_ms=_int_option(opts, "pollTimeoutMs", 120_000, 1),
        request_timeout_ms=_int_option(opts, "requestTimeoutMs", 10_000, 1),
        max_retries=_int_option(opts, "maxRetries", 10, 1),
        event_log=opts.get("eventlog") or None,
    )


def to_json(positions: Positions) -> dict[str, dict[str, str]]:
    """``{(stream, shard): pos}`` -> ``{"stream": {"shardId-...": pos}}`` (sorted)."""
    out: dict[str, dict[str, str]] = {}
    for (st, sh), pos in sorted(positions.items()):
        out.setdefault(st, {})[sh] = pos
    return out


def from_json(offsets: Mapping[str, Mapping[str, str]] | None) -> Positions:
    return {(st, sh): str(p) for st, shards in (offsets or {}).items() for sh, p in shards.items()}


def after(a: str, b: str) -> bool:
    """Position ``a`` is further along one shard than ``b``."""
    def rank(p: str) -> tuple[int, int]:
        if p == SHARD_END:
            return (3, 0)
        if is_seq(p):
            return (2, int(p))
        if p.startswith(AT_SEQ):
            return (1, int(p[len(AT_SEQ):]))  # before the record itself
        return (0, 0)  # TRIM_HORIZON
    ra, rb = rank(a), rank(b)
    if ra[0] in (1, 2) and rb[0] in (1, 2):
        # AT_SEQUENCE_NUMBER:s is just before s; sequence number s is just after s.
        return (ra[1], ra[0]) > (rb[1], rb[0])
    return ra > rb
