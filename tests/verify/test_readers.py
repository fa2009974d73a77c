"""verify's independent output readers against a real broker."""

from __future__ import annotations

import uuid

import pytest

from kafka_broker import KafkaBroker, create_topic
from onceflow.verify.readers import read_output
from onceflow.verify.spec import VerifySpec


@pytest.mark.slow
def test_the_kafka_reader_reads_past_an_end_the_broker_reports_too_early(tmp_path):
    """tansu reports a partition's end as its last record batch's base offset + 1: after one
    12,000-record producer batch (an at-least-once sink's), the end was 1. The reader stopped
    there and counted 2,000 of a faultless run's ids missing (ci20). Old code: 5,000 (one
    ``consume``) of the 12,000 read."""
    from confluent_kafka import Producer

    n = 12_000
    with KafkaBroker() as broker:
        spec = VerifySpec(workdir=str(tmp_path), name=uuid.uuid4().hex[:8], sink="kafka", kafka=broker.bootstrap)
        create_topic(broker.bootstrap, spec.table, 1)
        p = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 100, "batch.num.messages": 100_000})
        for i in range(n):
            p.produce(spec.table, f"{i},p{i},{i}".encode())
        assert p.flush(30) == 0
        # (this tansu reports an end of 1 here; with a broker that reports n the test only
        # checks the reader)
        got = read_output(spec)
    assert sorted(got.column("id").to_pylist()) == list(range(n))
