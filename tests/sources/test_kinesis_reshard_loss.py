"""Data loss across a reshard (sources/kinesis/reader.py) against kinesalite and local Spark.

Kinesis drops a closed shard from ListShards once its records expired (retention); kinesalite
never does (its ListShards lists every shard the stream ever had, and its retention is at
least 24 h on its own clock). The test therefore puts an HTTP proxy in front of kinesalite
that hides the shards Kinesis would no longer list, and forwards everything else unchanged:
to the source those shards and their unread records are gone, as they would be on AWS."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from onceflow.checkpoint.eventlog import EventLog
from onceflow.sources.kinesis import SCHEMA, KinesisSource, KinesisStreamReader, parse_options

SHARD = "shardId-00000000000{}".format


class ExpiringProxy:
    """Forwards Kinesis requests to kinesalite; ListShards answers omit the shards in ``hidden``."""

    def __init__(self, upstream_port: int) -> None:
        self.hidden: set[str] = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                conn.request("POST", self.path, body, dict(self.headers.items()))
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if self.headers.get("X-Amz-Target", "").endswith(".ListShards") and resp.status == 200:
                    out = json.loads(data)
                    out["Shards"] = [s for s in out.get("Shards", []) if s["ShardId"] not in proxy.hidden]
                    data = json.dumps(out).encode()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "keep-alive",
                                         "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")  # this server answers one request per connection
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def run_available_now(df, tmp: Path) -> list:
    out, cp = tmp / "out", tmp / "out-cp"
    q = (df.writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(cp)).trigger(availableNow=True).start())
    assert q.awaitTermination(300), "query did not finish in 300 s"
    if q.exception() is not None:
        raise q.exception()
    return df.sparkSession.read.parquet(str(out)).collect() if (out / "_spark_metadata").exists() else []


def put(k, stream: str, ids) -> dict[str, list[int]]:
    """Records ``str(i)``; returns the ids per shard they landed in."""
    ids = list(ids)
    landed: dict[str, list[int]] = {}
    for i, r in zip(ids, k.put(stream, [(f"k{i % 16}", str(i).encode()) for i in ids]), strict=True):
        landed.setdefault(r["ShardId"], []).append(i)
    return landed


@pytest.fixture
def proxy(kinesalite):
    p = ExpiringProxy(kinesalite.port)
    yield p
    p.close()


def test_shards_expired_with_unread_records_are_data_loss_unless_allowed(spark, kinesalite, proxy, stream_name,
                                                                        tmp_path):
    """The query read ids 0..99 of shard 0 and stopped. Meanwhile: 30 more records reached
    shard 0, shard 0 was split into 1 and 2, shard 1 got records and was split into 3 and 4,
    and more records went to 2, 3 and 4. The query stayed down past retention, so Kinesis no
    longer lists shards 0 and 1: shard 0 was checkpointed short of SHARD_END, and shard 1 was
    never read at all. Restarted with failOnDataLoss=true the query fails naming both shards
    and what to do; with false it logs a WARNING per shard, reads shards 2, 3 and 4 from their
    start, and counts both losses as source_data_loss events.
    Old code: no error; the children were read from TRIM_HORIZON and the records of shards 0
    and 1 were skipped silently."""
    k = kinesalite
    k.create_stream(stream_name, 1)
    put(k, stream_name, range(100))
    source = KinesisSource(stream_name, starting_position="TRIM_HORIZON", event_log=str(tmp_path / "out-cp"),
                           **{**k.source_options(), "endpoint_url": proxy.endpoint})
    assert sorted(int(r.data) for r in run_available_now(source.load(spark), tmp_path)) == list(range(100))
    checkpointed = json.loads((tmp_path / "out-cp" / "offsets" / "0").read_text().splitlines()[-1])[stream_name]
    assert list(checkpointed) == [SHARD(0)] and checkpointed[SHARD(0)].isdigit()

    put(k, stream_name, range(100, 130))  # never read
    k.split(stream_name, SHARD(0))
    first = put(k, stream_name, range(1000, 1100))
    assert set(first) == {SHARD(1), SHARD(2)}
    k.split(stream_name, SHARD(1))
    second = put(k, stream_name, range(2000, 2100))
    assert set(second) == {SHARD(2), SHARD(3), SHARD(4)}
    proxy.hidden |= {SHARD(0), SHARD(1)}  # expired: Kinesis no longer lists them

    with pytest.raises(Exception, match="KinesisDataLossError") as e:
        run_available_now(source.load(spark), tmp_path)
    msg = str(e.value)
    assert (f"records lost across a reshard: stream {stream_name} shard {SHARD(0)}: read only up to "
            f"{checkpointed[SHARD(0)]}, not to its end (SHARD_END), and no longer listed") in msg, msg
    assert f"its child shard(s) {SHARD(2)} would start after its lost records" in msg, msg
    assert (f"stream {stream_name} shard {SHARD(1)}: never read, and no longer listed (created and expired "
            f"while the query was stopped); its child shard(s) {SHARD(3)}, {SHARD(4)}") in msg, msg
    assert "set failOnDataLoss=false to continue with the child shards" in msg, msg

    source.fail_on_data_loss = False
    rows = run_available_now(source.load(spark), tmp_path)
    expected = first.get(SHARD(2), []) + second[SHARD(2)] + second[SHARD(3)] + second[SHARD(4)]
    assert sorted(int(r.data) for r in rows) == list(range(100)) + sorted(expected)
    losses = [e for e in EventLog(str(tmp_path / "out-cp")).read() if e["event"] == "source_data_loss"]
    assert [(e["shard"], e["failed"]) for e in losses] == [
        (SHARD(0), True), (SHARD(1), True), (SHARD(0), False), (SHARD(1), False)], losses
    assert all(e["cause"].startswith("reshard: ") for e in losses)
    assert losses[2]["start"] == checkpointed[SHARD(0)] and losses[3]["start"] is None

    # Accepted once, not reported again: a new driver with failOnDataLoss=true plans on.
    source.fail_on_data_loss = True
    reader = KinesisStreamReader(parse_options(source.options()), SCHEMA)
    last = max((p for p in (tmp_path / "out-cp" / "offsets").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    planned = reader.latestOffset(json.loads(last.read_text().splitlines()[-1]), ReadAllAvailable())
    assert set(planned[stream_name]) == {SHARD(0), SHARD(2), SHARD(3), SHARD(4)}
    assert len([e for e in EventLog(str(tmp_path / "out-cp")).read() if e["event"] == "source_data_loss"]) == 4
