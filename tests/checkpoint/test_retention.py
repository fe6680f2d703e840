"""Retention policies are pure: committed steps in, (kept, deleted) out."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptsdk.checkpoint import retention


def test_keep_last_over_twenty_saves():
    steps = list(range(100, 2100, 100))
    kept, deleted = retention.plan(steps, [retention.keep_last(3)])
    assert kept == [1800, 1900, 2000]
    assert deleted == list(range(100, 1800, 100))


def test_keep_every_composes_with_keep_last():
    steps = list(range(100, 1100, 100))
    kept, _ = retention.plan(steps, [retention.keep_last(2), retention.keep_every(500)])
    assert kept == [500, 900, 1000]


def test_protect_keeps_resume_point():
    kept, deleted = retention.plan([1, 2, 3, 4, 5], [retention.keep_last(2), retention.protect([2, 99])])
    assert kept == [2, 4, 5]
    assert deleted == [1, 3]


def test_empty_and_invalid():
    assert retention.plan([], [retention.keep_last(1)]) == ([], [])
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        retention.keep_last(0)
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        retention.keep_every(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 5))
def test_newest_always_kept_and_partition(steps, n):
    kept, deleted = retention.plan(steps, [retention.keep_last(n)])
    assert sorted(kept + deleted) == sorted(set(steps))
    if steps:
        assert max(steps) in kept
        assert len(kept) == min(n, len(set(steps)))
