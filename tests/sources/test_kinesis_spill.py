"""Integrity of the Kinesis source's spill files (sources/kinesis/spill.py) against kinesalite.

The driver plans a range the way Spark asks it to (initialOffset, latestOffset, partitions),
which spills what it read; the file is then cut short as a host crash without fsync leaves it,
and the executor side (``read``) must still return the whole range, from Kinesis."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

import onceflow.sources.kinesis.shards as kinesis_shards
from onceflow.sources.kinesis import SCHEMA, KinesisSource, KinesisStreamReader, parse_options

SHARD0 = "shardId-000000000000"


def planned(kinesalite, stream: str, ckpt: Path):
    """(reader, the one planned partition, its spill file) for the records of ``stream``."""
    opts = KinesisSource(stream, starting_position="TRIM_HORIZON", event_log=str(ckpt),
                         **kinesalite.source_options()).options()
    reader = KinesisStreamReader(parse_options(opts), SCHEMA)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    [part] = reader.partitions(start, end)
    [spill] = list((ckpt / "_onceflow" / "kinesis-spill").glob("*.arrow"))
    return reader, part, spill


def ids(reader, part) -> list[int]:
    return [int(d) for b in reader.read(part) for d in b.column("data").to_pylist()]


def batch_boundaries(data: bytes) -> list[int]:
    """Offsets in an Arrow IPC stream just after its schema and after each record batch."""
    stream = pa.ipc.open_stream(pa.BufferReader(data))
    at = [len(stream.schema.serialize())]
    for batch in stream:
        at.append(at[-1] + len(batch.serialize()))
    return at


@pytest.fixture
def two_batches(monkeypatch, kinesalite, stream_name):
    """A 1-shard stream holding ids 0..199, read ahead by the driver 100 records per GetRecords
    (so the spill file holds two record batches of 100 rows)."""
    monkeypatch.setattr(kinesis_shards, "MAX_LIMIT", 100)
    kinesalite.create_stream(stream_name, 1)
    kinesalite.put(stream_name, [(f"k{i % 8}", str(i).encode()) for i in range(200)])
    return stream_name


def test_whole_spill_file_is_used(kinesalite, two_batches, tmp_path):
    """An intact file serves the range (the stream is deleted first, so Kinesis could not)."""
    reader, part, spill = planned(kinesalite, two_batches, tmp_path / "ckpt")
    assert len(batch_boundaries(spill.read_bytes())) == 3  # the schema, then two record batches
    kinesalite.client().delete_stream(StreamName=two_batches)
    assert ids(reader, part) == list(range(200))


@pytest.mark.parametrize("cut", ["at_batch_boundary", "inside_a_batch"])
def test_spill_file_cut_short_is_ignored_and_the_range_read_from_kinesis(kinesalite, two_batches, tmp_path,
                                                                         caplog, cut):
    """A spill file cut short (as a host crash after an un-fsynced rename leaves it) is removed
    with one WARNING line, and the task reads all 200 records of its range from Kinesis.
    Old code: cut after the first record batch, the task returned 100 of the 200 rows with no
    error; cut inside the second batch, every attempt failed with ArrowInvalid, forever."""
    reader, part, spill = planned(kinesalite, two_batches, tmp_path / "ckpt")
    data = spill.read_bytes()
    after_first = batch_boundaries(data)[1]
    spill.write_bytes(data[:after_first] if cut == "at_batch_boundary" else data[:after_first + 40])
    with caplog.at_level(logging.WARNING, logger="onceflow.sources.kinesis"):
        assert ids(reader, part) == list(range(200))
    assert not spill.exists()
    lines = [r.getMessage() for r in caplog.records if "spill" in r.getMessage()]
    assert len(lines) == 1 and f"ignored and removed spill file {spill}" in lines[0], lines
    assert "reading the range from Kinesis" in lines[0]
    assert ids(reader, part) == list(range(200))  # and again (a retried task)


def test_spill_file_of_another_range_or_corrupted_is_not_used(kinesalite, two_batches, tmp_path, caplog):
    """A file whose bytes changed (same length) fails its checksum; a whole file renamed to
    another range's name fails the range check: both are removed and Kinesis is read."""
    reader, part, spill = planned(kinesalite, two_batches, tmp_path / "ckpt")
    data = bytearray(spill.read_bytes())
    at = batch_boundaries(bytes(data))[1] - 8
    data[at] ^= 0xFF
    spill.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="onceflow.sources.kinesis"):
        assert ids(reader, part) == list(range(200))
    assert "does not match the SHA-256" in caplog.text and not spill.exists()

    kinesalite.put(two_batches, [("k", b"200")])
    reader2, part2, spill2 = planned(kinesalite, two_batches, tmp_path / "ckpt2")
    assert part2.end != part.end
    spill2.rename(spill2.with_name(spill2.name.replace(part2.end, part.end)))  # claims the first range
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onceflow.sources.kinesis"):
        assert ids(reader2, type(part)(part.stream, part.shard, part.start, part.end)) == list(range(200))
    assert f"its trailer says end='{part2.end}', not '{part.end}'" in caplog.text
