"""``clock_skew``: a host's wall clock jumps by minutes while the job runs (libfaketime).

When clock_skew is among the faults, every supervisor verify starts (and so every driver,
standby, JVM and Python worker below it) runs with libfaketime preloaded, reading its offset
from a file (``+0s`` normally) at most once a second; monotonic clocks stay real
(``FAKETIME_DONT_FAKE_MONOTONIC=1``, which also keeps CLOCK_BOOTTIME real). Its
``pthread_cond_timedwait`` "monotonic fix" is off (``FAKETIME_FORCE_MONOTONIC_FIX=0``): with it,
every timed wait of a JVM on a monotonic condition returned at once, and the driver's JVM spun
at 150% CPU for as long as it lived.

Each injection starts a second ``onceflow run --wait-for-lease`` as the init of its own PID
namespace on another host name (a second pod: it cannot check the holder's pid, so it must
judge the lease by its record alone; no standby of its own, its own offset file) and waits
until it stands by for the lease. Then it jumps one clock by ``--skew-s`` forward or back (seeded): the job's host
(the successor, on a real clock, judges a skewed holder) or the successor's (a skewed reader
judges a real holder). It holds the skew for ``max(--outage-s, 3 x lease TTL + 2)`` seconds,
resets it, and stops the successor. The lease needs no shared clock, so the fault requires:
the job keeps committing meanwhile (a batch commits in the second half of the hold, not just
the one in flight at the jump), and the successor never takes the lease (either one is an
anomaly).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import time

from onceflow.errors import ConfigError
from onceflow.verify import procs
from onceflow.verify.fault_base import Fault, FaultMissed, Harness, can_unshare

#: libfaketime re-reads its offset file at most this often (seconds)
CACHE_S = 1

#: The shim preloaded before libfaketime. (1) libfaketime 0.9.10 with
#: FAKETIME_DONT_FAKE_MONOTONIC=1 fails every absolute ``clock_nanosleep`` on a monotonic clock
#: with EINVAL, which is how Python 3.11's ``time.sleep`` sleeps: monotonic sleeps go straight to
#: the kernel, every other one on to libfaketime. (2) libfaketime converts the deadline of
#: ``pthread_cond_timedwait`` from the faked clock to the kernel's, but not of C11's
#: ``cnd_timedwait``, which librdkafka (confluent-kafka) waits with: a deadline read on a clock
#: 300 s ahead made every librdkafka thread sleep 300 s in the kernel, a stall no real clock step
#: causes. The shim converts it the same way (deadline minus the faked clock's lead).
_CLOCK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <threads.h>
#include <time.h>
#include <unistd.h>
int clock_nanosleep(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem) {
    if (clk == CLOCK_MONOTONIC || clk == CLOCK_MONOTONIC_RAW || clk == CLOCK_BOOTTIME)
        return syscall(SYS_clock_nanosleep, clk, flags, req, rem) == 0 ? 0 : errno;
    int (*next)(clockid_t, int, const struct timespec *, struct timespec *) =
        (int (*)(clockid_t, int, const struct timespec *, struct timespec *))dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clk, flags, req, rem);
}
int cnd_timedwait(cnd_t *cnd, mtx_t *mtx, const struct timespec *deadline) {
    static int (*next)(cnd_t *, mtx_t *, const struct timespec *);
    if (!next)
        next = (int (*)(cnd_t *, mtx_t *, const struct timespec *))dlsym(RTLD_NEXT, "cnd_timedwait");
    struct timespec faked, real, at;
    clock_gettime(CLOCK_REALTIME, &faked);                /* through libfaketime */
    syscall(SYS_clock_gettime, CLOCK_REALTIME, &real);    /* the kernel's */
    long long ns = (long long)deadline->tv_sec * 1000000000LL + deadline->tv_nsec
        - ((long long)(faked.tv_sec - real.tv_sec) * 1000000000LL + (faked.tv_nsec - real.tv_nsec));
    at.tv_sec = ns / 1000000000LL;
    at.tv_nsec = ns % 1000000000LL;
    return next(cnd, mtx, &at);
}
"""


