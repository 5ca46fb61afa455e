"""``device_ops.positions_of`` / ``flatnonzero``: the compaction that replaces CuPy's nonzero on
the device path (a cumulative-sum scatter, no size read back when the count is known), checked
against numpy's flatnonzero, and its one counted read."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding import host_sync
from one_embedding.kernels import device_ops


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_positions_of_equals_flatnonzero(seed, p):
    rng = np.random.default_rng(seed)
    mask = rng.random(int(rng.integers(0, 300))) < p
    want = np.flatnonzero(mask)
    got = device_ops.positions_of(np, mask, int(mask.sum()))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


def test_flatnonzero_reads_once_by_reason():
    mask = np.array([False, True, True, False, True])
    with host_sync.counting() as reads:
        got = device_ops.flatnonzero(np, mask, "example")
    np.testing.assert_array_equal(got, [1, 2, 4])
    assert dict(reads.by_reason) == {"example": 1}
