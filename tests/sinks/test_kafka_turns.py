"""The Kafka sink's turns for transaction ends (onceflow/sinks/kafka/turns.py), with real
processes holding the lock: a live holder is waited for, a stopped one passed by, a dead one
releases it. The broker-level effect is tested in test_kafka_sink.py (the wedge)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from onceflow.sinks.kafka import producers, turns

HOLDER = textwrap.dedent("""
    import sys, time
    from onceflow.sinks.kafka import producers, turns
    turns.serialize(sys.argv[1])
    with producers.ending({"bootstrap.servers": sys.argv[1]}):
        open(sys.argv[2], "w").close()
        time.sleep(float(sys.argv[3]))
        open(sys.argv[2] + ".releasing", "w").write(repr(time.time()))
""")


@pytest.fixture
def bootstrap():
    name = f"turns-test-{uuid.uuid4().hex[:8]}:9092"
    turns.serialize(name)
    yield name
    producers._END_GUARDS.pop(name, None)
    Path(turns.lock_path(name)).unlink(missing_ok=True)


def _holder(bootstrap: str, tmp_path: Path, hold_s: float) -> subprocess.Popen:
    ready = tmp_path / f"ready-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, bootstrap, str(ready), str(hold_s)],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not take its turn"
        time.sleep(0.01)
    return proc


def _wait_for_turn(bootstrap: str) -> tuple[float, int, float]:
    """Seconds until this process's end got its turn, the pid in the lock file then, and the
    wall-clock time the turn came."""
    started = time.monotonic()
    with producers.ending({"bootstrap.servers": bootstrap}):
        waited, at = time.monotonic() - started, time.time()
        holder = int(Path(turns.lock_path(bootstrap)).read_text() or 0)
    return waited, holder, at


def test_a_live_holder_is_waited_for_and_the_turn_is_then_this_processes(bootstrap, tmp_path):
    proc = _holder(bootstrap, tmp_path, 1.0)
    _, holder, at = _wait_for_turn(bootstrap)
    assert proc.wait(10) == 0
    # causal, not timed: the turn came only after the holder was about to release it
    released = float(next(tmp_path.glob("ready-*.releasing")).read_text())
    assert at >= released and holder == os.getpid()
    assert Path(turns.lock_path(bootstrap)).read_text() == ""  # released: no stale pid left


def test_a_stopped_holder_is_passed_by_and_a_killed_one_releases_the_turn(bootstrap, tmp_path):
    proc = _holder(bootstrap, tmp_path, 60)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        waited, holder, _ = _wait_for_turn(bootstrap)
        # went ahead alone at once (not after TURN_WAIT_S): the lock is still the holder's
        assert waited < 2 < turns.TURN_WAIT_S and holder == proc.pid
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    waited, holder, _ = _wait_for_turn(bootstrap)
    assert waited < 2 and holder == os.getpid()


def test_ends_on_a_broker_that_is_not_serialized_take_no_turn(tmp_path):
    name = f"turns-test-{uuid.uuid4().hex[:8]}:9092"
    with producers.ending({"bootstrap.servers": name}):
        pass
    assert not Path(turns.lock_path(name)).exists() and name not in producers._END_GUARDS


def test_the_sink_takes_turns_on_a_broker_whose_probe_is_skipped_or_when_told():
    from onceflow.errors import ConfigError
    from onceflow.sinks.kafka import KafkaSink

    def serialized(**kw) -> bool:
        name = f"turns-test-{uuid.uuid4().hex[:8]}:9092"
        extra = kw.pop("extra", {})
        KafkaSink(name, "t", **kw).data_source(extra)
        return name in producers._END_GUARDS

    assert not serialized()
    assert serialized(extra={"skip_broker_probe": "true"})
    assert not serialized(serialize_commits=False, extra={"skip_broker_probe": "true"})
    assert serialized(serialize_commits=True)
    assert not serialized(serialize_commits=True, mode="at_least_once")  # no transactions
    with pytest.raises(ConfigError, match="serialize_commits='maybe'; use 'auto', 'true' or 'false'"):
        serialized(extra={"serialize_commits": "maybe"})


def test_the_turns_travel_with_the_writer_to_sparks_python_workers(spark):
    """Spark ships the stream writer, and the sink in it, to its Python workers by pickling;
    ``__init__`` does not run there. Before, only the driver's ends took turns and tasks of
    one batch committed their transactions at once in the workers (the wedge of CI, stop 39)."""
    from pyspark import cloudpickle
    from pyspark.sql.types import StringType, StructField, StructType

    from onceflow.sinks.base import TwoPhaseCommitWriter
    from onceflow.sinks.kafka import KafkaSink

    schema = StructType([StructField("value", StringType())])

    def guarded(**kw) -> bool:
        name = f"turns-test-{uuid.uuid4().hex[:8]}:9092"  # never registered in any worker before
        writer = TwoPhaseCommitWriter(KafkaSink(name, "t", **kw).data_source({}), schema, False)
        producers._END_GUARDS.pop(name, None)  # the driver's registration proves nothing here
        blob = cloudpickle.dumps(writer)

        def in_task(_):
            import pickle

            from onceflow.sinks.kafka import producers as worker_producers

            pickle.loads(blob)
            yield name in worker_producers._END_GUARDS

        return spark.sparkContext.parallelize([0], 1).mapPartitions(in_task).collect() == [True]

    assert guarded(serialize_commits=True)
    assert not guarded(serialize_commits=False)
