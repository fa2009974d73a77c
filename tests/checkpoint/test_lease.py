"""The driver lease: exclusive epochs, renewals that never overwrite a newer holder, self-fencing.

The lease only refuses a second driver early (safety rests on the sinks' epochs); these tests
pin what it promises on a real filesystem, without Spark.
"""

from __future__ import annotations

import json
import time

import pytest

from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import FencedError


def test_second_driver_is_refused_while_the_holder_lives(tmp_path):
    first = DriverLease(str(tmp_path), "job", ttl_s=30).acquire()
    with pytest.raises(FencedError, match="already running"):
        DriverLease(str(tmp_path), "job", ttl_s=30).acquire()
    assert first.epoch == 1 and not first.lost.is_set()
    first.release()


def test_takeover_fences_the_old_holder_and_its_renewals_never_overwrite_the_new_one(tmp_path):
    old = DriverLease(str(tmp_path), "job", ttl_s=30, renew_s=0.05).acquire()
    new = DriverLease(str(tmp_path), "job", ttl_s=30, renew_s=0.05).acquire(takeover=True)
    assert new.epoch == old.epoch + 1
    assert old.lost.wait(5), "the old holder never noticed the newer epoch"
    assert "newer driver" in old.lost_reason
    with pytest.raises(FencedError):
        old.check()
    new.check()  # the newest holder is not fenced
    time.sleep(0.3)  # more renew cycles of both
    records = sorted(p.name for p in (tmp_path / "_onceflow" / "lease").glob("*.json"))
    assert records == [f"{new.epoch:012d}.json"]  # the old record is gone, the new one intact
    assert json.loads((tmp_path / "_onceflow" / "lease" / records[0]).read_text())["token"] == new.token
    old.release()  # a fenced holder's release changes nothing
    assert DriverLease(str(tmp_path), "probe").holder()["token"] == new.token
    new.release()


def test_a_holder_on_another_host_counts_as_gone_only_after_its_ttl(tmp_path):
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    record = {"token": "x", "epoch": 7, "host": "elsewhere", "pid": 1, "job": "job", "renewed": time.time()}
    (lease_dir / "000000000007.json").write_text(json.dumps(record))
    with pytest.raises(FencedError, match="elsewhere"):
        DriverLease(str(tmp_path), "job", ttl_s=2).acquire()
    (lease_dir / "000000000007.json").write_text(json.dumps({**record, "renewed": time.time() - 3}))
    lease = DriverLease(str(tmp_path), "job", ttl_s=2).acquire()
    assert lease.epoch == 8
    lease.release()


def test_epochs_keep_growing_across_releases(tmp_path):
    epochs = []
    for _ in range(3):
        lease = DriverLease(str(tmp_path), "job").acquire()
        epochs.append(lease.epoch)
        lease.release()
    assert epochs == [1, 2, 3]
    assert DriverLease(str(tmp_path), "probe").holder() is None


def test_a_lease_that_cannot_be_renewed_is_lost_after_its_ttl(tmp_path):
    lease = DriverLease(str(tmp_path), "job", ttl_s=0.3, renew_s=0.05).acquire()
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.rename(tmp_path / "gone")
    lease_dir.write_text("not a directory")  # every renewal fails, as on a store that went away
    assert lease.lost.wait(5), "a driver that cannot renew kept its lease"
    assert "could not be renewed" in lease.lost_reason
    with pytest.raises(FencedError):
        lease.check()


def test_a_driver_can_wait_for_another_hosts_lease_to_lapse(tmp_path):
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    # a holder on another host that renewed just now and then froze (never renews again)
    renewed = time.time()
    (lease_dir / f"{1:012d}.json").write_text(json.dumps(
        {"token": "t", "epoch": 1, "host": "elsewhere", "pid": 1, "job": "job", "renewed": renewed}))
    with pytest.raises(FencedError, match="already running"):
        DriverLease(str(tmp_path), "job", ttl_s=1.0, renew_s=0.2).acquire()
    t0 = time.monotonic()
    successor = DriverLease(str(tmp_path), "job", ttl_s=1.0, renew_s=0.2).acquire(wait_s=10)
    waited = time.monotonic() - t0
    # taken only once the TTL had run out (causal, not timed), and not after the whole wait
    assert successor.epoch == 2 and time.time() - renewed >= 1.0 and waited < 5
    successor.release()


def test_a_record_being_written_counts_as_held(tmp_path):
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    (lease_dir / f"{1:012d}.json").write_bytes(b"")  # exclusively created, content not yet written
    with pytest.raises(FencedError, match="already running"):
        DriverLease(str(tmp_path), "job", ttl_s=30).acquire()
