"""The driver lease while its object store is unreachable: an outage to wait out, not an end.

The store is moto's S3 server behind a TCP proxy that refuses connections while cut, so
s3fs raises what it raises in production: botocore's EndpointConnectionError (not an
OSError). Before renewals caught every error, the renewal thread died on the first such
error, silently (only Python's thread excepthook printed it): no log line, ``lost`` never
set, no renewal after the store came back. ``holder()`` raised the raw botocore error
into its caller (the supervisor died with a traceback).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import StoreUnavailable
from onceflow.storage import url_to_fs

TTL, RENEW = 4.0, 0.3


class Cuttable:
    """A TCP proxy that can be cut (connections refused, open ones reset) and restored."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def cut(self) -> None:
        self.listener.close()
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def store(s3, monkeypatch):
    """A checkpoint URL reached through the proxy (one botocore attempt per call, so each
    renewal attempt fails at once), the proxy, and a direct view of the lease records."""
    host, port = s3.endpoint.rsplit("//", 1)[1].split(":")
    proxy = Cuttable((host, int(port)))
    bucket = s3.bucket()
    options = {**s3.options, "endpoint_url": f"http://127.0.0.1:{proxy.port}",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(options))
    ckpt = f"s3://{bucket}/ckpt-{time.monotonic_ns()}"
    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(s3.options))
    direct, root = url_to_fs(ckpt)
    monkeypatch.setenv("ONCEFLOW_STORAGE_OPTIONS", json.dumps(options))

    def record(epoch: int = 1) -> dict:
        direct.invalidate_cache()
        return json.loads(direct.cat_file(f"{root}/_onceflow/lease/{epoch:012d}.json"))

    yield ckpt, proxy, record
    proxy.cut()


def _wait(pred, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_renewals_outlive_an_unreachable_store_and_give_up_only_after_the_ttl(store, caplog):
    ckpt, proxy, record = store
    caplog.set_level(logging.WARNING, logger="onceflow.lease")
    lease = DriverLease(ckpt, "job", ttl_s=TTL, renew_s=RENEW).acquire()
    first = record()
    _wait(lambda: record() != first, "a first renewal")

    def failures() -> list[str]:
        return [r.getMessage() for r in caplog.records if "lease renewal of epoch 1 failed" in r.getMessage()]

    proxy.cut()
    _wait(lambda: len(failures()) >= 2, "two renewal failures logged")
    assert "EndpointConnectionError" in failures()[0] and "retries in" in failures()[0], failures()[0]
    assert not lease.lost.is_set() and lease._thread.is_alive()
    before = len(failures())
    proxy.restore()  # the store answers again within the TTL: renewals resume, the lease stays
    seen = [record()]
    _wait(lambda: seen.append(record()) or len({json.dumps(r) for r in seen}) > 3, "renewals after the outage")
    assert not lease.lost.is_set() and len(failures()) <= before + 1
    lease.check()

    proxy.cut()  # an outage longer than the TTL: the holder gives itself up, by its own clock
    cut = time.monotonic()
    _wait(lambda: lease.lost.is_set(), "the lease to be given up", timeout=TTL + 30)
    assert time.monotonic() - cut >= TTL - 2 * RENEW - 0.5  # never before its TTL ran out
    assert "could not be renewed" in lease.lost_reason
    assert len(failures()) >= 3  # one line per attempt while it waited


def test_reads_of_an_unreachable_store_are_an_outage_with_retries(store, caplog):
    ckpt, proxy, _ = store
    caplog.set_level(logging.WARNING, logger="onceflow.lease")
    holder = DriverLease(ckpt, "job", ttl_s=TTL, renew_s=RENEW).acquire()
    proxy.cut()
    with pytest.raises(StoreUnavailable, match="EndpointConnectionError") as raised:
        DriverLease(ckpt, "supervisor").holder()
    assert not raised.value.fatal and type(raised.value.cause).__name__ == "EndpointConnectionError"
    found: list = []
    reader = threading.Thread(target=lambda: found.append(DriverLease(ckpt, "supervisor").holder(retry_s=60)))
    reader.start()
    _wait(lambda: any("retrying in" in r.getMessage() and "lease holder" in r.getMessage()
                      for r in caplog.records), "a retry line")
    proxy.restore()
    reader.join(60)
    assert found and found[0]["token"] == holder.token  # answered once the store was back
    holder.release()
