"""One lease party in its own process, for tests that need real processes (other PID
namespaces, other host names, skewed clocks): ``python lease_proc.py EVENTS MODE CKPT [k=v...]``.

Every step is appended to EVENTS as a JSON line (``event``, ``pid``, ...), and so is every
onceflow log line (``event: "log"``). Modes:

* ``hold``: take the lease (``wait`` seconds of standing by, default 0) and keep it until
  SIGTERM (then release) or until it is lost; with ``again=1`` a lost or refused lease is
  taken again, as a supervisor restarts its driver.
* ``check``: run the commit-time check for lease ``epoch`` every ``every`` seconds.
* ``reuse``: (run as the init of a fresh PID namespace) a child takes the lease and is
  SIGKILLed, its pid is given to a new process, and this process takes the lease.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time


def main() -> None:
    if "faketime" in os.environ.get("LD_PRELOAD", ""):
        # libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 fails Python 3.11's time.sleep
        # (clock_nanosleep with TIMER_ABSTIME: EINVAL); select's timeout is unaffected.
        time.sleep = lambda s: select.select([], [], [], s)
    events, mode, ckpt = sys.argv[1:4]
    opts = dict(a.split("=", 1) for a in sys.argv[4:])
    if opts.get("hostname"):
        socket.sethostname(opts["hostname"])  # needs its own UTS namespace (unshare --uts)
    lock = threading.Lock()

    def emit(event: str, **fields) -> None:
        with lock, open(events, "a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")

    class ToEvents(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            emit("log", msg=record.getMessage(), level=record.levelname)

    logging.getLogger("onceflow").addHandler(ToEvents())
    logging.getLogger("onceflow").setLevel(logging.INFO)

    from onceflow.checkpoint.lease import DriverLease, check_driver_lease
    from onceflow.errors import DriverLeaseLapsed, FencedError

    ttl, renew = float(opts.get("ttl", 1)), float(opts.get("renew", 0.2))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    emit("started", mode=mode, host=socket.gethostname())
    if mode == "hold":
        while not stop.is_set():
            lease = DriverLease(ckpt, "job", ttl_s=ttl, renew_s=renew)
            try:
                lease.acquire(wait_s=float(opts.get("wait", 0)))
            except FencedError as e:
                emit("refused", error=str(e))
                if opts.get("again") != "1":
                    return
                continue
            emit("holding", epoch=lease.epoch)
            while not stop.is_set() and not lease.lost.wait(0.05):
                pass
            if lease.lost.is_set():
                emit("lost", epoch=lease.epoch, reason=lease.lost_reason)
                if opts.get("again") != "1":
                    return
            else:
                lease.release()
                emit("released", epoch=lease.epoch)
    elif mode == "check":
        while not stop.wait(float(opts.get("every", 0.2))):
            try:
                check_driver_lease(ckpt, int(opts.get("epoch", 1)), ttl)
                emit("ok")
            except (DriverLeaseLapsed, FencedError) as e:
                emit("refused", error=str(e), kind=type(e).__name__)
    elif mode == "reuse":
        holder = subprocess.Popen([sys.executable, __file__, events, "hold", ckpt, f"ttl={ttl}",
                                   f"renew={renew}"])
        _wait_for(events, lambda e: e["event"] == "holding" and e["pid"] == holder.pid)
        holder.kill()
        holder.wait()
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the next process gets its pid
            f.write(str(holder.pid - 1))
        squatter = subprocess.Popen(["sleep", "60"])
        emit("reused", pid_of_dead_holder=holder.pid, squatter=squatter.pid)
        t0 = time.monotonic()
        lease = DriverLease(ckpt, "job", ttl_s=ttl, renew_s=renew)
        try:
            lease.acquire()
            emit("holding", epoch=lease.epoch, took_s=time.monotonic() - t0)
            lease.release()
        except FencedError as e:
            emit("refused", error=str(e))
        squatter.kill()


def _wait_for(events: str, pred, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(events) as f:
                if any(pred(json.loads(line)) for line in f if line.strip()):
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"no such event in {events}")


if __name__ == "__main__":
    main()
