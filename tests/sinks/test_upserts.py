"""What the upsert sinks share: the last event per key of a batch, and the options' checks."""

from __future__ import annotations

import pyarrow as pa
import pytest

from onceflow.errors import ConfigError
from onceflow.sinks.upserts import check_fields, last_per_key, parse_wire, wire_options


def test_last_per_key_is_deterministic_without_order_by_and_with_ties():
    """Without order_by the batch's order decides; with it the largest value wins, a tie by the
    batch's order, and a null never beats a value. Null keys form one key."""
    rows = pa.table({"k": [1, 2, 1, 1, None, None], "o": [5, 1, 5, None, 2, 3], "v": list("abcdef")})
    plain = last_per_key(rows, ["k"], None)
    assert plain.to_pylist() == [{"k": 2, "o": 1, "v": "b"}, {"k": 1, "o": None, "v": "d"},
                                 {"k": None, "o": 3, "v": "f"}]  # winners in the batch's order
    ordered = last_per_key(rows, ["k"], "o")
    assert {r["k"]: r["v"] for r in ordered.to_pylist()} == {1: "c", 2: "b", None: "f"}
    assert last_per_key(rows.slice(0, 0), ["k"], "o").num_rows == 0


def test_compound_keys():
    rows = pa.table({"a": [1, 1, 1, 2], "b": ["x", "y", "x", "x"], "v": [1, 2, 3, 4]})
    assert sorted(r["v"] for r in last_per_key(rows, ["a", "b"], None).to_pylist()) == [2, 3, 4]


@pytest.mark.parametrize("kw, message", [
    ({"write": "upsert", "keys": None}, "needs keys"),
    ({"write": "upsert", "keys": [""]}, "needs keys"),
    ({"write": "append", "keys": ["k"]}, "write='upsert' only"),
    ({"write": "append", "keys": None, "order_by": "o"}, "write='upsert' only"),
    ({"write": "merge", "keys": None}, "use 'append' or 'upsert'"),
])
def test_a_sinks_upsert_fields_are_checked_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_fields("S", kw["write"], kw["keys"], kw.get("delete_when"), kw.get("order_by"))
    assert "\n" not in str(e.value)


def test_fields_reach_the_data_source_and_back():
    keys = check_fields("S", "upsert", "k", "op = 'd'", "seq")
    assert keys == ["k"]
    wire = wire_options("upsert", keys, "seq", "op = 'd'")
    assert parse_wire(wire, "fmt") == (("k",), "seq", "_onceflow_delete")
    assert wire_options("append", None, None, None) == {} and parse_wire({}, "fmt") is None
    with pytest.raises(ConfigError, match="names a column twice"):
        parse_wire({"write": "upsert", "keys": "k,k"}, "fmt")
    with pytest.raises(ConfigError, match="applies to write='upsert' only"):
        parse_wire({"keys": "k"}, "fmt")
