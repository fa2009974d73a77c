"""verify's clock_skew environment: a JVM on a skewed libfaketime clock sees the skew and does
not spin (its timed waits wait)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from onceflow.verify.clock import clock_shim, faketime_env, libfaketime, set_offset

pytestmark = pytest.mark.skipif(libfaketime() is None or shutil.which("java") is None or shutil.which("cc") is None,
                                reason="needs libfaketime, java and cc")

# ten 300 ms Object.wait timeouts and a 1 s sleep (monotonic timed waits, as a JVM's threads
# do all the time), with a scheduler ticking every 10 ms; prints the elapsed time and the wall clock
_PROGRAM = """
public class Waits { public static void main(String[] a) throws Exception {
  var s = java.util.concurrent.Executors.newScheduledThreadPool(2);
  s.scheduleAtFixedRate(() -> {}, 10, 10, java.util.concurrent.TimeUnit.MILLISECONDS);
  Object o = new Object(); long t0 = System.nanoTime();
  synchronized (o) { for (int i = 0; i < 10; i++) o.wait(300); }
  Thread.sleep(1000);
  System.out.println((System.nanoTime() - t0) / 1000000 + " " + System.currentTimeMillis());
  System.exit(0);
}}
"""


@pytest.mark.parametrize("skew", [-300, 300])
def test_a_jvm_on_a_skewed_clock_waits_and_does_not_spin(tmp_path, skew):
    clock_shim(str(tmp_path))
    offset = str(tmp_path / "offset")
    set_offset(offset, skew)
    (tmp_path / "Waits.java").write_text(_PROGRAM)
    env = {**os.environ, **faketime_env(offset)}
    started = time.time()
    proc = subprocess.Popen(["java", "-Xshare:auto", "Waits.java"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ps = psutil.Process(proc.pid)
    cpu = 0.0
    while proc.poll() is None:
        try:
            t = ps.cpu_times()
            cpu = t.user + t.system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    elapsed_ms, wall_ms = (int(x) for x in out.split())
    # the timed waits waited (with the pthread "monotonic fix" on they returned at once: 1.2 s)
    assert elapsed_ms >= 3900, elapsed_ms
    # the JVM saw the skewed wall clock
    assert abs(wall_ms / 1000 - started - skew) < 60, (wall_ms / 1000 - started, skew)
    # compiling the source takes a few CPU seconds; spinning took 3 s of CPU per second of waiting
    waited_s = elapsed_ms / 1000
    assert cpu < 4 + 0.5 * waited_s, (cpu, waited_s)


# librdkafka (confluent-kafka) waits with C11's cnd_timedwait, on a deadline read from the wall
# clock; five 1 s consumes (no broker needed: each returns empty after its timeout)
_CONSUMER = """
import sys
import time
from confluent_kafka import Consumer, TopicPartition
c = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g", "log_level": 0})
c.assign([TopicPartition("t", 0, 0)])
t0 = time.monotonic()
for _ in range(5):
    c.consume(num_messages=10, timeout=1.0)
print(round(time.monotonic() - t0, 2), round(time.time()))
"""


@pytest.mark.parametrize("skew", [-300, 300])
def test_librdkafka_on_a_skewed_clock_waits_its_timeouts(tmp_path, skew):
    """Without the shim's ``cnd_timedwait`` conversion, a clock 300 s ahead made each
    librdkafka wait sleep 300 s in the kernel (a stall no real clock step causes)."""
    pytest.importorskip("confluent_kafka")
    clock_shim(str(tmp_path))
    offset = str(tmp_path / "offset")
    set_offset(offset, skew)
    env = {**os.environ, **faketime_env(offset)}
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-c", _CONSUMER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("a 1 s consume did not return within 60 s on the skewed clock") from None
    assert proc.returncode == 0, err[-2000:]
    elapsed, wall = (float(x) for x in out.split())
    assert 4.5 <= elapsed < 15, elapsed
    assert abs(wall - started - skew) < 60, (wall - started, skew)
