"""A real Kinesis API for tests: kinesalite (npm), in memory, on a free loopback port.

``Kinesalite`` runs ``node .../kinesalite/cli.js`` with stream creation, deletion and
resharding made instant, and waits until it answers ListStreams. ``./setup.sh test`` installs
it under ``.venv/node`` (``$KINESALITE_CLI`` overrides where cli.js is).

kinesalite quirks observed (relevant to anything that trusts its answers):
- it accepts any credentials (signatures are not checked; a request without any
  ``Authorization`` is refused), so "bad credentials" can only be tested as "no credentials";
- ``MillisBehindLatest`` is always 0 except at the end of a closed shard;
- ``GetShardIterator`` ``AT_TIMESTAMP`` with a timestamp after the newest record never answers
  (the request hangs until the client's read timeout), so AT_TIMESTAMP starts are not tested;
- it never throttles (the throttling test puts a proxy in front of it);
- retention is at least 24 h and measured with its own clock: records cannot be trimmed in a
  test, so data loss is tested with a stream deleted and re-created under the same name;
- a client that hangs up with a request in flight (a driver killed mid-call) crashes it: it
  rethrows the request's "aborted" error. ``kinesalite_guard.cjs`` (preloaded) ignores that one
  error, as a real Kinesis endpoint outlives its clients.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import boto3

GUARD = Path(__file__).with_name("kinesalite_guard.cjs")
CREDS = {"aws_access_key_id": "test-key-id", "aws_secret_access_key": "test-secret-value",
         "region_name": "us-east-1"}


def kinesalite_cli() -> str:
    explicit = os.environ.get("KINESALITE_CLI")
    if explicit:
        return explicit
    venv = Path(sys.prefix)
    for base in (venv, Path(__file__).resolve().parents[1] / ".venv"):
        cli = base / "node" / "node_modules" / "kinesalite" / "cli.js"
        if cli.exists():
            return str(cli)
    raise RuntimeError("kinesalite not found: run ./setup.sh test (it runs `npm install --prefix "
                       ".venv/node kinesalite`), or set KINESALITE_CLI=/path/to/kinesalite/cli.js")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kinesalite:
    """A kinesalite subprocess; ``endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="kinesalite-", suffix=".log", delete=False)

    def __enter__(self) -> Kinesalite:
        self._proc = subprocess.Popen(
            ["node", "--require", str(GUARD), kinesalite_cli(), "--port", str(self.port), "--createStreamMs", "0",
             "--deleteStreamMs", "0", "--updateStreamMs", "0", "--shardLimit", "100"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"kinesalite exited with {self._proc.returncode}: "
                                   f"{Path(self._log.name).read_text()}")
            try:
                self.client().list_streams()
                return self
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
        raise RuntimeError("kinesalite did not answer within 30 s")

    def __exit__(self, *exc) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def client(self):
        return boto3.client("kinesis", endpoint_url=self.endpoint, **CREDS)

    def source_options(self) -> dict[str, str]:
        """``KinesisSource`` keyword arguments that reach this server."""
        return {"endpoint_url": self.endpoint, "region": CREDS["region_name"],
                "aws_access_key_id": CREDS["aws_access_key_id"],
                "aws_secret_access_key": CREDS["aws_secret_access_key"]}

    def create_stream(self, name: str, shards: int = 1) -> None:
        c = self.client()
        c.create_stream(StreamName=name, ShardCount=shards)
        c.get_waiter("stream_exists").wait(StreamName=name, WaiterConfig={"Delay": 0.1, "MaxAttempts": 100})

    def put(self, stream: str, records: Iterable[tuple[str, bytes]]) -> list[dict]:
        """PutRecords in chunks of 500 (the API's maximum); returns the results in order."""
        c, out, chunk = self.client(), [], []
        for key, data in records:
            chunk.append({"PartitionKey": key, "Data": data})
            if len(chunk) == 500:
                out += c.put_records(StreamName=stream, Records=chunk)["Records"]
                chunk = []
        if chunk:
            out += c.put_records(StreamName=stream, Records=chunk)["Records"]
        assert not any("ErrorCode" in r for r in out)
        return out

    def split(self, stream: str, shard: str) -> None:
        """Split ``shard`` in the middle of its hash key range (parent closes, two children)."""
        c = self.client()
        info = next(s for s in c.list_shards(StreamName=stream)["Shards"] if s["ShardId"] == shard)
        lo, hi = (int(info["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
        c.split_shard(StreamName=stream, ShardToSplit=shard, NewStartingHashKey=str((lo + hi) // 2 + 1))
        c.get_waiter("stream_exists").wait(StreamName=stream, WaiterConfig={"Delay": 0.1, "MaxAttempts": 100})
