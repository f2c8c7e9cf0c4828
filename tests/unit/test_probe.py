"""BucketProbe's communication overlap: union of in-flight intervals, split at compute end."""

import pytest

from poise.comm.probe import BucketProbe


def _probe(intervals):
    probe = BucketProbe()
    probe.in_flight = list(intervals)
    return probe


def test_overlap_merges_concurrent_buckets_and_splits_at_the_end_of_compute():
    # two buckets in flight together (1-3, 2-4), a gap, then one after compute ended at 5
    busy, hidden = _probe([(2.0, 4.0), (1.0, 3.0), (6.0, 7.5)]).comm_overlap(5.0)
    assert busy == pytest.approx(3.0 + 1.5)
    assert hidden == pytest.approx(3.0)
    # an interval that straddles the end of compute is split
    busy, hidden = _probe([(1.0, 4.0)]).comm_overlap(2.5)
    assert (busy, hidden) == (pytest.approx(3.0), pytest.approx(1.5))


def test_no_buckets_means_no_communication():
    assert BucketProbe().comm_overlap(1.0) == (0.0, 0.0)
