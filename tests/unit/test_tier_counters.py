"""TierCounters: host counts add up at once; device counts (0-d arrays of a fixed-capacity batch)
sum on the device into running sums read when the counters are, and those sums never alias a
caller's array (a view kept of the prefetch stream's live count was freed right after a later
add read it: a use after free on a GPU, found by tests/stream_order.py)."""
import numpy as np

from one_embedding import host_sync
from one_embedding.tiers.tier import TierCounters


def test_host_counts_add_up_at_once():
    c = TierCounters()
    c.record_find(10, 3)
    c.record_write(4, 1)
    assert c.as_dict() == {"hits": 7, "misses": 3, "evictions": 1, "writes": 4}


def test_device_counts_are_summed_and_read_with_the_counters():
    c = TierCounters()
    live = np.asarray(np.int64(6))
    c.record_find(live.reshape(()), np.asarray(np.int64(2)))
    c.record_find(8, np.asarray(np.int64(1)))          # a host count of keys, a device miss count
    c.record_write(live.reshape(()), 0)
    c.record_write(np.asarray(np.int32(5)), 2)
    c.record_write(3, 0)
    with host_sync.counting() as reads:
        got = c.as_dict()
    assert got == {"hits": 11, "misses": 3, "evictions": 2, "writes": 14}
    assert reads.by_reason == {"tier counters: device lookups": 1,
                               "tier counters: device misses": 1,
                               "tier counters: device writes": 1}
    # read again: nothing new, nothing read
    with host_sync.counting() as reads:
        assert c.as_dict() == got
    assert not reads.by_reason
    # only what changed is read; the sums go on from where they were
    c.record_write(np.asarray(np.int64(7)), 0)
    with host_sync.counting() as reads:
        assert c.as_dict()["writes"] == 21
    assert reads.by_reason == {"tier counters: device writes": 1}


def test_a_running_sum_keeps_no_view_of_the_callers_array():
    """The caller's count array may be reused (a fixed-capacity batch's live count lives in the
    prefetch stream's memory): the counters copied it at its first count."""
    c = TierCounters()
    live = np.array([5, 0], dtype=np.int64)
    c.record_write(live[:1].reshape(()), 0)
    c.record_find(live[:1].reshape(()), live[1:].reshape(()))
    live[:] = [1000, 1000]                      # the memory goes on to other uses
    assert c.as_dict() == {"hits": 5, "misses": 0, "evictions": 0, "writes": 5}