def libfaketime() -> str | None:
    """Path of libfaketime's preload library, or None."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1", "/usr/lib64/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def clock_shim(workdir: str) -> str:
    """Build (once per work directory) the shim preloaded before libfaketime; returns its path."""
    out = os.path.join(workdir, "clock-shim.so")
    if not os.path.exists(out):
        src = out[:-3] + ".c"
        with open(src, "w") as f:
            f.write(_CLOCK_SHIM)
        res = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", out, src, "-ldl"], capture_output=True, text=True)
        if res.returncode != 0:
            raise ConfigError(f"verify: clock_skew could not build its clock shim: {res.stderr.strip()[-300:]}")
    return out


def faketime_env(offset_file: str) -> dict[str, str]:
    """Environment that runs a process tree on ``offset_file``'s clock (``+300s``, ``-300s``);
    the shim (:func:`clock_shim`) must have been built in the file's directory."""
    lib = libfaketime()
    assert lib is not None
    shim = os.path.join(os.path.dirname(offset_file), "clock-shim.so")
    preload = " ".join(p for p in (shim, lib, os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "FAKETIME_TIMESTAMP_FILE": offset_file,
            "FAKETIME_CACHE_DURATION": str(CACHE_S), "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_FORCE_MONOTONIC_FIX": "0"}


def set_offset(path: str, seconds: float) -> None:
    """Make ``path``'s clock ``seconds`` off (atomically: a reader never sees half a line)."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{seconds:+.0f}s\n")
    os.replace(path + ".tmp", path)


_STANDING = re.compile(r"standing by: pid|which this host cannot check")


class ClockSkew(Fault):
    name, help = "clock_skew", ("jump the job host's or a standing-by successor host's wall clock "
                                "by --skew-s (forward or back), hold, reset (libfaketime)")
    stream_s = 90

    def unavailable(self, h: Harness) -> str | None:
        if libfaketime() is None:
            return "needs libfaketime (Debian/Ubuntu: apt-get install faketime) to skew a host's clock"
        if shutil.which("cc") is None:
            return "needs a C compiler (cc) to build the small clock shim libfaketime 0.9.10 needs"
        if not can_unshare("--pid", "--fork", "--mount-proc", "--uts"):
            return ("needs unshare(1) allowed to make PID and UTS namespaces (root) for the successor "
                    "host (its own PID namespace and host name)")
        return None

    def inject(self, h: Harness) -> str:
        assert h.faketime_file is not None
        skew = h.rng.choice([-1, 1]) * h.options.skew_s
        on_job = h.rng.random() < 0.5
        own = os.path.join(h.spec.workdir, f"faketime-successor-{len(h.extras)}")
        set_offset(own, 0)
        succ = h.start_supervisor(host=f"verify-skew-{len(h.extras)}", pid_namespace=True, faketime=own,
                                  extra=True)
        try:
            if not self._standing_by(h, succ):
                raise FaultMissed(f"the successor host (supervisor {succ.pid}) did not stand by for the lease")
            seq = len(h.events())
            target = h.faketime_file if on_job else own
            set_offset(target, skew)
            hold = max(h.options.outage_s, 3 * h.options.lease_ttl_s + 2)
            time.sleep(hold / 2)
            half = len(h.events())
            time.sleep(hold / 2)
            late = [e for e in h.events()[half:] if e["event"] == "sink_commit" and e["rows"]]
            set_offset(target, 0)
            time.sleep(CACHE_S + 0.5)  # every process re-read its offset: timestamps are real again
            during = [e for e in h.events()[seq:] if e["event"] == "sink_commit" and e["rows"]]
            took = self._took_over(h, succ, seq)
            why = self._why(h, succ, seq) if took else ""
        finally:
            self._stop(succ)
        h.settled_seq = len(h.events())
        where = "job host" if on_job else "successor host"
        if took:
            h.anomalies.append(f"clock_skew: the standing-by successor took the lease from a live driver "
                               f"while the {where}'s clock was {skew:+.0f}s off{why}")
        if not late:  # the batch in flight at the jump may commit; the job must go on after it
            h.anomalies.append(f"clock_skew: no batch committed during the last {hold / 2:.0f}s of {hold:.0f}s "
                               f"with the {where}'s clock {skew:+.0f}s off")
        return (f"{where} clock {skew:+.0f}s for {hold:.0f}s: {len(during)} batch(es) committed meanwhile; "
                f"the successor {'TOOK the lease' if took else 'stood by'}")

    @staticmethod
    def _standing_by(h: Harness, succ: subprocess.Popen) -> bool:
        """Wait until the successor's log says it stands by (it starts Spark first)."""
        deadline = time.monotonic() + h.options.recovery_timeout
        path = succ.log_path  # type: ignore[attr-defined]
        while time.monotonic() < deadline and succ.poll() is None:
            with open(path, errors="replace") as f:
                if _STANDING.search(f.read()):
                    return True
            time.sleep(0.5)
        return False

    @staticmethod
    def _took_over(h: Harness, succ: subprocess.Popen, seq: int) -> bool:
        """A runner of the successor (pids as its PID namespace knows them) started since ``seq``."""
        mine = set(procs.ns_pids(succ.pid))
        return any(e["event"] == "start" and e.get("pid") in mine for e in h.events()[seq:])

    @staticmethod
    def _why(h: Harness, succ: subprocess.Popen, seq: int) -> str:
        """What the successor's log says it took the lease on, any late renewal the job's
        drivers logged (a paused or starved holder lapses whatever the clocks say), and any
        stop of the job's driver since ``seq`` (a stop releases the lease)."""
        mine = set(procs.ns_pids(succ.pid))
        found = [f"the job's driver (pid {e.get('pid')}) stopped: {e.get('reason')}" for e in h.events()[seq:]
                 if e["event"] == "stop" and e.get("pid") not in mine and e.get("scope") != "process"]
        for proc, pattern in ((succ, r"took the lease of .*"), (h.supervisor, r"lease renewal of epoch .* comes .*")):
            try:
                with open(proc.log_path, errors="replace") as f:  # type: ignore[attr-defined]
                    found += re.findall(pattern, f.read())[:2]
            except (OSError, AttributeError):
                pass
        return "".join(f"; {line.strip()}" for line in found)

    @staticmethod
    def _stop(succ: subprocess.Popen) -> None:
        left = procs.tree(succ.pid)
        procs.terminate(succ.pid)
        try:
            succ.wait(30)
        except subprocess.TimeoutExpired:
            pass
        procs.signal_all(left, signal.SIGKILL)
