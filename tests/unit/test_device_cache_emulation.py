"""The embedding side's CUDA kernels executed on the host, against their CPU twins.

The families hashindex, cache, embedding, optim and codec are compiled once with g++ against
``kernels/cuda/host_emulation.cuh`` (tests/cuda_emulation.py) and driven through the real device
glue, ``kernels.device_ops`` and ``cache.device``, with numpy arrays in place of CuPy arrays. Every
launch is checked against the kernel's parameter list. What this verifies without a GPU: index
arithmetic, loop bounds, warp collectives and barriers (a divergent barrier fails the launch),
atomics under interleaving, the grouping and compaction around the kernels, and every result
against the twin:

- device hash index / full store vs tiers.HashIndex / store.MemoryStore (slots, finds, exports);
- device cache vs cache.SetAssociativeCache (hits, misses, touched lines, victims, evicted lines
  in order, spills, the "evicted twice leaves once with its newer line" rule, LRU and LFU);
- unique + inverse and segment sums vs parallel.unique, gathers vs reference.gather_rows,
  bit for bit; initial values vs initializers (the hash exactly, values within 1 float32 ulp);
- the fused optimizer updates vs optim.kernels (numba), bit for bit;
- the int8 and fp16 codecs vs parallel.codec, byte for byte.

Every test also runs in the emulator's stress mode with seeds 1, 2, 3 (``stress_seeds``,
tests/conftest.py): threads and blocks interleaved at random, the cache's shared set state checked
for races and unwritten reads, every index bounds-checked, fresh buffers full of garbage.

What is left to the GPU tests (tests/test_device_gpu.py): CuPy's own functions, NVRTC's code
generation, flush-to-zero, real concurrency between blocks and timing.
"""
from __future__ import annotations

import ast
import shutil

import numpy as np
import pytest
from cuda_emulation import EmulatedLauncher

from one_embedding import host_sync
from one_embedding import options as opt_mod
from one_embedding.cache.device import DeviceCache, DeviceFullStore, DeviceHashIndex, group_by_set
from one_embedding.cache.set_associative import SetAssociativeCache
from one_embedding.errors import CapacityError, ConfigError, InputError
from one_embedding.initializers import fill_initial_values, initial_values
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import codec_ops, device_init, device_ops, device_unique, reference
from one_embedding.optim import SGD, Adam
from one_embedding.parallel import codec
from one_embedding.parallel.unique import segment_sum, unique_ids
from one_embedding.store.memory import MemoryStore
from one_embedding.tiers import HashIndex

import helpers
from helpers import TierProbe

ROOT = helpers.ROOT

# every test here that runs kernels also runs in the emulator's stress mode (tests/conftest.py)
pytestmark = pytest.mark.stress_seeds




@pytest.fixture
def launch32(emulation_lib, emulation_seed):
    """One warp per block: many blocks, one set / key / row per warp and round."""
    return EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES, block=32, seed=emulation_seed)


