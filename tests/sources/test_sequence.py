"""The sequence source's pacing (the demo's and ``onceflow verify``'s stream)."""

from __future__ import annotations

from onceflow.sources.sequence import SequenceReader


def test_a_release_file_makes_the_rest_of_the_stream_available_at_once(tmp_path):
    """Before the file exists ids come at ``rows_per_second`` (capped per batch); once it
    exists (verify, after its last fault), every id up to ``total`` is available, in batches of
    at most 10 x ``max_rows_per_batch``. Old code: no ``release_file``; the tail of a verify
    stream ran at ``--rate`` however early the faults were done."""
    release = tmp_path / "release-the-stream"
    reader = SequenceReader(total=100_000, rate=1000, partitions=2, keys=16, max_rows=2000, release=str(release))
    first = reader.latestOffset({"next": 0})["next"]
    assert first < 500  # at the rate: the clock has barely started
    assert reader.latestOffset({"next": first})["next"] < first + 500
    release.write_text("now\n")
    assert reader.latestOffset({"next": first})["next"] == first + 20_000
    assert reader.latestOffset({"next": 95_000})["next"] == 100_000
    unbounded = SequenceReader(total=None, rate=1000, partitions=2, keys=16, max_rows=None, release=str(release))
    assert unbounded.latestOffset({"next": 0})["next"] < 500  # no total: nothing to release


def test_a_restarted_stream_finds_a_seconds_ids_waiting_and_a_fresh_one_none():
    """A query restarting a stream that has read ids before finds WAITING_S seconds' worth at
    its first trigger (what a real source received while it was down), capped per batch; a
    fresh stream finds none. Old code: the restart found nothing too, so its first batch waited
    for the next trigger instant (0.5-0.75 s of each demo takeover)."""
    from onceflow.sources.sequence import WAITING_S

    restarted = SequenceReader(total=None, rate=1000, partitions=2, keys=16, max_rows=None)
    assert restarted.latestOffset({"next": 5000})["next"] >= 5000 + int(1000 * WAITING_S)
    capped = SequenceReader(total=None, rate=1000, partitions=2, keys=16, max_rows=300)
    assert capped.latestOffset({"next": 5000})["next"] == 5300
    fresh = SequenceReader(total=None, rate=1000, partitions=2, keys=16, max_rows=None)
    assert fresh.latestOffset({"next": 0})["next"] < 500
    assert fresh.latestOffset(None)["next"] < 500
