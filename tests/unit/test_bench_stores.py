"""bench_stores' stored_keys counts every key the table holds, whichever tier holds it (it was the
bottom tier's row count: 0 while every key sat in the cache)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
bench_stores = pytest.importorskip("benchmarks.bench_stores")


@pytest.mark.parametrize("store", ["device_mem", "cached_host_mem lru 4MB",
                                   "cached_ssd slots 4MB"])
def test_stored_keys_counts_the_keys_in_every_tier(store, tmp_path):
    args = SimpleNamespace(keys=5000, cache_mb=4, host_cache_mb=4)
    options = bench_stores.store_configs(args, str(tmp_path))[store]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 3000, 512) for _ in range(3)]
    r = bench_stores.run_chain(store, options, batches, warmup=1, line_size=16)
    assert r["stored_keys"] == np.unique(np.concatenate(batches)).size
    assert r["bottom_tier_rows"] <= r["stored_keys"]
