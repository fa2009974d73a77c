"""The driver lease: exclusive epochs, renewals that never overwrite a newer holder, self-fencing.

The lease only refuses a second driver early (safety rests on the sinks' epochs); these tests
pin what it promises on a real filesystem, without Spark.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from onceflow.checkpoint.lease import DriverLease
from onceflow.errors import FencedError, LeaseLost


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


def _old_record(lease_dir, epoch: int, renewed: float, host: str = "elsewhere") -> None:
    """A record as onceflow wrote it before holder identities (no "format")."""
    (lease_dir / f"{epoch:012d}.json").write_text(json.dumps(
        {"token": "x", "epoch": epoch, "host": host, "pid": 1, "job": "job", "renewed": renewed}))


def test_a_silent_record_of_another_host_lapses_once_seen_unchanged_for_its_ttl_whatever_its_time(tmp_path):
    """Its timestamp is an hour in the future (its host's clock runs ahead): before, it was
    held for that hour. Now this process times the lapse on its own clock."""
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    _old_record(lease_dir, 7, time.time() + 3600)
    assert DriverLease(str(tmp_path), "probe").holder()["epoch"] == 7  # not watched long enough yet
    t0 = time.monotonic()
    lease = DriverLease(str(tmp_path), "job", ttl_s=1, renew_s=0.2).acquire()
    assert lease.epoch == 8 and time.monotonic() - t0 >= 1.0  # watched it for at least the TTL
    lease.release()


def test_a_renewing_record_of_an_earlier_version_is_held_whatever_its_time(tmp_path):
    """A rolling upgrade: a driver of the previous version renews its old-format record, its
    host's clock 10 minutes behind. Before, that record counted as lapsed at once."""
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.1):
            _old_record(lease_dir, 3, time.time() - 600)

    _old_record(lease_dir, 3, time.time() - 600)
    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(FencedError, match="already running"):
            DriverLease(str(tmp_path), "job", ttl_s=1, renew_s=0.2).acquire()
        assert DriverLease(str(tmp_path), "probe").holder(settle=True)["epoch"] == 3
    finally:
        stop.set()
        renewer.join()
    # seen renewing a moment ago: refused at once, taken once silent for the lapse time
    lease = DriverLease(str(tmp_path), "job", ttl_s=1, renew_s=0.2).acquire(wait_s=30)
    assert lease.epoch == 4
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
    with pytest.raises(LeaseLost):  # not fenced: no newer holder; the process restarts
        lease.check()


def test_a_driver_can_stand_by_for_another_hosts_lease_to_lapse(tmp_path):
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    stop, stopped = threading.Event(), []

    def renew() -> None:  # a holder on another host: renews, then its host freezes
        while not stop.wait(0.1):
            _old_record(lease_dir, 1, time.time())
        stopped.append(time.monotonic())

    _old_record(lease_dir, 1, time.time())
    renewer = threading.Thread(target=renew)
    renewer.start()
    taken: list = []
    successor = threading.Thread(target=lambda: taken.append(
        DriverLease(str(tmp_path), "job", ttl_s=1.0, renew_s=0.2).acquire(wait_s=30)))
    successor.start()
    time.sleep(2.5)  # two lapse times of standing by while the holder renews
    assert not taken
    stop.set()
    renewer.join()
    successor.join(30)
    assert taken and taken[0].epoch == 2
    assert time.monotonic() - stopped[0] >= 1.0  # taken only once the TTL had run out (causal)
    taken[0].release()


def test_a_record_being_written_counts_as_held_until_it_lapses(tmp_path):
    lease_dir = tmp_path / "_onceflow" / "lease"
    lease_dir.mkdir(parents=True)
    (lease_dir / f"{1:012d}.json").write_bytes(b"")  # exclusively created, content not yet written
    assert DriverLease(str(tmp_path), "probe").holder()["epoch"] == 1
    t0 = time.monotonic()  # its creator died before writing it: taken after the lapse, not before
    lease = DriverLease(str(tmp_path), "job", ttl_s=1, renew_s=0.2).acquire()
    assert lease.epoch == 2 and time.monotonic() - t0 >= 1.0
    lease.release()


def test_a_holder_that_has_not_renewed_for_its_ttl_knows_it_by_its_own_clock(tmp_path):
    """No renewal is due for an hour, so none succeeds: after the TTL the holder's own check
    says it lost the lease (before, check() only looked for a newer epoch)."""
    lease = DriverLease(str(tmp_path), "job", ttl_s=0.5, renew_s=3600).acquire()
    lease.check()
    time.sleep(0.6)
    with pytest.raises(LeaseLost, match="could not be renewed for 0.5s"):
        lease.check()
    assert lease.lost.is_set()
    lease.release()


def test_a_paused_holder_whose_successor_took_over_is_fenced_not_just_lapsed(tmp_path):
    """A holder paused past its TTL (SIGSTOP, a VM freeze) wakes to find both its TTL run out and
    a newer epoch: it is fenced (exit 5, not restarted), not merely lapsed (exit 1, restarted)."""
    a = DriverLease(str(tmp_path), "job", ttl_s=0.5, renew_s=3600).acquire()
    assert a.lost.wait(5)  # its renewal thread found the TTL run out first (what the runner polls)
    b = DriverLease(str(tmp_path), "job", ttl_s=30, renew_s=3600).acquire(takeover=True)
    assert isinstance(a.lost_error(), FencedError) and "newer driver" in str(a.lost_error())
    with pytest.raises(FencedError, match="newer driver took the lease"):
        a.check()
    b.release()


def test_a_driver_standing_by_forever_ends_its_wait_when_stopped_and_takes_nothing(tmp_path):
    """``onceflow run`` stands by forever by default; SIGTERM (or 'onceflow stop') must end that
    wait at once. Before: acquire() slept through it until the lease lapsed."""
    from onceflow.outages import Stopped

    holder = DriverLease(str(tmp_path), "job", ttl_s=30).acquire()
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    waiting = DriverLease(str(tmp_path), "job", ttl_s=30)
    started = time.monotonic()
    with pytest.raises(Stopped):
        waiting.acquire(wait_s=float("inf"), stop=stop)
    assert time.monotonic() - started < 10 and waiting.waited and waiting.epoch is None
    assert DriverLease(str(tmp_path), "job").top()["token"] == holder.token
    holder.release()
    free = DriverLease(str(tmp_path), "job", ttl_s=30).acquire(stop=threading.Event())
    assert free.epoch == 2 and not free.waited
    free.release()


def test_a_takeover_of_a_dead_drivers_epoch_leaves_a_lease_someone_took_since(tmp_path):
    """A standby promoted to take over epoch E (its supervisor's dead driver) must not fence a
    driver of another supervisor that took the lease after E meanwhile: it is judged like any
    holder. Taking over the newest epoch itself still works."""
    dead = DriverLease(str(tmp_path), "job", ttl_s=30).acquire()
    other = DriverLease(str(tmp_path), "job", ttl_s=30, renew_s=0.05).acquire(takeover=True)
    with pytest.raises(FencedError, match="already running"):
        DriverLease(str(tmp_path), "job", ttl_s=30).acquire(takeover=dead.epoch, wait_s=0)
    assert not other.lost.is_set() and other.epoch == dead.epoch + 1
    mine = DriverLease(str(tmp_path), "job", ttl_s=30).acquire(takeover=other.epoch)
    assert mine.epoch == other.epoch + 1 and other.lost.wait(5)
    for lease in (dead, other, mine):
        lease.release()
