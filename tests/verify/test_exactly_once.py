import numpy as np
import pyarrow as pa

from onceflow.verify.exactly_once import check_ids, check_running_counts


def test_exact_sequence_is_ok():
    r = check_ids(np.random.default_rng(1).permutation(1000), 1000)
    assert r.ok and r.committed == 1000 and r.distinct == 1000


def test_duplicates_missing_and_unexpected_are_counted():
    ids = np.r_[np.arange(0, 50), np.arange(40, 45), np.arange(60, 100), [5000]]
    r = check_ids(ids, 100)
    assert not r.ok
    assert r.duplicates == 5 and r.sample_duplicates[:2] == [40, 41]
    assert r.missing == 10 and r.sample_missing[0] == 50
    assert r.unexpected == 1


def test_running_counts_detect_double_applied_state():
    good = pa.table({"id": [0, 2, 1, 3], "key": [0, 0, 1, 1], "running_count": [1, 2, 1, 2]})
    assert check_running_counts(good) == 0
    bad = pa.table({"id": [0, 2, 1, 3], "key": [0, 0, 1, 1], "running_count": [1, 3, 1, 2]})
    assert check_running_counts(bad) == 1


def test_upsert_check_catches_stale_twice_held_resurrected_and_corrupted_keys():
    """events 0..99: 25 keys (i % 25), each key's last event is 75 + k; 82 and 93 (i % 11 == 5:
    keys 7 and 18) are deletes."""
    from onceflow.verify.exactly_once import check_upserts
    from onceflow.verify.spec import checksum, payload

    def rows(pairs):
        return pa.table({"k": [k for k, _ in pairs], "id": [i for _, i in pairs],
                         "payload": [payload(i) for _, i in pairs], "checksum": [checksum(payload(i)) for _, i in pairs]})

    exact = [(k, 75 + k) for k in range(25) if k not in (7, 18)]
    assert check_upserts(rows(exact), 100).ok and check_upserts(rows(exact), 100).expected == 23
    stale = [(k, 50 + k) if k == 3 else (k, i) for k, i in exact]  # an old batch applied again
    assert check_upserts(rows(stale), 100).missing == 1
    assert check_upserts(rows(exact[1:]), 100).missing == 1
    assert check_upserts(rows(exact + [(4, 79)]), 100).duplicates == 1
    assert check_upserts(rows(exact + [(7, 82)]), 100).unexpected == 1  # a delete that did not delete
    bad = rows(exact).set_column(3, "checksum", pa.array([0] * 23, pa.int64()))
    assert check_upserts(bad, 100).corrupted == 23
