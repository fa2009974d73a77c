"""The driver lease between real processes that cannot see each other's pids or clocks:
containers (PID namespaces made with ``unshare``, one host name for all, as pods with
``hostNetwork`` on one node or an overlapping rollout look) and hosts whose wall clocks
disagree by minutes (libfaketime). Each party is ``lease_proc.py`` running the real lease.

How these failed before holders had identities and lapses were judged on the reader's clock:
* two namespaces, one host name: the second process read the holder's pid in its own
  namespace, found nothing there, took the lease and fenced the live holder, which took it
  back the same way (epochs 1, 2, 3... within a second);
* a restarted container: the dead holder's pid (1, the container's init) was alive in the
  new container (its own init), so the new driver was refused ("already running");
* a pid reused in one namespace: the same, with the pid given to an unrelated process;
* a reader whose clock ran 300 s ahead took the lease from a live holder at once, and the
  commit-time check refused every commit of a live driver ("has not renewed its lease for
  300s").
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROC = str(Path(__file__).with_name("lease_proc.py"))
FAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), "")  # Debian: faketime
TTL, RENEW = 1.0, 0.2  # lapse (TTL + one renewal period) 1.2 s

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None
    or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"],
                      capture_output=True).returncode != 0,
    reason="needs root and unshare (PID and UTS namespaces)")
needs_faketime = pytest.mark.skipif(not FAKETIME,
                                    reason="needs libfaketime (apt-get install faketime)")


class Party:
    """One lease_proc.py, in its own PID + UTS namespace (its own container) unless
    ``container=False``; ``skew_s`` shifts its wall clock (libfaketime)."""

    def __init__(self, tmp: Path, name: str, mode: str, ckpt: Path, *args: str, hostname: str = "acc-pod",
                 skew_s: float = 0, first_pid: int | None = None, container: bool = True):
        self.events = tmp / f"{name}.jsonl"
        env = dict(os.environ)
        if skew_s:
            env.update(LD_PRELOAD=FAKETIME, FAKETIME=f"{skew_s:+.0f}s", FAKETIME_DONT_FAKE_MONOTONIC="1")
        cmd = [sys.executable, PROC, str(self.events), mode, str(ckpt), f"ttl={TTL}", f"renew={RENEW}", *args]
        if container:
            cmd = [*cmd, f"hostname={hostname}"]
            shell = " ".join(f"'{c}'" for c in cmd)
            if first_pid:  # the process gets this pid in its namespace (others' pids are lower)
                shell = f"echo {first_pid - 1} > /proc/sys/kernel/ns_last_pid; {shell}"
            cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "sh", "-c",
                   f"{shell} & wait $!"]
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def seen(self, event: str | None = None, **match) -> list[dict]:
        try:
            lines = self.events.read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if (event is None or e["event"] == event)
                and all(str(v) in str(e.get(k)) for k, v in match.items())]

    def wait_for(self, event: str, timeout: float = 30, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.seen(event, **match)
            if found:
                return found[0]
            if self.proc.poll() is not None and not self.seen(event, **match):
                raise AssertionError(f"exited ({self.proc.returncode}) without {event} {match}: {self.seen()}")
            time.sleep(0.05)
        raise AssertionError(f"no {event} {match} within {timeout}s: {self.seen()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare --kill-child: the namespace dies
        self.proc.wait(30)


@pytest.fixture
def parties(tmp_path):
    started: list[Party] = []

    def start(*args, **kwargs) -> Party:
        party = Party(tmp_path, *args, **kwargs)
        started.append(party)
        return party

    yield start
    for party in started:
        party.kill()


@needs_namespaces
def test_two_containers_with_one_host_name_one_holds_the_other_stands_by(tmp_path, parties):
    ckpt = tmp_path / "ckpt"
    # the holder's pid (100) exists nowhere in the other namespace: a pid lookup there says "dead"
    a = parties("a", "hold", ckpt, "again=1", first_pid=100)
    assert a.wait_for("holding")["epoch"] == 1
    b = parties("b", "hold", ckpt, "again=1", "wait=60")
    b.wait_for("log", msg="standing by")
    time.sleep(4 * (TTL + RENEW))  # several lapse times: nobody may take the lease meanwhile
    assert [e["epoch"] for e in a.seen("holding")] == [1] and not a.seen("lost"), a.seen()
    assert not b.seen("holding"), b.seen()
    refuser = parties("c", "hold", ckpt)  # without waiting: refused, cleanly, once it saw a renewal
    assert "already running" in refuser.wait_for("refused")["error"]
    assert refuser.proc.wait(30) == 0 and not a.seen("lost")
    a.kill()  # the holder's container dies: the standby takes over after the lapse
    assert b.wait_for("holding", timeout=30)["epoch"] == 2
    assert len(b.seen("holding")) == 1 and not b.seen("lost")


@needs_namespaces
def test_a_restarted_container_takes_over_from_its_dead_predecessor(tmp_path, parties):
    ckpt = tmp_path / "ckpt"
    old = parties("old", "hold", ckpt, "again=0")  # pid 2 in its namespace
    assert old.wait_for("holding")["epoch"] == 1
    old.kill()
    # the new container reuses the host name and the pids: pid 2 is alive there (itself)
    new = parties("new", "hold", ckpt, "again=0")
    took = new.wait_for("holding", timeout=30)
    assert took["epoch"] == 2 and took["pid"] == old.seen("holding")[0]["pid"]
    assert not new.seen("refused")


@needs_namespaces
def test_a_reused_pid_in_the_same_namespace_is_not_the_holder(tmp_path, parties):
    ckpt = tmp_path / "ckpt"
    party = parties("reuse", "reuse", ckpt, "ttl=5")
    reused = party.wait_for("reused")
    assert reused["squatter"] == reused["pid_of_dead_holder"]  # the pid really was reused
    took = party.wait_for("holding", pid=reused["pid"])
    # the same namespace: the start time tells at once, no lapse to wait for
    assert took["epoch"] == 2 and took["took_s"] < 5, took  # its TTL is 5 s here


@needs_namespaces
@needs_faketime
def test_clocks_minutes_apart_neither_steal_a_live_lease_nor_keep_a_dead_one(tmp_path, parties):
    ckpt = tmp_path / "ckpt"
    holder = parties("holder", "hold", ckpt, hostname="host-a")
    assert holder.wait_for("holding")["epoch"] == 1
    # (their TTL of 3 s makes them wait longer than the checker: it sees the lapse first)
    ahead = parties("ahead", "hold", ckpt, "wait=60", "ttl=3", hostname="host-b", skew_s=300)
    behind = parties("behind", "hold", ckpt, "wait=60", "ttl=3", hostname="host-c", skew_s=-300)
    # the commit-time check of a query over Spark Connect, on a server 300 s ahead
    checker = parties("check", "check", ckpt, "epoch=1", hostname="connect", skew_s=300)
    ahead.wait_for("log", msg="standing by")
    behind.wait_for("log", msg="standing by")
    checker.wait_for("ok")
    time.sleep(4 * (TTL + RENEW))
    assert not holder.seen("lost") and not ahead.seen("holding") and not behind.seen("holding")
    assert not checker.seen("refused"), checker.seen("refused")[:1]
    holder.kill()
    died = time.time()
    stopped = checker.wait_for("refused", timeout=30)  # the query stops: lapsed (or a successor came)
    assert stopped["kind"] == "FencedError" or "by this host's clock" in stopped["error"], stopped
    deadline = time.monotonic() + 30
    while not (ahead.seen("holding") or behind.seen("holding")) and time.monotonic() < deadline:
        time.sleep(0.05)
    successors = ahead.seen("holding") + behind.seen("holding")
    assert [s["epoch"] for s in successors] == [2], successors  # one of them, within seconds
    assert time.time() - died < 30


def test_a_commit_check_that_looks_only_now_and_then_judges_by_the_holders_elapsed_time(tmp_path, parties):
    """The commit-time check runs once per batch. A check that last looked before the
    driver's final renewals sees that record for the first time after the driver died: the
    record's held_s (the holder's own elapsed time) still proves the silence. A live driver
    checked as rarely is never refused. (A design test: the old wall-clock check passed it.)"""
    from onceflow.checkpoint.lease import check_driver_lease
    from onceflow.errors import DriverLeaseLapsed

    ckpt = tmp_path / "ckpt"
    record = ckpt / "_onceflow" / "lease" / f"{1:012d}.json"
    holder = parties("holder", "hold", ckpt, "renew=0.1", container=False)
    assert holder.wait_for("holding")["epoch"] == 1
    check_driver_lease(str(ckpt), 1, TTL)
    for _ in range(3):  # checks further apart than the lapse time: the live driver passes
        time.sleep(1.5 * TTL)
        check_driver_lease(str(ckpt), 1, TTL)
    renewals = json.loads(record.read_text())["renewals"]
    while json.loads(record.read_text())["renewals"] < renewals + 3:  # renewals this check never sees
        time.sleep(0.05)
    holder.kill()
    time.sleep(1.5 * TTL)
    with pytest.raises(DriverLeaseLapsed, match="has not renewed its lease"):
        check_driver_lease(str(ckpt), 1, TTL)


class LateReplies:
    """A filesystem whose read replies arrive ``delay_s`` late (the bytes are read, then the
    reply waits): a slow store, or a reader descheduled between its read and its clock."""

    def __init__(self, fs):
        self._fs, self.delay_s = fs, 0.0

    def cat_file(self, *args, **kwargs):
        data = self._fs.cat_file(*args, **kwargs)
        time.sleep(self.delay_s)
        return data

    def __getattr__(self, name):
        return getattr(self._fs, name)


@needs_namespaces
def test_a_late_reply_is_not_the_holders_silence(tmp_path, parties):
    """A reader's read that returns late proves the holder's silence only up to the moment the
    read began. Before, the reader judged what it read at the moment the reply came: after
    prompt reads (which bound when the holder took the lease), one reply 3 s late (beyond the
    1.2 s lapse) made a live, renewing holder look lapsed, and a successor took its lease."""
    from onceflow.checkpoint.lease import DriverLease
    from onceflow.errors import FencedError

    ckpt = tmp_path / "ckpt"
    holder = parties("holder", "hold", ckpt, hostname="host-a")
    assert holder.wait_for("holding")["epoch"] == 1
    reader = DriverLease(str(ckpt), "probe", ttl_s=TTL, renew_s=RENEW)
    reader.fs = late = LateReplies(reader.fs)
    for _ in range(8):  # prompt reads: the reader sees the holder renew
        assert reader.holder() is not None
        time.sleep(RENEW / 2)
    late.delay_s = 2.5 * (TTL + RENEW)
    for _ in range(2):
        assert reader.holder() is not None, "a live holder looked lapsed after a late reply"
    with pytest.raises(FencedError, match="already running"):
        reader.acquire(wait_s=0)
    assert not holder.seen("lost"), holder.seen("lost")
