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

