"""The event log and the driver lease on S3 (moto's server): no append, no rename.

Without the object-store changes these fail: the options in ONCEFLOW_STORAGE_OPTIONS never
reached s3fs (requests went to AWS, not the test server), the event log appended with a
read-modify-write of one object (concurrent writers lost events), and lease renewals renamed
(a CopyObject of a temporary object) instead of writing the record in one PUT, and so did
``onceflow stop``'s request. (Measured on the old code with the options given through
fsspec's own config: 55 of 100 events read back, 3 lease renewals by CopyObject in 1.2 s.)
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from onceflow.checkpoint.eventlog import EventLog
from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import FencedError
from onceflow.storage import StorageOptions, url_to_fs


def test_two_contenders_race_for_one_epoch_and_exactly_one_wins(s3):
    bucket = s3.bucket()
    ckpt = f"s3://{bucket}/ckpt"
    record = "/_onceflow/lease/000000000001.json"
    # hold each PUT of epoch 1 until both contenders sent theirs: both listed before either wrote
    s3.rule(kind="barrier", method="PUT", suffix=record, count=2)
    leases = [DriverLease(ckpt, "job", ttl_s=6, renew_s=0.3) for _ in range(2)]
    outcome: dict[int, object] = {}

    def contend(i: int) -> None:
        try:
            outcome[i] = leases[i].acquire()
        except FencedError as e:
            outcome[i] = e

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert s3.rules[0]["arrived"] == 2, "the two contenders did not race for the same epoch"
    s3.clear()
    won = [i for i, o in outcome.items() if isinstance(o, DriverLease)]
    lost = [o for o in outcome.values() if isinstance(o, FencedError)]
    assert len(won) == 1 and len(lost) == 1, outcome
    assert "at the same moment" in str(lost[0])
    # this test's bucket only: the server's request log spans the test session
    puts = [r for r in s3.requests if r[0] == "PUT" and r[1].endswith(record) and f"/{bucket}/" in r[1]]
    # the contenders' creates carry If-None-Match: * (the winner's renewals, which may be answered
    # before the loser's create on a loaded machine, do not)
    creates = [r for r in puts if r[2] == "*"]
    assert sorted(r[4] for r in creates) == ["200", "412"]  # the store decided: a conditional put

    winner = leases[won[0]]
    assert winner.epoch == 1 and DriverLease(ckpt, "x").holder()["token"] == winner.token
    before = len(s3.requests)
    time.sleep(1.0)  # a few renewals
    renewals = [r for r in s3.requests[before:] if "/_onceflow/lease/" in r[1] and r[0] in ("PUT", "DELETE")]
    assert renewals and all(r[0] == "PUT" and r[3] is None for r in renewals), renewals  # no copy, no delete
    with pytest.raises(FencedError, match="already running"):
        DriverLease(ckpt, "job").acquire()
    successor = DriverLease(ckpt, "job", ttl_s=6, renew_s=0.3).acquire(takeover=True)
    assert successor.epoch == 2
    deadline = time.monotonic() + 5
    while not winner.lost.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert winner.lost.is_set() and "newer driver" in winner.lost_reason
    successor.release()
    winner.release()


def test_event_log_one_object_per_event_concurrent_writers_read_and_tail(s3):
    ckpt = f"s3://{s3.bucket()}/ckpt"
    log = EventLog(ckpt)
    assert log.size() is not None and list(log.read()) == []

    def writer(w: int) -> None:
        mine = EventLog(ckpt)
        for i in range(25):
            mine.append("batch", writer=w, i=i, batch=w * 100 + i, input_rows=10)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    events = list(log.read())
    assert len(events) == 100  # nothing lost to concurrent writers
    for w in range(4):
        assert [e["i"] for e in events if e["writer"] == w] == list(range(25))  # in order per writer
    fs, root = url_to_fs(ckpt)
    objects = fs.ls(f"{root}/_onceflow/events", detail=False)
    assert len(objects) == 100 and not fs.exists(f"{root}/_onceflow/events.jsonl")
    assert all(fs.cat(o).count(b"\n") == 1 for o in objects[:5])  # one event per object
    assert not [r for r in s3.requests if "/_onceflow/" in r[1] and r[3]]  # never a copy (rename)

    cursor = log.size()
    assert log.tail(cursor)[0] == []
    log.append("restart", cause="test")
    # an event whose PUT was slow (or from a host whose clock lags) lands after a newer one
    late = {"ts": round(time.time() - 5, 3), "event": "sink_commit", "batch": 7, "rows": 3}
    fs.pipe_file(f"{root}/_onceflow/events/{int(late['ts'] * 1000):013d}-1-000000-abcdef.json",
                 json.dumps(late).encode())
    new, cursor = log.tail(cursor)
    assert sorted(e["event"] for e in new) == ["restart", "sink_commit"]
    assert log.tail(cursor)[0] == [] and list(log.read_from(cursor)) == []

    from onceflow.runtime.metrics import Follower, JobMetrics

    metrics = JobMetrics("job")
    Follower(EventLog(ckpt), metrics).step()  # the metrics' follower reads the event objects
    assert (metrics.batches, metrics.records_in, sum(metrics.restarts.values()), metrics.records_out) == (100, 1000, 1, 3)
    from onceflow.checkpoint.history import batch_history

    history = {b.batch: b for b in batch_history(ckpt, limit=None)}
    assert len(history) == 100 and history[7].sink_rows == 3 and history[324].input_rows == 10


def test_checkpoints_cli_reads_the_event_objects_with_options_from_the_environment(s3):
    from click.testing import CliRunner

    from onceflow.cli.main import main

    ckpt = f"s3a://{s3.bucket()}/ckpt"  # what Spark users write
    EventLog(ckpt).append("batch", batch=0, input_rows=5, duration_ms=12)
    EventLog(ckpt).append("sink_commit", batch=0, rows=5, replay=False, commit_s=0.01)
    result = CliRunner().invoke(main, ["checkpoints", ckpt, "--json"])
    assert result.exit_code == 0, result.output
    assert '"input_rows": 5' in result.output and '"sink_rows": 5' in result.output


def test_options_translate_and_secrets_never_print():
    from onceflow.storage import delta_options, fsspec_options, normalize_url

    opts = StorageOptions({"endpoint_url": "http://s3:9000", "key": "AKIA-ID", "secret": "S3CR3T",
                           "client_kwargs": {"region_name": "eu-west-1"}})
    assert "S3CR3T" not in repr(opts) and "AKIA-ID" not in str(opts) and "eu-west-1" in repr(opts)
    assert delta_options("s3a://b/t", opts) == {
        "AWS_ACCESS_KEY_ID": "AKIA-ID", "AWS_SECRET_ACCESS_KEY": "S3CR3T", "AWS_ENDPOINT_URL": "http://s3:9000",
        "AWS_REGION": "eu-west-1", "AWS_ALLOW_HTTP": "true"}
    back = fsspec_options("s3://b", {"AWS_ENDPOINT_URL": "http://s3:9000", "AWS_ACCESS_KEY_ID": "AKIA-ID",
                                     "AWS_SECRET_ACCESS_KEY": "S3CR3T", "AWS_REGION": "eu-west-1"})
    assert back == {"endpoint_url": "http://s3:9000", "key": "AKIA-ID", "secret": "S3CR3T",
                    "client_kwargs": {"region_name": "eu-west-1"}, "use_listings_cache": False}
    assert normalize_url("s3a://lake/t") == "s3://lake/t" and fsspec_options("/tmp/x", opts) == {}
    assert delta_options("abfs://c/t", {"account_name": "acct", "account_key": "k"}) == {
        "AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": "k"}


def test_stop_request_on_s3_is_written_whole_and_taken_once(s3):
    from onceflow.savepoint import SavepointError
    from onceflow.savepoint.operations import stop_job, stop_requested, take_stop_request

    ckpt = f"s3://{s3.bucket()}/ckpt"
    fs, root = url_to_fs(ckpt)  # a driver on another host holds the lease (and renews it)
    done = threading.Event()

    def renew() -> None:
        n = 0
        while not done.is_set():
            n += 1
            fs.pipe_file(f"{root}/_onceflow/lease/000000000001.json", json.dumps(
                {"token": "t", "epoch": 1, "host": "elsewhere", "pid": 1, "job": "j", "renewed": time.time(),
                 "renewals": n, "ttl_s": 30, "renew_s": 0.2}).encode())
            done.wait(0.2)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(SavepointError, match="did not stop"):  # it does not stop: the request stays
            stop_job(ckpt, timeout=0.3, savepoint=True, target=f"{ckpt}/../sp")
    finally:
        done.set()
        renewer.join()
    assert stop_requested(ckpt)
    assert take_stop_request(ckpt)["savepoint"] is True and not stop_requested(ckpt)
    assert not [r for r in s3.requests if "stop_request" in r[1] and r[3]]  # one PUT, no rename


def test_a_missing_filesystem_package_is_one_line_naming_the_extra():
    import subprocess
    import sys

    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from onceflow.storage import url_to_fs\n"
            "try:\n    url_to_fs('s3a://b/k')\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "ConfigError s3://b/k needs the s3fs package: pip install 'onceflow[s3]'"
