"""Which errors are outages: expired credentials from a real S3 endpoint (through s3fs) are."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import s3fs

from onceflow.outages import is_config_error


def _answering(code: str, status: int):
    body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
            f"<Message>{code} says the endpoint</Message></Error>").encode()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = _reply

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("code, status, config", [("ExpiredToken", 400, False), ("AccessDenied", 403, True)])
def test_expired_credentials_are_an_outage_and_denied_access_is_configuration(code, status, config):
    server = _answering(code, status)
    try:
        fs = s3fs.S3FileSystem(key="k", secret="s", token="t", skip_instance_cache=True,
                               client_kwargs={"endpoint_url": f"http://127.0.0.1:{server.server_port}"},
                               config_kwargs={"retries": {"max_attempts": 1}})
        with pytest.raises(PermissionError) as caught:
            fs.pipe("bucket/ckpt/probe", b"x")
        assert is_config_error(caught.value) is config, caught.value
    finally:
        server.shutdown()
