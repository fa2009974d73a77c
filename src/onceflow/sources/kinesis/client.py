"""boto3 plumbing of the Kinesis source: one client per settings, retries, error lines.

Guarantees:
- Throttling (``ProvisionedThroughputExceededException``, ``LimitExceededException``) and
  transient failures (connection errors, 5xx) are retried with exponential back-off and jitter
  (tenacity, up to ``maxRetries`` attempts; botocore's own retries are off so every attempt is
  seen); each throttled attempt is counted in :data:`THROTTLED` and logged, every other retry
  is logged as one line too (what failed, why, which retry, when).
- Errors become one line saying what is wrong and what to do; credentials never appear in
  them (botocore does not put secrets in its messages, and nothing here prints settings).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from onceflow.errors import ConfigError, SourceError
from onceflow.sources.kinesis.options import NAME, Settings, _fail

log = logging.getLogger("onceflow.sources.kinesis")

T = TypeVar("T")

THROTTLE_CODES = {"ProvisionedThroughputExceededException", "LimitExceededException",
                  "ThrottlingException"}
TRANSIENT_CODES = {"InternalFailure", "ServiceUnavailable", "InternalFailureException",
                   "KMSThrottlingException"}
AUTH_CODES = {"UnrecognizedClientException", "InvalidSignatureException", "AccessDeniedException",
              "MissingAuthenticationTokenException", "IncompleteSignatureException",
              "ExpiredTokenException", "InvalidClientTokenId"}


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int = 1) -> int:
        with self._lock:
            self.value += n
            return self.value


#: Throttled Kinesis requests in this process (each retried attempt counts once).
THROTTLED = _Counter()

_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


def client(s: Settings):
    """A Kinesis client for ``s`` (cached per process and configuration)."""
    key = (s.region, s.endpoint_url, s.aws_access_key_id, s.aws_secret_access_key,
           s.aws_session_token, s.profile_name, s.request_timeout_ms)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _new_client(s)
        return _clients[key]


def _new_client(s: Settings):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise _fail("boto3 is not installed; pip install 'onceflow[kinesis]'") from None
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    try:
        session = boto3.session.Session(
            aws_access_key_id=s.aws_access_key_id, aws_secret_access_key=s.aws_secret_access_key,
            aws_session_token=s.aws_session_token, profile_name=s.profile_name, region_name=s.region)
    except ProfileNotFound as e:
        raise _fail(f"{e}; fix the profileName option or ~/.aws/config") from None
    # Timestamps stay epoch seconds (no datetime per record) and blobs bytes: cheaper to parse.
    session._session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=lambda value: value)
    timeout = s.request_timeout_ms / 1000
    try:
        return session.client(
            "kinesis", endpoint_url=s.endpoint_url, region_name=session.region_name or "us-east-1",
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=timeout,
                          read_timeout=timeout, max_pool_connections=32))
    except (BotoCoreError, ValueError) as e:
        raise _fail(f"cannot create a Kinesis client: {e}") from None


def call(s: Settings, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
    """``fn(**kwargs)`` with back-off on throttling and transient errors; other errors raise
    unchanged (ClientError) for the caller to judge, or as SourceError/ConfigError lines."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        EndpointConnectionError,
        HTTPClientError,
        NoCredentialsError,
        PartialCredentialsError,
    )
    from tenacity import (
        RetryError,
        Retrying,
        retry_if_exception,
        stop_after_attempt,
        wait_exponential,
        wait_random,
    )

    def retryable(e: BaseException) -> bool:
        if isinstance(e, ClientError):
            code = error_code(e)
            if code in THROTTLE_CODES:
                n = THROTTLED.add()
                log.warning("%s: %s throttled (%s); backing off (%d throttled so far)",
                            NAME, what, code, n)
                return True
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return code in TRANSIENT_CODES or status >= 500
        # a connection closed before the reply, a read timeout, a reply cut short: every call
        # here only reads, so asking again is safe (botocore's own retries are off)
        return isinstance(e, ConnectionError | HTTPClientError)

    def before_sleep(state) -> None:
        e = state.outcome.exception()
        if isinstance(e, ClientError) and error_code(e) in THROTTLE_CODES:
            return  # logged (and counted) as a throttle by retryable()
        log.warning("%s: %s on %s failed (%s); retry %d of %d in %.1f s", NAME, what, s.where,
                    one_line(e), state.attempt_number, s.max_retries - 1, state.next_action.sleep)

    retrying = Retrying(retry=retry_if_exception(retryable), stop=stop_after_attempt(s.max_retries),
                        wait=wait_exponential(multiplier=0.1, max=5.0) + wait_random(0, 0.1),
                        before_sleep=before_sleep, reraise=False)
    try:
        return retrying(fn, **kwargs)
    except RetryError as e:
        last = e.last_attempt.exception()
        if isinstance(last, ConnectionError | HTTPClientError):
            raise SourceError(f"{NAME}: cannot reach {s.where} ({one_line(last)}); check endpointUrl/"
                              "region and the network (the restart strategy retries)") from None
        raise SourceError(f"{NAME}: {what} on {s.where} still failing after {s.max_retries} "
                          f"attempts ({one_line(last)}); the restart strategy retries") from None
    except (NoCredentialsError, PartialCredentialsError):
        raise _fail("no AWS credentials found: set awsAccessKeyId/awsSecretAccessKey (or "
                    "profileName), or configure boto3's chain (AWS_* environment, ~/.aws, a role)") from None
    except (EndpointConnectionError, ConnectionError, HTTPClientError) as e:
        raise SourceError(f"{NAME}: cannot reach {s.where} ({one_line(e)}); check endpointUrl/region "
                          "and the network (the restart strategy retries)") from None
    except ClientError as e:
        if error_code(e) in AUTH_CODES:
            raise _fail(f"{s.where} refused the credentials ({one_line(e)}); check "
                        "awsAccessKeyId/awsSecretAccessKey/awsSessionToken or the boto3 chain") from None
        raise


def error_code(e: BaseException) -> str:
    return getattr(e, "response", {}).get("Error", {}).get("Code", "") if hasattr(e, "response") else ""


def one_line(e: BaseException | None) -> str:
    if e is None:
        return "unknown error"
    return " ".join(str(e).split()) or type(e).__name__


def describe(s: Settings, stream: str) -> list[dict]:
    """All shards of ``stream`` (open and closed, still within retention), via ListShards."""
    from botocore.exceptions import ClientError

    c = client(s)
    shards: list[dict] = []
    kwargs: dict[str, Any] = {"StreamName": stream}
    try:
        while True:
            out = call(s, f"ListShards({stream})", c.list_shards, **kwargs)
            shards.extend(out.get("Shards", []))
            token = out.get("NextToken")
            if not token:
                return shards
            kwargs = {"NextToken": token}
    except ClientError as e:
        if error_code(e) == "ResourceNotFoundException":
            raise ConfigError(f"{NAME}: stream {stream} does not exist on {s.where}; create it or "
                              "fix the streams option") from None
        raise SourceError(f"{NAME}: listing the shards of {stream} failed: {one_line(e)}") from None
