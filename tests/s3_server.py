"""An S3-compatible server for the object-store tests: moto's standalone server (the one
s3fs's own tests use), served from this process on a free port so tests can watch requests.

``S3Server.hooks`` are called with each request's WSGI environ before moto answers it (a
test can hold a request, or let a concurrent writer act first); ``S3Server.requests`` records
(method, path, If-None-Match, copy source, status) of every request.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service


class S3Server:
    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = DomainDispatcherApplication(create_backend_app)
        self.hooks: list[Callable[[dict], None]] = []
        self.requests: list[tuple[str, str, str | None, str | None, str]] = []
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()

    def _app(self, environ, start_response):
        for hook in list(self.hooks):
            hook(environ)
        seen = (environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_IF_NONE_MATCH"),
                environ.get("HTTP_X_AMZ_COPY_SOURCE"))

        def record(status, headers, *exc):
            self.requests.append((*seen, status.split()[0]))
            return start_response(status, headers, *exc)

        return self._moto(environ, record)

    @property
    def options(self) -> dict:
        """storage_options in both vocabularies at once (the translation is under test too)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                "AWS_REGION": "us-east-1"}

    def bucket(self) -> str:
        """A new, empty bucket (moto's state lives as long as this process)."""
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(5)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch) -> Iterator[S3Server]:
    """The server, with its options in ONCEFLOW_STORAGE_OPTIONS (what the CLI reads) and no
    hooks left over from another test."""
    import json

    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(s3_server.options))
    s3_server.hooks.clear()
    yield s3_server
    s3_server.hooks.clear()