def _ulps(a, b):
    """Distance in float32 units in the last place, elementwise."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def _keys(rng, n, universe=None):
    """(n,) uint64 distinct keys in random order, drawn from the whole range or a universe."""
    if universe is None:
        keys = np.unique(rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False))
    else:
        keys = np.unique(universe[rng.integers(0, universe.size, size=n)])
    rng.shuffle(keys)
    return keys


# ---------------------------------------------------------------- the "full" hash index


@pytest.mark.parametrize("block", [32, 256])
def test_device_hash_index_assigns_the_cpu_slots(launch, launch32, block):
    launcher = launch if block == 256 else launch32
    rng = np.random.default_rng(1)
    dev, cpu = DeviceHashIndex(0, launch=launcher), HashIndex(0)
    universe = np.concatenate([np.array([0, 1, 2**63, 2**64 - 1], np.uint64),
                               rng.integers(0, 2**64, 3000, dtype=np.uint64, endpoint=False)])
    for size in [0, 1, 5, 40, 300, 900, 1]:       # grows 16 -> 4096 buckets on the way
        keys = _keys(rng, size, universe)
        slots, is_new = dev.find_or_insert(keys)
        want_slots, want_new = cpu.find_or_insert(keys)
        np.testing.assert_array_equal(slots, want_slots)
        np.testing.assert_array_equal(is_new, want_new)
        assert len(dev) == len(cpu) and dev.slot_limit == cpu.slot_limit
        probe = _keys(rng, 200, np.concatenate([universe, rng.integers(0, 2**64, 50, np.uint64)]))
        np.testing.assert_array_equal(dev.find(probe), cpu.find(probe))
    assert dev.capacity > 1024
    keys, slots = dev.items()
    want_keys, want_slots = cpu.items()
    assert dict(zip(keys.tolist(), slots.tolist())) == dict(zip(want_keys.tolist(), want_slots.tolist()))


def _hold_copies_back(launch, monkeypatch):
    """Events that never complete: every asynchronous copy back is still in flight."""
    monkeypatch.setattr(launch, "record", lambda: object())
    monkeypatch.setattr(launch, "done", lambda event: event is None)


@pytest.mark.parametrize("copies", ["landed", "in flight"])
def test_distinct_inserts_keep_their_counts_on_the_device(launch, copies, monkeypatch):
    """find_or_insert(distinct=True) (the device store's put) hands out the CPU's slots without
    reading the new keys' count back: the counts stay on the device and are read only when a
    host upper bound of them could pass the table's load limit (or when asked: len, slot_limit).
    The bound counts every key offered as new, and comes down to the true count, without a wait,
    once the asynchronous copy of the counts queued after an insert has landed: with copies
    that land at once no read is needed; with copies still in flight the bound only grows."""
    from one_embedding import host_sync

    if copies == "in flight":
        _hold_copies_back(launch, monkeypatch)
    rng = np.random.default_rng(11)
    dev, cpu = DeviceHashIndex(2000, launch=launch), HashIndex(0)
    limit = dev.capacity * 0.7                     # 4096 buckets: 2867 keys
    universe = rng.integers(0, 2**64, 1500, dtype=np.uint64, endpoint=False)
    reads_per_call, expected, bound = [], [], 0
    for size in [300, 300, 200, 900, 900, 900, 900]:
        keys = rng.permutation(np.unique(rng.choice(universe, size)))
        if copies == "landed":
            bound = len(cpu)
        if bound + keys.size > limit:
            expected.append(1)
            bound = len(cpu) + keys.size
        else:
            expected.append(0)
            bound += keys.size
        with host_sync.counting() as reads:
            slots, is_new = dev.find_or_insert(keys, distinct=True)
        reads_per_call.append(reads.total)
        want_slots, want_new = cpu.find_or_insert(keys)
        np.testing.assert_array_equal(slots, want_slots)
        np.testing.assert_array_equal(is_new, want_new)
        assert dev.slot_bound >= len(cpu)
    assert reads_per_call == expected, reads_per_call
    if copies == "landed":
        assert sum(expected) == 0
    else:
        assert 0 < sum(expected) < len(expected)
    assert dev.capacity == 4096  # the true count never needed a larger table
    assert len(dev) == len(cpu) and dev.slot_limit == cpu.slot_limit
    np.testing.assert_array_equal(dev.find(universe), cpu.find(universe))


def test_device_hash_index_concurrent_inserts_into_one_probe_chain(launch):
    # keys sharing a home bucket race for the same run of buckets (the fibers interleave at every
    # atomicCAS); however they land, each key must be found with its own slot
    from one_embedding.hashing import mix64

    rng = np.random.default_rng(2)
    dev = DeviceHashIndex(2000, launch=launch)
    mask = np.uint64(dev.capacity - 1)
    pool = rng.integers(0, 2**64, 200_000, dtype=np.uint64, endpoint=False)
    homes = mix64(np, pool) & mask
    same_home = pool[homes == homes[0]][:12]
    keys = np.concatenate([same_home, _keys(rng, 600)])
    slots, is_new = dev.find_or_insert(keys)
    assert is_new.all() and slots.tolist() == list(range(keys.size))
    np.testing.assert_array_equal(dev.find(keys), np.arange(keys.size))
    assert len(set(dev.items()[0].tolist())) == keys.size


def test_device_hash_index_assign_overwrites_and_inserts(launch):
    rng = np.random.default_rng(3)
    dev, cpu = DeviceHashIndex(0, launch=launch), HashIndex(0)
    for _ in range(3):
        keys = _keys(rng, 70, np.arange(150, dtype=np.uint64) * np.uint64(2**40))
        slots = rng.integers(0, 10_000, keys.size).astype(np.int64)
        dev.assign(keys, slots)
        cpu.assign(keys, slots)
        assert len(dev) == len(cpu) and dev.slot_limit == cpu.slot_limit
        probe = np.arange(160, dtype=np.uint64) * np.uint64(2**40)
        np.testing.assert_array_equal(dev.find(probe), cpu.find(probe))
    dev.clear()
    assert len(dev) == 0 and (dev.find(probe) == -1).all()


def test_device_full_store_matches_memory_store(launch, tmp_path):
    rng = np.random.default_rng(4)
    line = 6
    dev, cpu = DeviceFullStore(line, capacity=64, launch=launch), MemoryStore(line, capacity=64)
    universe = rng.integers(0, 2**64, 500, dtype=np.uint64, endpoint=False)
    with pytest.warns(RuntimeWarning, match="exceed capacity"):
        for step in range(8):
            keys = _keys(rng, [0, 30, 90, 7, 120, 1, 60, 200][step], universe)
            lines = rng.standard_normal((keys.size, line)).astype(np.float32)
            ev = dev.insert_or_assign(keys, lines)
            assert ev[0].shape == (0,) and ev[1].shape == (0, line)
            cpu.insert_or_assign(keys, lines)
            probe = _keys(rng, 150, universe)
            out_dev = np.full((probe.size + 3, line), 7.0, np.float32)
            out_cpu = out_dev.copy()
            out_rows = rng.permutation(probe.size + 3)[: probe.size].astype(np.int64)
            np.testing.assert_array_equal(dev.find(probe, out_dev, out_rows),
                                          cpu.find(probe, out_cpu, out_rows))
            np.testing.assert_array_equal(out_dev, out_cpu)
            assert len(dev) == len(cpu)
            if step in (3, 6):  # erased keys leave both; later keys reuse the room
                gone = probe[:40]
                assert dev.erase(gone) == cpu.erase(gone) > 0
                assert len(dev) == len(cpu)
    for (k1, l1), (k2, l2) in zip(dev.export_batches(50), cpu.export_batches(50), strict=True):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(l1, l2)
    # a snapshot of either loads into the other
    dev.save_snapshot(str(tmp_path))
    back = MemoryStore(line)
    back.load_snapshot(str(tmp_path))
    again = DeviceFullStore(line, launch=launch)
    again.load_snapshot(str(tmp_path))
    for store in (back, again):
        out = np.zeros((universe.size, line), np.float32)
        want = np.zeros_like(out)
        np.testing.assert_array_equal(store.find(universe, out, np.arange(universe.size)),
                                      cpu.find(universe, want, np.arange(universe.size)))
        np.testing.assert_array_equal(out, want)


def test_device_full_store_takes_fixed_capacity_batches_as_the_memory_store_their_live_keys(
        launch):
    """Fixed-capacity batches (``device_unique.unique_ids_fixed``: n entries, the count on the
    device) into a small store that must grow its index and rows many times: the same slots,
    finds, size and export as a MemoryStore given each batch's live keys alone. The host's slot
    bound grows by the capacity, never below the true count, and the reads that bring the true
    size back happen only where it reaches the capacity of the index or the rows."""
    from one_embedding import host_sync
    from one_embedding.kernels import device_unique

    rng = np.random.default_rng(5)
    line = 5
    dev, cpu = DeviceFullStore(line, capacity=8, launch=launch), MemoryStore(line, capacity=8)
    universe = rng.integers(0, 2**64, 400, dtype=np.uint64, endpoint=False)
    universe[:3] = [0, 1, 2**64 - 1]                      # key 0, the placeholders' key, too
    reads = []
    with pytest.warns(RuntimeWarning, match="exceed capacity"):
        for step in range(12):
            ids = universe[rng.integers(0, 40 + 30 * step, 60)]
            fixed = device_unique.unique_ids_fixed(ids, launch=launch)
            u = int(fixed.count[0])
            lines = rng.standard_normal((ids.size, line)).astype(np.float32)
            with host_sync.counting() as counted:
                dev.insert_or_assign(fixed.keys, lines, fixed.count)
                out = np.full((ids.size, line), 7.0, np.float32)
                found = dev.find_found(fixed.keys, out, fixed.count)
            reads.append(counted.total)
            cpu.insert_or_assign(fixed.keys[:u], lines[:u])
            assert dev._index.slot_bound >= len(cpu)      # an upper bound, known without a read
            assert found.all()
            np.testing.assert_array_equal(out[:u], lines[:u])
            assert (out[u:] == 7.0).all()
    assert 0 < sum(reads) < len(reads)        # the true size read back now and then, not always
    assert len(dev) == len(cpu)
    for (k1, l1), (k2, l2) in zip(dev.export_batches(64), cpu.export_batches(64), strict=True):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(l1, l2)


# ---------------------------------------------------------------- the set-associative cache


def _compare_caches(dev, cpu, rng, universe, steps, max_batch, line):
    evictions = hits = 0
    for step in range(steps):
        # Zipf-skewed draws (frequencies differ, so LRU and LFU choose differently) and uniform ones
        # (the whole universe cycles through the sets, so sets fill and evict)
        size = rng.integers(0, max_batch + 1)
        draw = np.concatenate([np.minimum(rng.zipf(1.3, size=size // 2), universe.size) - 1,
                               rng.integers(0, universe.size, size - size // 2)])
        keys = np.unique(universe[draw])
        rng.shuffle(keys)
        if step % 7 == 6:  # an eviction sweep's erase: the freed ways are reused alike
            gone = keys[: keys.size // 3]
            assert dev.erase(gone) == cpu.erase(gone)
        elif step % 3 == 1:
            out_dev = np.full((keys.size + 2, line), np.nan, np.float32)
            out_cpu = out_dev.copy()
            out_rows = rng.permutation(keys.size + 2)[: keys.size].astype(np.int64)
            missing = dev.find(keys, out_dev, out_rows)
            np.testing.assert_array_equal(missing, cpu.find(keys, out_cpu, out_rows))
            np.testing.assert_array_equal(out_dev, out_cpu)
            hits += keys.size - missing.size
        else:
            lines = rng.standard_normal((keys.size, line)).astype(np.float32)
            held = set(cpu.keys().tolist())
            ev_keys, ev_lines = dev.insert_or_assign(keys, lines)
            want_keys, want_lines = cpu.insert_or_assign(keys, lines)
            np.testing.assert_array_equal(ev_keys, want_keys)
            np.testing.assert_array_equal(ev_lines, want_lines)
            evictions += len(held - set(cpu.keys().tolist()))   # displaced, dirty or clean
        if step % 12 == 7:  # a snapshot's flush: the dirty lines go down and turn clean
            for (k1, l1), (k2, l2) in zip(dev.flush_batches(4), cpu.flush_batches(4), strict=True):
                np.testing.assert_array_equal(k1, k2)
                np.testing.assert_array_equal(l1, l2)
        assert len(dev) == len(cpu)
        np.testing.assert_array_equal(dev.keys(), cpu.keys())
    return hits, evictions


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("n_sets,ways,block", [(8, 4, 256), (3, 32, 32), (1, 7, 256), (40, 8, 32)])
def test_device_cache_matches_cpu_cache_on_random_trace(launch, launch32, policy, n_sets, ways, block):
    rng = np.random.default_rng(n_sets * 100 + ways)
    line = 3 if ways != 32 else 37       # 37: a line wider than a warp
    dev = DeviceCache(line, n_sets * ways, ways, policy, launch=launch if block == 256 else launch32)
    cpu = SetAssociativeCache(line, n_sets * ways, ways, policy)
    assert (dev.n_sets, dev.ways, dev.capacity) == (cpu.n_sets, cpu.ways, cpu.capacity)
    universe = rng.integers(0, 2**64, size=4 * n_sets * ways, dtype=np.uint64, endpoint=False)
    hits, evictions = _compare_caches(dev, cpu, rng, universe, 45, 3 * ways, line)
    assert hits > 0 and evictions > 0
    for (k1, l1), (k2, l2) in zip(dev.export_batches(5), cpu.export_batches(5), strict=True):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(l1, l2)


def test_device_cache_flush_writes_dirty_lines_and_clean_victims_leave_without_a_copy(launch):
    """A flushed line is clean: evicted, it goes nowhere (the level below has it), and the next
    flush leaves it out; a line written after the flush is dirty again. Against the CPU cache."""
    def k(*ids):
        return np.array(ids, np.uint64)

    def v(x):
        return np.full((1, 2), x, np.float32)

    dev = DeviceCache(2, 2, 2, "lru", launch=launch)        # one set of two ways
    cpu = SetAssociativeCache(2, 2, 2, "lru")
    for c in (dev, cpu):
        c.insert_or_assign(k(1, 2), np.vstack([v(1), v(2)]))
        flushed = [(keys.tolist(), lines.tolist()) for keys, lines in c.flush_batches()]
        assert flushed == [([1, 2], [[1, 1], [2, 2]])]
        assert list(c.flush_batches()) == []                  # nothing written since
        gone, _ = c.insert_or_assign(k(3), v(3))             # evicts 1, clean: no copy down
        assert gone.tolist() == [] and len(c) == 2
        c.insert_or_assign(k(2), v(20))                      # 2 dirty again
        flushed = [(keys.tolist(), lines.tolist()) for keys, lines in c.flush_batches()]
        assert flushed == [([2, 3], [[20, 20], [3, 3]])]
        c.insert_or_assign(k(4), v(4))                       # evicts 3, clean since the flush
        gone, lines = c.insert_or_assign(k(5), v(5))         # evicts 2, clean
        assert gone.tolist() == []
        c.insert_or_assign(k(4), v(40))
        gone, lines = c.insert_or_assign(k(6, 7), np.vstack([v(6), v(7)]))  # 5 dirty, 4 dirty
        assert gone.tolist() == [5, 4] and lines.tolist() == [[5, 5], [40, 40]]
        assert c.keys().tolist() == [6, 7]


def test_device_cache_flush_batch_stays_dirty_until_the_next_is_asked_for(launch):
    dev = DeviceCache(1, 4, 4, "lru", launch=launch)
    keys = np.array([4, 3, 2, 1], np.uint64)
    dev.insert_or_assign(keys, np.arange(4, dtype=np.float32)[:, None])
    batches = dev.flush_batches(2)
    first, _ = next(batches)
    assert first.tolist() == [1, 2]
    batches.close()                     # the writer failed on the first batch: it stays dirty
    assert [b.tolist() for b, _ in dev.flush_batches(2)] == [[1, 2], [3, 4]]
    assert list(dev.flush_batches(2)) == []


def test_device_cache_lru_and_lfu_pick_different_victims(launch):
    for policy, victim in (("lru", 1), ("lfu", 2)):
        c = DeviceCache(1, 2, 2, policy, launch=launch)
        one = np.ones((1, 1), np.float32)
        out = np.empty((1, 1), np.float32)
        c.insert_or_assign(np.array([1], np.uint64), one)
        c.find(np.array([1], np.uint64), out, np.zeros(1, np.int64))
        c.find(np.array([1], np.uint64), out, np.zeros(1, np.int64))
        c.insert_or_assign(np.array([2], np.uint64), one)
        ev, _ = c.insert_or_assign(np.array([3], np.uint64), one)
        assert ev.tolist() == [victim], policy


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_device_cache_batch_bigger_than_cache_spills_like_the_cpu(launch, policy):
    dev = TierProbe(DeviceCache(2, 8, ways=4, policy=policy, launch=launch))
    cpu = TierProbe(SetAssociativeCache(2, 8, ways=4, policy=policy))
    keys = np.arange(100, 150, dtype=np.uint64)
    lines = np.stack([keys.astype(np.float32), -keys.astype(np.float32)], axis=1)
    for round_ in range(2):     # the second time, residents are evicted with their old lines too
        ev_keys, ev_lines = dev.insert_or_assign(keys, lines)
        want_keys, want_lines = cpu.insert_or_assign(keys, lines)
        np.testing.assert_array_equal(ev_keys, want_keys)
        np.testing.assert_array_equal(ev_lines, want_lines)
        assert len(dev) == 8 and np.unique(ev_keys).size == ev_keys.size
        if round_ == 0:         # every key is either still cached or went down once, with its line
            assert sorted(ev_keys.tolist() + dev.keys().tolist()) == keys.tolist()
            np.testing.assert_array_equal(ev_lines[:, 0], ev_keys.astype(np.float32))
        lines = lines + 1000


def test_device_cache_key_evicted_twice_in_one_batch_goes_down_once_with_its_new_line(launch):
    c = DeviceCache(1, 1, ways=1, launch=launch)   # one way: every new key evicts the previous one
    c.insert_or_assign(np.array([5], np.uint64), np.array([[1.0]], np.float32))
    ev_keys, ev_lines = c.insert_or_assign(np.array([8, 5, 9], np.uint64),
                                           np.array([[2.0], [3.0], [4.0]], np.float32))
    # 8 evicts 5 (old line 1.0), 5 evicts 8, 9 evicts 5 (new line 3.0)
    assert ev_keys.tolist() == [8, 5] and ev_lines[:, 0].tolist() == [2.0, 3.0]
    assert c.keys().tolist() == [9] and len(c) == 1


def test_device_cache_evicted_twice_in_a_crowded_set(launch32):
    # one set of 4 ways full of old keys; a batch that brings in, pushes out and brings back keys
    # of the same set, with keys of other sets interleaved in the batch
    rng = np.random.default_rng(6)
    for policy in ("lru", "lfu"):
        dev = DeviceCache(2, 4 * 5, ways=4, policy=policy, launch=launch32)
        cpu = SetAssociativeCache(2, 4 * 5, ways=4, policy=policy)
        universe = rng.integers(0, 2**64, 60, dtype=np.uint64, endpoint=False)
        for _ in range(12):
            keys = _keys(rng, 40, universe)
            lines = rng.standard_normal((keys.size, 2)).astype(np.float32)
            ev1, l1 = dev.insert_or_assign(keys, lines)
            ev2, l2 = cpu.insert_or_assign(keys, lines)
            np.testing.assert_array_equal(ev1, ev2)
            np.testing.assert_array_equal(l1, l2)
            assert np.unique(ev1).size == ev1.size
        assert len(dev) == len(cpu) == 20


def test_device_cache_find_with_duplicate_keys_touches_each_occurrence(launch32):
    # find's keys need not be unique: every occurrence hits (and stamps) in batch order, as on CPU
    rng = np.random.default_rng(16)
    for policy in ("lru", "lfu"):
        dev = DeviceCache(3, 12, 4, policy, launch=launch32)
        cpu = SetAssociativeCache(3, 12, 4, policy)
        universe = rng.integers(0, 2**64, 30, dtype=np.uint64, endpoint=False)
        for _ in range(15):
            keys = _keys(rng, 12, universe)
            lines = rng.standard_normal((keys.size, 3)).astype(np.float32)
            np.testing.assert_array_equal(dev.insert_or_assign(keys, lines)[0],
                                          cpu.insert_or_assign(keys, lines)[0])
            probe = universe[rng.integers(0, universe.size, 25)]          # with repeats
            out_dev = np.zeros((25, 3), np.float32)
            out_cpu = out_dev.copy()
            np.testing.assert_array_equal(dev.find(probe, out_dev, np.arange(25)),
                                          cpu.find(probe, out_cpu, np.arange(25)))
            np.testing.assert_array_equal(out_dev, out_cpu)


def test_device_cache_find_never_fills_and_refreshes_recency(launch):
    c = DeviceCache(1, 2, 2, launch=launch)
    one = np.ones((2, 1), np.float32)
    out = np.empty((2, 1), np.float32)
    missing = c.find(np.array([5, 6], np.uint64), out, np.arange(2))
    assert missing.tolist() == [0, 1] and len(c) == 0
    c.insert_or_assign(np.array([5, 6], np.uint64), one)
    c.find(np.array([5], np.uint64), out, np.zeros(1, np.int64))   # 6 is now the least recent
    ev, _ = c.insert_or_assign(np.array([7], np.uint64), one[:1])
    assert ev.tolist() == [6]


def test_device_cache_empty_batches_clear_and_refill(launch):
    rng = np.random.default_rng(7)
    dev, cpu = DeviceCache(4, 24, 8, launch=launch), SetAssociativeCache(4, 24, 8)
    empty = np.empty(0, np.uint64)
    assert dev.find(empty, np.empty((0, 4), np.float32), np.empty(0, np.int64)).shape == (0,)
    ev_keys, ev_lines = dev.insert_or_assign(empty, np.empty((0, 4), np.float32))
    assert ev_keys.shape == (0,) and ev_lines.shape == (0, 4)
    universe = rng.integers(0, 2**64, 80, dtype=np.uint64, endpoint=False)
    _compare_caches(dev, cpu, rng, universe, 10, 20, 4)
    dev.clear()
    cpu.clear()
    assert len(dev) == 0 and dev.keys().size == 0
    _compare_caches(dev, cpu, rng, universe, 10, 20, 4)


def test_device_cache_geometry_and_errors(launch):
    c = DeviceCache(3, 5, ways=32, launch=launch)           # fewer rows than ways: one set of 5
    assert (c.n_sets, c.ways, c.capacity) == (1, 5, 5)
    c = DeviceCache(3, 100, ways=32, launch=launch)         # rounded down to whole sets
    assert (c.n_sets, c.ways, c.capacity) == (3, 32, 96)
    with pytest.raises(CapacityError):
        DeviceCache(3, 0, launch=launch)
    with pytest.raises(ConfigError, match="1 to 32 ways"):
        DeviceCache(3, 100, ways=64, launch=launch)
    with pytest.raises(ConfigError):
        DeviceCache(3, 100, policy="fifo", launch=launch)
    options = opt_mod.CacheOptions(policy="lfu", location="device", budget_mb=1, ways=16)
    c = DeviceCache.from_options(options, 64, "device.lfu", launch=launch)
    assert (c.policy, c.ways, c.capacity) == ("lfu", 16, options.rows(64) // 16 * 16)
    with pytest.raises(InputError):
        c.find(np.zeros(2, np.uint64), np.zeros((2, 63), np.float32), np.arange(2))
    with pytest.raises(InputError):    # out is written in place: no silent copy
        c.find(np.zeros(2, np.uint64), np.zeros((2, 64), np.float64), np.arange(2))


def test_group_by_set_is_stable_within_each_set():
    """The real groups first (one per set the batch touches, in set order), then empty ones up
    to n groups: their number is never read back to the host."""
    from one_embedding.hashing import mix64

    rng = np.random.default_rng(8)
    keys = _keys(rng, 500)
    for n_sets in (1, 7, 1000):
        with host_sync.counting() as reads:
            order, starts, set_ids = group_by_set(np, keys, n_sets)
        assert reads.total == 0
        sets = (mix64(np, keys) % np.uint64(n_sets)).astype(np.int64)
        np.testing.assert_array_equal(order, np.argsort(sets, kind="stable"))
        g = np.unique(sets).size
        assert starts.shape == (keys.size + 1,) and set_ids.shape == (keys.size,)
        assert starts[0] == 0 and (np.diff(starts[:g + 1]) > 0).all()
        assert (starts[g:] == keys.size).all()
        np.testing.assert_array_equal(set_ids[:g], np.unique(sets))
        for k in range(g):
            assert (sets[order[starts[k]:starts[k + 1]]] == set_ids[k]).all()


# ---------------------------------------------------------------- unique, segment sums, gathers


@pytest.mark.parametrize("case", ["empty", "one", "all_same", "distinct", "zipf", "extremes"])
def test_unique_ids_equal_the_cpu_unique(launch, case):
    rng = np.random.default_rng(9)
    keys = {"empty": np.empty(0, np.uint64), "one": np.array([42], np.uint64),
            "all_same": np.full(700, 2**64 - 1, np.uint64),
            "distinct": rng.permutation(3000).astype(np.uint64),
            "zipf": rng.zipf(1.2, 5000).astype(np.uint64),
            "extremes": np.array([0, 2**64 - 1, 0, 2**63, 1, 2**64 - 1, 2**63 - 1], np.uint64)}[case]
    got_unique, got_inverse = device_unique.unique_ids(keys, launch=launch)
    want_unique, want_inverse = unique_ids(keys)
    np.testing.assert_array_equal(got_unique, want_unique)
    np.testing.assert_array_equal(got_inverse, want_inverse)
    assert got_unique.dtype == np.uint64 and got_inverse.dtype == np.int64


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segment_sum_is_the_cpu_sum_bit_for_bit(launch, dtype):
    rng = np.random.default_rng(10)
    for n, dim, n_keys in [(0, 4, 3), (1, 1, 1), (900, 16, 40), (300, 33, 300), (50, 0, 10)]:
        # a wide dynamic range makes every change of summation order visible in the bits
        values = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-6, 7, (n, dim))).astype(dtype)
        if n > 2:
            values[0, :] = -0.0
            values[1, :1] = np.inf
        ids = rng.zipf(1.3, n).astype(np.uint64) % np.uint64(n_keys)
        uniq, inverse = unique_ids(ids)
        got = device_unique.segment_sum(values, inverse, uniq.size, launch=launch)
        want = segment_sum(values, inverse, uniq.size)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(InputError):
        device_unique.segment_sum(np.ones((3, 2), np.float32), np.array([0, 1, 5]), 2, launch=launch)


def test_gather_rows_equal_the_reference(launch):
    rng = np.random.default_rng(11)
    src = rng.standard_normal((50, 37)).astype(np.float32)
    for index in [np.empty(0, np.int64), np.array([3]), rng.integers(-1, 50, (64, 26)),
                  np.full((4, 2), -1)]:
        got = device_ops.gather_rows(src, index, launch=launch)
        np.testing.assert_array_equal(got, reference.gather_rows(src, index))
        assert got.shape == np.shape(index) + (37,)
    empty_src = np.empty((0, 5), np.float64)
    np.testing.assert_array_equal(device_ops.gather_rows(empty_src, np.array([-1, -1]), launch=launch),
                                  np.zeros((2, 5)))
    with pytest.raises(InputError):
        device_ops.gather_rows(src, np.array([50]), launch=launch)


# ---------------------------------------------------------------- initial values


INITIALIZERS = [opt_mod.ConstantInitializer(0.25), opt_mod.UniformInitializer(-0.05, 0.05),
                opt_mod.NormalInitializer(0.1, 2.0), opt_mod.TruncNormalInitializer(0.0, 1.0, -0.5, 1.5),
                opt_mod.TruncNormalInitializer(3.0, 0.01, -0.1, 0.1)]     # last: always clipped


@pytest.mark.parametrize("init", INITIALIZERS, ids=lambda i: type(i).__name__)
def test_initial_values_equal_the_cpu_initializer(launch, init):
    rng = np.random.default_rng(12)
    keys = np.concatenate([np.array([0, 2**64 - 1], np.uint64), _keys(rng, 300)])
    seed, col_start, n_cols, offset, width = 2**63 + 7, 5, 19, 3, 26
    lines = np.full((keys.size + 4, width), 9.0, np.float32)
    rows = rng.permutation(keys.size + 4)[: keys.size].astype(np.int64)
    want = lines.copy()
    device_init.fill_initial_values(lines, rows, keys, init, seed, col_start, n_cols, offset, launch=launch)
    fill_initial_values(want, rows, keys, init, seed, col_start, n_cols, offset)
    columns = np.arange(col_start, col_start + n_cols, dtype=np.uint64)
    numpy_values = initial_values(np, init, seed, keys, columns)
    got = lines[rows, offset:offset + n_cols]
    # the hash is exact; float64 libm results may differ in the last ulp, rarely visible in float32
    assert _ulps(got, numpy_values).max() <= 1
    assert _ulps(got, want[rows, offset:offset + n_cols]).max() <= 1
    assert (_ulps(got, numpy_values) > 0).mean() < 0.01
    untouched = np.ones(lines.shape, bool)
    untouched[rows[:, None], np.arange(offset, offset + n_cols)[None, :]] = False
    assert (lines[untouched] == 9.0).all()
    if isinstance(init, opt_mod.TruncNormalInitializer):
        assert got.min() >= np.float32(init.a) and got.max() <= np.float32(init.b)


def test_initial_values_argument_checks(launch):
    lines = np.zeros((4, 8), np.float32)
    init = INITIALIZERS[1]
    with pytest.raises(InputError):      # columns past the line
        device_init.fill_initial_values(lines, np.arange(2), np.arange(2, dtype=np.uint64), init, 0, 0, 6, 3,
                                       launch=launch)
    with pytest.raises(InputError):      # a row past the buffer
        device_init.fill_initial_values(lines, np.array([0, 4]), np.arange(2, dtype=np.uint64), init,
                                       0, 0, 2, 0, launch=launch)
    with pytest.raises(InputError):      # written in place: must already be float32
        device_init.fill_initial_values(lines.astype(np.float64), np.arange(2), np.arange(2, dtype=np.uint64),
                                       init, 0, 0, 2, 0, launch=launch)
    device_init.fill_initial_values(lines, np.empty(0, np.int64), np.empty(0, np.uint64), init, 0, 0, 8, 0,
                                   launch=launch)
    assert not lines.any()


# ---------------------------------------------------------------- fused optimizer updates




@pytest.mark.parametrize("name", list(helpers.row_optimizer_cases()))
def test_fused_optimizer_update_is_the_cpu_update_bit_for_bit(launch, name):
    make = helpers.row_optimizer_cases()[name]
    gpu_opt, cpu_opt = make(), make()
    rng = np.random.default_rng(len(name))
    n, dim = 300, 13
    width = (1 + gpu_opt.n_states) * dim + 5           # storage wider than the optimizer needs
    lines = rng.standard_normal((n, width)).astype(np.float32)
    lines[:, dim:] = np.abs(lines[:, dim:])             # accumulators are non-negative
    want = lines.copy()
    for step in range(1, 5):
        grads = rng.standard_normal((n, dim)).astype(np.float32)
        grads[:3] = 0.0
        if step == 3:
            gpu_opt.grad_scale = cpu_opt.grad_scale = 0.5
        device_ops.update_lines(gpu_opt, lines, grads, step, launch=launch)
        states = [want[:, (k + 1) * dim:(k + 2) * dim] for k in range(cpu_opt.n_states)]
        cpu_opt.update(want[:, :dim], states, grads, step)
        if name == "ftrl_power":       # pow: host libm on both sides here; on a GPU within 1 ulp
            assert _ulps(lines, want).max() <= 1
        else:
            np.testing.assert_array_equal(lines.view(np.int32), want.view(np.int32))


def test_fused_optimizer_argument_checks(launch):
    opt = Adam(lr=0.01)
    lines = np.zeros((4, 8), np.float32)
    with pytest.raises(InputError):          # Adam needs 3 blocks of dim 4 = 12 floats
        device_ops.update_lines(opt, lines, np.zeros((4, 4), np.float32), 1, launch=launch)
    with pytest.raises(InputError):          # step counts from 1
        device_ops.update_lines(SGD(lr=0.1), lines, np.zeros((4, 4), np.float32), 0, launch=launch)
    with pytest.raises(InputError):          # a strided view would take the writes in a copy
        device_ops.update_lines(SGD(lr=0.1), np.zeros((4, 16), np.float32)[:, :8],
                                np.zeros((4, 4), np.float32), 1, launch=launch)
    device_ops.update_lines(SGD(lr=0.1), np.zeros((0, 8), np.float32), np.zeros((0, 4), np.float32), 1,
                            launch=launch)


# ---------------------------------------------------------------- row codecs


def _codec_rows(rng, dtype=np.float32):
    rows = [rng.standard_normal((40, 37)).astype(dtype),
            np.zeros((3, 37), dtype),                                   # f = 0
            (rng.standard_normal((5, 37)) * 1e-30).astype(dtype)]       # tiny but normal
    ties = np.zeros((1, 37), dtype)                                     # x * 127 / f on .5 exactly
    ties[0, 0] = 127.0
    ties[0, 1:12] = np.arange(0.5, 11.5)
    ties[0, 12:23] = -np.arange(0.5, 11.5)
    rows.append(ties)
    big = np.zeros((3, 37), dtype)          # f above BIG_SCALE: x * 127 and q * f would overflow
    big[0, :4] = [2.7e36, 1.3e36, -1e35, 1.0]
    big[1, :4] = [1e37, 5e36, -1e36, 1.0]
    big[2, :4] = [3.4028235e38, -3.4028235e38, 1.7e38, 1.0]
    rows.append(big)
    near = np.zeros((1, 37), dtype)         # s = 0.49999997: rounds to 0, not 1
    near[0, :2] = [127.0, np.nextafter(np.float32(0.5), np.float32(0))]
    rows.append(near)
    return np.concatenate(rows)


@pytest.mark.parametrize("exchange", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_codec_equals_codec_py_byte_for_byte(launch, exchange, dtype):
    rng = np.random.default_rng(13)
    for rows in [_codec_rows(rng, dtype), np.zeros((0, 8), dtype), np.zeros((4, 0), dtype),
                 rng.standard_normal((1, 1)).astype(dtype)]:
        payload = codec_ops.encode(rows, exchange, launch=launch)
        want = codec.encode(rows, exchange)
        assert payload.shape == want.shape and payload.dtype == np.uint8
        np.testing.assert_array_equal(payload, want)
        decoded = codec_ops.decode(payload, exchange, rows.shape[1], launch=launch)
        want_rows = codec.decode(want, exchange, rows.shape[1])
        assert decoded.dtype == np.float32
        np.testing.assert_array_equal(decoded.view(np.int32), want_rows.view(np.int32))


def test_fp16_codec_rounds_every_float32_class_as_numpy(launch):
    # normal, subnormal-half and overflow ranges, exact ties, infinities, signed zeros and NaN
    rng = np.random.default_rng(14)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    near = (np.float32(2.0) ** rng.integers(-26, 17, 20000)).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 1e-8, 2**-24, 2**-25,
                        3 * 2**-26, 2**-14, 2**-14 - 2**-25, 1 + 2**-11, 1 + 3 * 2**-11, -65520],
                       np.float32)
    values = np.concatenate([bits.view(np.float32), near * rng.uniform(1, 2, near.size).astype(np.float32),
                             special]).reshape(-1, 8)
    values = values[~np.isnan(values).any(axis=1)]      # NaN payload bits are not specified
    payload = codec_ops.encode(values, "fp16", launch=launch)
    with np.errstate(over="ignore"):                    # overflow to inf is the point
        np.testing.assert_array_equal(payload, codec.encode(values, "fp16"))
    back = codec_ops.decode(payload, "fp16", 8, launch=launch)
    np.testing.assert_array_equal(back.view(np.int32), codec.decode(payload, "fp16", 8).view(np.int32))
    nan = codec_ops.encode(np.full((1, 2), np.nan, np.float32), "fp16", launch=launch)
    assert np.isnan(codec_ops.decode(nan, "fp16", 2, launch=launch)).all()


def test_codec_argument_checks(launch):
    with pytest.raises(ConfigError):
        codec_ops.encode(np.zeros((2, 2), np.float32), "bf16", launch=launch)
    with pytest.raises(InputError):
        codec_ops.decode(np.zeros((2, 7), np.uint8), "int8", 4, launch=launch)


# ---------------------------------------------------------------- the glue launches what exists


def _glue_launches():
    """{(family, name)} of every launch_threads / launch_warps call of an embedding family's
    kernel anywhere in the package's Python (no hand-kept list of the glue's modules)."""
    found = set()
    for path in sorted(helpers.PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "launch_threads", "launch_warps") and len(node.args) >= 3:
                family, name = node.args[1], node.args[2]
                if isinstance(family, ast.Constant) and isinstance(name, ast.Constant):
                    if family.value in cm.EMBEDDING_FAMILIES:
                        found.add((family.value, name.value))
                elif isinstance(family, ast.Constant) and family.value == "optim":
                    # update_lines names its kernel by optimizer
                    found.update(("optim", k[len("optim_"):]) for k in cm.kernel_names("optim"))
    return found


def test_every_embedding_kernel_has_a_launch_in_the_glue():
    kernels = {(family, name[len(family) + 1:]) for family in cm.EMBEDDING_FAMILIES
               for name in cm.kernel_names(family)}
    assert _glue_launches() == kernels


def test_optimizer_kernel_names_exist():
    for make in helpers.row_optimizer_cases().values():
        opt = make()
        name, scalars = device_ops.optimizer_kernel(opt, opt.lr, 1)
        assert f"optim_{name}" in cm.kernel_names("optim")


# ---------------------------------------------------------------- the emulator catches divergence

_DIVERGENT = r"""
#include "host_emulation.cuh"
// lane 3 leaves before the warp's ballot
template <typename T> __global__ void probe_skip_ballot(int* out) {
  if (threadIdx.x != 3) out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
}
// half a warp in a ballot, the other half in a shuffle
template <typename T> __global__ void probe_mixed(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
  else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}
