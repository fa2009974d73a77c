"""An S3-compatible server for the object-store tests: moto's standalone server (the one
s3fs's own tests use), run as a separate process (``python tests/s3_server.py``) so that
nothing in the test process, e.g. a delta-rs call that keeps the GIL while it waits for an
answer, can stall it.

A thin WSGI layer in front of moto records every request (``S3Server.requests``: method,
path, If-None-Match, copy source, status, query string) and applies *rules* the tests set
(``S3Server.rule``): ``barrier`` holds matching requests until ``count`` of them arrived (two
contenders racing for one object); ``before`` runs a command once before a matching request
is answered (another writer commits first); ``fail`` answers matching requests with HTTP 503
until the time ``until`` (an outage of the store).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
CONTROL = "/_onceflow_test"


def _matches(rule: dict, environ: dict) -> bool:
    path = environ.get("PATH_INFO", "")
    return (environ["REQUEST_METHOD"] == rule.get("method", environ["REQUEST_METHOD"])
            and rule.get("contains", "") in path and path.endswith(rule.get("suffix", ""))
            and (rule.get("if_none_match") is None or environ.get("HTTP_IF_NONE_MATCH") == rule["if_none_match"]))


def serve() -> None:  # pragma: no cover - runs in the server process
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = DomainDispatcherApplication(create_backend_app)
    requests: list[list] = []
    rules: list[dict] = []
    lock = threading.Lock()

    def apply_rules(environ) -> None:
        for rule in list(rules):
            if not _matches(rule, environ):
                continue
            if rule["kind"] == "barrier":
                with lock:
                    rule["arrived"] = rule.get("arrived", 0) + 1
                    if rule["arrived"] >= rule["count"]:
                        rule["open"].set()
                rule["open"].wait(rule.get("timeout", 10))
            elif rule["kind"] == "before":
                with lock:
                    if rule.get("fired"):
                        continue
                    rule["fired"] = True
                subprocess.run(rule["command"], check=False, timeout=120)

    def outage(environ) -> bool:
        import time

        return any(r["kind"] == "fail" and _matches(r, environ) and time.time() < r["until"]
                   for r in list(rules))

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith(CONTROL):
            body = b""
            if path == f"{CONTROL}/rule":
                rule = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
                rule["open"] = threading.Event()
                rules.append(rule)
            elif path == f"{CONTROL}/clear":
                rules.clear()
            elif path == f"{CONTROL}/state":
                body = json.dumps({"requests": requests, "rules": [
                    {k: v for k, v in r.items() if k != "open"} for r in rules]}).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        if outage(environ):
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            return [b"<Error><Code>ServiceUnavailable</Code><Message>test outage</Message></Error>"]
        apply_rules(environ)
        seen = [environ["REQUEST_METHOD"], path, environ.get("HTTP_IF_NONE_MATCH"),
                environ.get("HTTP_X_AMZ_COPY_SOURCE")]

        def record(status, headers, *exc):
            requests.append([*seen, status.split()[0], environ.get("QUERY_STRING", "")])
            return start_response(status, headers, *exc)

        return moto(environ, record)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(server.server_port, flush=True)
    server.serve_forever()


class S3Server:
    """Client side: starts the server process and talks to its control endpoint."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdout=subprocess.PIPE,
                                     text=True)
        port = self.proc.stdout.readline().strip()
        if not port.isdigit():
            self.proc.kill()
            raise RuntimeError("moto S3 server did not start (is moto[server] installed?)")
        self.endpoint = f"http://127.0.0.1:{port}"

    def _control(self, what: str, data: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.endpoint}{CONTROL}/{what}",
                                     data=json.dumps(data).encode() if data is not None else None,
                                     method="POST" if data is not None else "GET")
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else {}

    def rule(self, **rule) -> None:
        self._control("rule", rule)

    def clear(self) -> None:
        self._control("clear")

    @property
    def requests(self) -> list[list]:
        return self._control("state")["requests"]

    @property
    def rules(self) -> list[dict]:
        return self._control("state")["rules"]

    @property
    def options(self) -> dict:
        """storage_options in both vocabularies at once (the translation is under test too)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                "AWS_REGION": "us-east-1"}

    def bucket(self) -> str:
        """A new, empty bucket (the server's state lives as long as the test session)."""
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch) -> Iterator[S3Server]:
    """The server, with its options in ONCEFLOW_STORAGE_OPTIONS (what the CLI reads) and no
    rules left over from another test."""
    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(s3_server.options))
    s3_server.clear()
    yield s3_server
    s3_server.clear()


if __name__ == "__main__":
    serve()
