"""Tier chains built from the store options, and snapshot failures of the in-memory presets."""
import errno
import os

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.store import memory
from one_embedding.errors import CapacityError, ConfigError, StoreError
from one_embedding.chain import build_chain


@pytest.mark.parametrize("make,names", [
    (lambda p: oe.make_device_mem_store_options(None, 100), ["device.full"]),
    (lambda p: oe.make_cached_host_mem_store_options(1, None, 100), ["device.lru", "host.full"]),
    (lambda p: oe.make_cached_host_mem_store_options(1, p, 100, cache_policy="lfu"),
     ["device.lfu", "host.full"]),
    (lambda p: oe.make_cached_ssd_store_options(1, p), ["device.lru", "ssd.slots"]),
    (lambda p: oe.make_cached_ssd_store_options(1, p, host_cache_budget_mb=2, engine="rocksdb"),
     ["device.lru", "host.lru", "ssd.rocksdb"]),
])
def test_preset_tiers(make, names, tmp_path):
    opts = make(str(tmp_path))
    chain = build_chain(opts, 16, 8, opts.persistent_path and str(tmp_path), 1)
    assert [t.name for t in chain.tiers] == names
    assert [s["tier"] for s in chain.stats()] == names
    if len(names) > 1:
        assert chain.tiers[0].capacity == 1 * 2**20 // (4 * 16)
    chain.close()


def test_cached_ssd_needs_a_path_and_a_usable_budget(tmp_path):
    opts = oe.make_cached_ssd_store_options(1, str(tmp_path))
    with pytest.raises(ConfigError, match="persistent_path"):
        build_chain(opts, 16, 8, None, 1)
    tiny = oe.make_cached_host_mem_store_options(1e-6, None, 10)
    with pytest.raises(CapacityError, match="raise cache_budget_mb"):
        build_chain(tiny, 16, 8, None, 1)


def test_chain_counts_hits_misses_evictions_per_tier(tmp_path):
    opts = oe.make_cached_ssd_store_options(16 * 64 / 2**20, str(tmp_path),
                                            host_cache_budget_mb=32 * 64 / 2**20)
    chain = build_chain(opts, 16, 8, str(tmp_path), 1)
    keys = np.arange(100, dtype=np.uint64)
    chain.put(keys, np.ones((100, 16), np.float32))
    dev, host, ssd = chain.stats()
    assert (dev["rows"], host["rows"], ssd["rows"]) == (16, 32, 52)
    assert (dev["evictions"], host["evictions"]) == (84, 52)
    lines, found = chain.lookup(np.arange(110, dtype=np.uint64))
    assert found[:100].all() and not found[100:].any() and (lines[:100] == 1).all()
    dev, host, ssd = chain.stats()
    assert (dev["hits"], host["hits"], ssd["hits"], ssd["misses"]) == (16, 32, 52, 10)
    chain.close()


@pytest.mark.parametrize("preset", ["device_mem", "cached_host_mem"])
def test_disk_full_during_save_keeps_last_snapshot(preset, tmp_path, monkeypatch):
    if preset == "device_mem":
        opts = oe.make_device_mem_store_options(str(tmp_path), 1000)
    else:
        opts = oe.make_cached_host_mem_store_options(0.001, str(tmp_path), 1000)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, opts)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    for ids in (np.arange(50), np.arange(25, 90)):
        out = emb(ids)
        emb.backward(np.ones_like(out))
        opt.step()
        if ids[0] == 0:
            emb.save_snapshot("s")
            kept = emb.export()

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memory, "write_array", enospc)
    with pytest.raises(StoreError, match="No space left.*intact"):
        emb.save_snapshot("s")
    monkeypatch.undo()
    emb.load_snapshot("s")
    got = emb.export()
    np.testing.assert_array_equal(got[0], kept[0])
    np.testing.assert_array_equal(got[1], kept[1])
    emb.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_a_host_store_snapshot_is_named_as_one(tmp_path, monkeypatch):
    """np.save's short write on a full disk was an OSError without an errno ("77264 requested
    and 14304 written"), so the message could not say the disk was full, and it promised a
    previous snapshot of that name that never existed (found by a fault campaign)."""
    from one_embedding.errors import SnapshotError
    from one_embedding.store import durable

    with pytest.raises(OSError) as e:
        durable.write_array("/dev/full", np.ones(1 << 16, np.float32))
    assert e.value.errno == errno.ENOSPC
    opts = oe.make_cached_host_mem_store_options(0.001, str(tmp_path), 1000)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, opts)
    emb(np.arange(50))
    monkeypatch.setattr(memory, "write_array",
                        lambda path, array: durable.write_array("/dev/full", array))
    with pytest.raises((StoreError, SnapshotError), match=r"the disk of .* is full.*every "
                                                          r"snapshot already published is intact "
                                                          r"\(none had that name\)"):
        emb.save_snapshot("first")
    monkeypatch.undo()
    emb.close()