// threads 40.. skip the block barrier
template <typename T> __global__ void probe_skip_sync(int* out) {
  if (threadIdx.x < 40) __syncthreads();
  out[threadIdx.x] = 1;
}
// converged: every lane counts the odd lanes of its warp, then the block meets
template <typename T> __global__ void probe_ok(int* out) {
  out[threadIdx.x] = __popc(__ballot_sync(0xffffffffu, threadIdx.x & 1));
  __syncthreads();
}
ONE_EMBEDDING_KERNEL(probe_skip_ballot)
ONE_EMBEDDING_KERNEL(probe_mixed)
ONE_EMBEDDING_KERNEL(probe_skip_sync)
ONE_EMBEDDING_KERNEL(probe_ok)
"""


def test_emulator_reports_divergent_barriers_instead_of_hanging(tmp_path):
    import ctypes
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    src = tmp_path / "divergent.cpp"
    src.write_text(_DIVERGENT)
    lib_path = tmp_path / "divergent.so"
    # hidden visibility, as every emulation build: its kernel registry stays its own
    subprocess.run(["g++", "-std=c++17", "-O0", "-shared", "-fPIC", "-fvisibility=hidden",
                    "-fvisibility-inlines-hidden", "-fno-gnu-unique", "-I", str(cm.CUDA_DIR),
                    str(src), "-o", str(lib_path)], check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(lib_path))
    lib.oe_emulate_launch.restype = ctypes.c_int
    out = np.zeros(64, np.int32)

    def run(name):
        pointer = ctypes.c_void_p(out.ctypes.data)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))
        error = ctypes.create_string_buffer(256)
        status = lib.oe_emulate_launch(f"{name}<float>".encode(), 1, 1, 64, 1, args, error, 256)
        return status, error.value.decode()

    assert run("probe_ok") == (0, "")
    np.testing.assert_array_equal(out, 16)
    for name, message in [("probe_skip_ballot", "not every thread reached __ballot_sync"),
                          ("probe_mixed", "different warp primitives"),
                          ("probe_skip_sync", "not every thread reached __syncthreads")]:
        status, error = run(name)
        assert status == 1 and message in error, (name, error)


def test_fixed_capacity_batches_near_the_capacity_read_nothing_in_a_steady_state(launch,
                                                                                 monkeypatch):
    """A training run's steady state on device_mem: batches of n ids (their unique keys in a
    fixed-capacity array of n) over a key space already stored, near the store's capacity hint
    (n is a third of it). The host bound grows by n per batch; the asynchronous copy of the
    counts, landing one batch late here, brings it back down, and the read that first finds the
    rows short makes room for HEADROOM_BATCHES more batches. So one read in all, and none in
    the second half (before: one read per batch once the bound passed the rows), and every
    line is the one last put."""
    from one_embedding import host_sync
    from one_embedding.cache.device import HEADROOM_BATCHES
    from one_embedding.kernels import device_unique

    recorded, landed = [], set()
    monkeypatch.setattr(launch, "record", lambda: recorded.append(object()) or recorded[-1])
    monkeypatch.setattr(launch, "done", lambda event: event is None or id(event) in landed)
    rng = np.random.default_rng(3)
    line, keys_held, n = 4, 900, 300
    dev, cpu = DeviceFullStore(line, capacity=keys_held, launch=launch), MemoryStore(line)
    universe = rng.integers(0, 2**64, keys_held, dtype=np.uint64, endpoint=False)
    reads = []
    for step in range(12):
        ids = universe[rng.integers(0, keys_held, n)] if step else universe[:n]
        fixed = device_unique.unique_ids_fixed(ids, launch=launch)
        u = int(fixed.count[0])
        lines = rng.standard_normal((n, line)).astype(np.float32)
        landed.update(id(e) for e in recorded)       # the copies of the batch before have landed
        with host_sync.counting() as counted:
            dev.insert_or_assign(fixed.keys, lines, fixed.count)
        reads.append(counted.total)
        cpu.insert_or_assign(fixed.keys[:u], lines[:u])
        assert dev._index.slot_bound >= len(cpu)
    assert sum(reads) <= 1 and sum(reads[6:]) == 0, reads   # the one read that made the room
    assert dev._rows.shape[0] <= len(cpu) + (HEADROOM_BATCHES + 1) * n
    out = np.zeros((universe.size, line), np.float32)
    want = np.zeros_like(out)
    found = dev.find_found(universe, out)
    missing = cpu.find(universe, want, np.arange(universe.size))
    assert not found[missing].any() and found.sum() == universe.size - missing.size == len(cpu)
    np.testing.assert_array_equal(out[found], want[found])


def test_a_read_while_the_counts_copy_is_in_flight_keeps_its_buffer_and_ignores_it(launch,
                                                                                  monkeypatch):
    """The asynchronous copy of the counts lands in a page-locked buffer from CuPy's pinned
    pool, which tracks no copy: dropped while the copy was in flight (a read of the counts, a
    clear), the pool could hand the buffer to a staging copy that the landing 16 bytes would
    then overwrite. So a read or a clear keeps the copy (and its buffer) until its event has
    passed, and the stale counts it brings are not used: the bound after a clear is 0 and
    stays the true count after later inserts."""
    recorded, landed = [], set()
    monkeypatch.setattr(launch, "record", lambda: recorded.append(object()) or recorded[-1])
    monkeypatch.setattr(launch, "done", lambda event: event is None or id(event) in landed)
    rng = np.random.default_rng(8)
    dev = DeviceHashIndex(1000, launch=launch)
    keys = np.unique(rng.integers(0, 2**64, 300, dtype=np.uint64, endpoint=False))
    dev.find_or_insert(keys, distinct=True)
    in_flight = dev._mirror
    assert in_flight is not None                         # queued after the insert
    dev.clear()
    assert dev._mirror is in_flight                      # still referenced: not landed yet
    assert dev.slot_bound == 0
    landed.update(id(e) for e in recorded)               # the stale copy lands (300 keys)
    assert dev.slot_bound == 0 and dev._mirror is None   # ... and is not used
    more = keys[:10]
    dev.find_or_insert(more, distinct=True)
    landed.update(id(e) for e in recorded)
    assert dev.slot_bound == 10 == len(dev)
