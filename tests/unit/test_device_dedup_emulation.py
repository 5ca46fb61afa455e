"""The device dedup (``device_unique.unique_ids``: a hash table in device memory, no sort) on the
host emulator, in its default mode and under the stress seeds (threads interleaved at random,
several blocks racing for buckets): its results against the CPU's numba ``parallel.unique.unique_ids``
and against the sort-based device version it replaced (``unique_ids_by_sorting``), bit for bit
and in the same order; the table its kernels build; its one counted host read; its argument
checks."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding import host_sync
from one_embedding.errors import InputError
from one_embedding.hashing import mix64
from one_embedding.kernels import device_ops, device_unique
from one_embedding.parallel.unique import first_occurrence, unique_ids

pytestmark = pytest.mark.stress_seeds

EMPTY = 2**64 - 1   # the table's empty marker, itself a valid key (the side bucket's)


def _colliding_keys(count: int, capacity: int, rng) -> np.ndarray:
    """``count`` distinct keys whose home bucket is the table's last (``capacity - 1``), so their
    probes collide and wrap around to bucket 0."""
    mask = np.uint64(capacity - 1)
    found: list[int] = []
    while len(found) < count:
        candidates = rng.integers(0, 2**63, size=50_000, dtype=np.uint64)
        found += [int(k) for k in candidates[(mix64(np, candidates) & mask) == mask]]
        found = list(dict.fromkeys(k for k in found if k != EMPTY))
    return np.array(found[:count], np.uint64)


def _key_sets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(32)
    # 20 keys sharing the last home bucket, three times each, with the marker and 0: n = 64, so
    # the table has dedup_capacity(64) = 128 buckets
    collide = np.concatenate([np.repeat(_colliding_keys(20, device_unique.dedup_capacity(64), rng), 3),
                              np.array([EMPTY, 0, EMPTY, 0], np.uint64)])
    rng.shuffle(collide)
    return {
        "empty": np.empty(0, np.uint64),
        "one": np.array([42], np.uint64),
        "one_marker": np.array([EMPTY], np.uint64),
        "one_zero": np.array([0], np.uint64),
        "all_marker": np.full(700, EMPTY, np.uint64),
        "all_zero": np.zeros(700, np.uint64),
        "marker_last": np.array([3, 1, 3, 2, EMPTY], np.uint64),
        "distinct": rng.permutation(3000).astype(np.uint64) * np.uint64(2**40 + 7),
        "distinct_random": rng.integers(0, 2**64, size=2000, dtype=np.uint64, endpoint=False),
        "zipf": rng.zipf(1.2, 5000).astype(np.uint64),
        "hot_and_cold": np.concatenate([np.full(3000, 7, np.uint64), rng.permutation(1000).astype(np.uint64)])[
            rng.permutation(4000)],
        "extremes": np.array([0, EMPTY, 0, 2**63, 1, EMPTY, 2**63 - 1, EMPTY - 1, 2**63], np.uint64),
        "collide_and_wrap": collide,
    }


KEY_SETS = _key_sets()


def _check_against_the_cpu_and_the_sort(keys, launch):
    got = device_unique.unique_ids(keys, launch=launch, return_first=True)
    want_unique, want_inverse = unique_ids(keys)
    want_first = first_occurrence(want_inverse, want_unique.size)
    for a, b in zip(got, (want_unique, want_inverse, want_first), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    by_sorting = device_unique.unique_ids_by_sorting(keys, launch=launch, return_first=True)
    for a, b in zip(got, by_sorting, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    two = device_unique.unique_ids(keys, launch=launch)
    assert len(two) == 2
    np.testing.assert_array_equal(two[0], want_unique)
    np.testing.assert_array_equal(two[1], want_inverse)


@pytest.mark.parametrize("case", sorted(KEY_SETS))
def test_unique_ids_equal_the_cpu_unique_and_the_sort(launch, case):
    _check_against_the_cpu_and_the_sort(KEY_SETS[case], launch)
    assert {"embedding_dedup_insert", "embedding_dedup_output"} <= launch.launched or case == "empty"


def test_unique_ids_of_many_random_batches(launch):
    rng = np.random.default_rng(33)
    for n in (2, 3, 17, 31, 32, 33, 255, 256, 257, 1000):
        universe = max(1, int(rng.integers(1, 2 * n)))
        keys = rng.integers(0, universe, size=n).astype(np.uint64)
        keys[rng.random(n) < 0.1] = EMPTY
        _check_against_the_cpu_and_the_sort(keys, launch)


def test_unique_ids_of_a_large_batch(launch, emulation_seed):
    # Zipf ids, 200,000 (a table of 524,288 buckets) in the default mode, 40,000 under a stress
    # seed (slower): the grid-stride loops run many rounds
    rng = np.random.default_rng(34)
    n = 200_000 if emulation_seed is None else 40_000
    keys = rng.zipf(1.05, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    _check_against_the_cpu_and_the_sort(keys, launch)


def test_the_table_holds_each_key_once_with_its_first_position(launch):
    """The kernels' own table after the insert pass: every distinct key in exactly one bucket (the
    marker key in the side bucket), that bucket's first position the key's smallest one, each
    id's bucket the one holding its key, and no hole between a key's home and its bucket."""
    for keys in (KEY_SETS["collide_and_wrap"], KEY_SETS["zipf"], KEY_SETS["extremes"]):
        n = keys.size
        capacity = device_unique.dedup_capacity(n)
        table = np.empty(2 * (capacity + 1), np.uint64)
        device_ops.launch_threads(launch, "embedding", "dedup_clear", np.float32, capacity + 1,
                                  (table, np.int64(capacity + 1), np.int64(n)))
        bucket_of = np.empty(n, np.int64)
        device_ops.launch_threads(launch, "embedding", "dedup_insert", np.float32, n,
                                  (keys, np.int64(n), table, np.int64(capacity - 1), bucket_of))
        buckets = table.reshape(capacity + 1, 2)
        occupied = np.flatnonzero(buckets[:capacity, 0] != EMPTY)
        distinct, first_positions = np.unique(keys, return_index=True)
        ordinary = distinct != EMPTY
        assert sorted(buckets[occupied, 0].tolist()) == distinct[ordinary].tolist()
        np.testing.assert_array_equal(buckets[bucket_of, 0][keys != EMPTY], keys[keys != EMPTY])
        assert (bucket_of[keys == EMPTY] == capacity).all()
        first_of_key = dict(zip(distinct.tolist(), first_positions.tolist(), strict=True))
        for b in occupied:
            assert int(buckets[b, 1]) == first_of_key[int(buckets[b, 0])]
        assert int(buckets[capacity, 1]) == first_of_key.get(EMPTY, n)
        assert (buckets[np.setdiff1d(np.arange(capacity), occupied), 1] == n).all()
        home = (mix64(np, buckets[occupied, 0]) & np.uint64(capacity - 1)).astype(np.int64)
        for h, b in zip(home, occupied, strict=True):
            run = np.arange(h, h + (b - h) % capacity) % capacity
            assert (buckets[run, 0] != EMPTY).all(), f"a hole between home {h} and bucket {b}"


def test_one_counted_read_per_call(launch):
    keys = KEY_SETS["zipf"]
    with host_sync.counting() as reads:
        device_unique.unique_ids(keys, launch=launch, return_first=True)
    assert reads.total == 1 and dict(reads.by_reason) == {"dedup: unique count": 1}
    with host_sync.counting() as reads:
        device_unique.unique_ids(KEY_SETS["empty"], launch=launch)
    assert reads.total == 0


def test_dedup_capacity_keeps_the_table_at_most_half_full():
    for n in (1, 2, 3, 4, 5, 63, 64, 65, 1000, 1 << 20, (1 << 20) + 1):
        capacity = device_unique.dedup_capacity(n)
        assert capacity >= 2 * n and capacity & (capacity - 1) == 0 and capacity < 4 * n
    assert device_unique.dedup_capacity(0) == 2


def test_unique_ids_refuses_bad_keys(launch):
    with pytest.raises(InputError, match="dimensions"):
        device_unique.unique_ids(np.zeros((3, 2), np.uint64), launch=launch)
    with pytest.raises(InputError, match="not a numpy array"):
        device_unique.unique_ids([1, 2, 3], launch=launch)
    # any integer dtype is taken as uint64 bits, as the CPU unique does
    keys = np.array([-1, 5, -1], np.int64)
    got_unique, got_inverse = device_unique.unique_ids(keys, launch=launch)
    np.testing.assert_array_equal(got_unique, np.array([EMPTY, 5], np.uint64))
    np.testing.assert_array_equal(got_inverse, [0, 1, 0])


# ---------------------------------------------------------------- fixed capacity, count on the device


def _check_fixed_against_unique_ids(keys, launch):
    """``unique_ids_fixed``: arrays of capacity n, the first ``count`` entries those of
    ``unique_ids`` (and so of the CPU unique), the inverse the same, the rest placeholders
    (key 0, first position 0), the count a (1,) int64 device array."""
    n = keys.size
    fixed = device_unique.unique_ids_fixed(keys, launch=launch)
    want_unique, want_inverse = unique_ids(keys)
    want_first = first_occurrence(want_inverse, want_unique.size)
    u = want_unique.size
    assert fixed.count.shape == (1,) and fixed.count.dtype == np.int64
    assert int(fixed.count[0]) == u
    for got, want, dtype in ((fixed.keys, want_unique, np.uint64), (fixed.first, want_first, np.int64)):
        assert got.shape == (n,) and got.dtype == dtype
        np.testing.assert_array_equal(got[:u], want)
        np.testing.assert_array_equal(got[u:], np.zeros(n - u, dtype))   # placeholders
    assert fixed.inverse.shape == (n,) and fixed.inverse.dtype == np.int64
    np.testing.assert_array_equal(fixed.inverse, want_inverse)
    return fixed


@pytest.mark.parametrize("case", sorted(KEY_SETS))
def test_unique_ids_fixed_equal_unique_ids_below_the_count(launch, case):
    _check_fixed_against_unique_ids(KEY_SETS[case], launch)
    assert "embedding_dedup_output_fixed" in launch.launched or case == "empty"


def test_unique_ids_fixed_of_many_random_batches(launch):
    rng = np.random.default_rng(35)
    for n in (1, 2, 3, 17, 31, 32, 33, 255, 256, 257, 1000):
        universe = max(1, int(rng.integers(1, 2 * n)))
        keys = rng.integers(0, universe, size=n).astype(np.uint64)
        keys[rng.random(n) < 0.1] = EMPTY
        keys[rng.random(n) < 0.1] = 0     # a real key 0 beside the placeholders
        _check_fixed_against_unique_ids(keys, launch)


def test_unique_ids_fixed_edge_batches(launch):
    """Empty (count 0), all keys equal (count 1, n - 1 placeholders), every key the empty
    marker, every key distinct (no placeholder), key 0 alone."""
    empty = _check_fixed_against_unique_ids(np.empty(0, np.uint64), launch)
    assert empty.keys.shape == (0,) and int(empty.count[0]) == 0
    same = _check_fixed_against_unique_ids(np.full(500, 12345, np.uint64), launch)
    assert int(same.count[0]) == 1
    marker = _check_fixed_against_unique_ids(np.full(300, EMPTY, np.uint64), launch)
    assert int(marker.count[0]) == 1 and int(marker.keys[0]) == EMPTY
    distinct = _check_fixed_against_unique_ids(KEY_SETS["distinct"], launch)
    assert int(distinct.count[0]) == KEY_SETS["distinct"].size
    zero = _check_fixed_against_unique_ids(np.zeros(9, np.uint64), launch)
    assert int(zero.count[0]) == 1


def test_unique_ids_fixed_reads_nothing(launch):
    """No host read, where ``unique_ids`` makes one (the count that sizes its arrays)."""
    with host_sync.counting() as reads:
        device_unique.unique_ids_fixed(KEY_SETS["zipf"], launch=launch)
        device_unique.unique_ids_fixed(KEY_SETS["empty"], launch=launch)
    assert reads.total == 0, dict(reads.by_reason)


def test_the_kernels_after_the_dedup_skip_the_placeholders(launch):
    """The device store's find and insert take the count: a batch of capacity n stores and
    finds only its first ``count`` keys; the placeholders (key 0 here, never a real key of the
    batch) are not looked up (slot -2), not inserted, and their lines are not written."""
    from one_embedding.cache.device import NOT_LOOKED_UP, DeviceFullStore

    keys = np.array([7, 9, 7, 11, 9, 7], np.uint64)
    fixed = device_unique.unique_ids_fixed(keys, launch=launch)   # [7, 9, 11, 0, 0, 0], count 3
    store = DeviceFullStore(4, capacity=16, launch=launch)
    lines = np.arange(24, dtype=np.float32).reshape(6, 4)
    store.insert_or_assign(fixed.keys, lines, fixed.count)
    assert len(store) == 3
    held_keys, held_lines = next(store.export_batches())
    np.testing.assert_array_equal(held_keys, [7, 9, 11])
    np.testing.assert_array_equal(held_lines, lines[:3])
    out = np.full((6, 4), -1.0, np.float32)
    found = store.find_found(fixed.keys, out, fixed.count)
    np.testing.assert_array_equal(found, [True] * 6)          # placeholders: nothing to do
    np.testing.assert_array_equal(out[:3], lines[:3])
    assert (out[3:] == -1.0).all()                             # untouched
    slots = store._index.find_live(fixed.keys, fixed.count)
    np.testing.assert_array_equal(slots[3:], [NOT_LOOKED_UP] * 3)
    assert (store._index.find(np.array([0], np.uint64)) == -1).all()   # 0 never inserted
    # a real key 0 below the count is found and stored like any other
    with_zero = device_unique.unique_ids_fixed(np.array([0, 5, 0, 5], np.uint64), launch=launch)
    store.insert_or_assign(with_zero.keys, np.ones((4, 4), np.float32), with_zero.count)
    assert len(store) == 5
    assert (store._index.find(np.array([0, 5], np.uint64)) >= 0).all()


# ---------------------------------------------------------------- the output pass fused with the find


def _store_holding(held, launch, capacity: int | None = None, line_size: int = 5):
    """A ``DeviceFullStore`` holding ``held`` (distinct uint64), key k's line filled with
    k % 1000 + its column / 8 (every line distinct from the -1 rows the finds start from)."""
    from one_embedding.cache.device import DeviceFullStore

    held = np.asarray(held, np.uint64)
    capacity = max(16, held.size) if capacity is None else capacity
    store = DeviceFullStore(line_size, capacity=capacity, launch=launch)
    lines = (held % np.uint64(1000)).astype(np.float32)[:, None] + \
        np.arange(line_size, dtype=np.float32) / 8
    store.insert_or_assign(held, lines)
    return store


def _held_sets(keys, launch):
    """Stores for one batch: empty; holding every other distinct key of the batch and 50 keys
    it lacks; and full-ish: an index loaded to its 0.7 limit (long probe chains), half of them
    the batch's keys."""
    rng = np.random.default_rng(int(keys.size) + 36)
    distinct = np.unique(keys)
    foreign = rng.integers(0, 2**64, size=4 * distinct.size + 200, dtype=np.uint64, endpoint=False)
    foreign = foreign[~np.isin(foreign, keys)]
    yield "empty", _store_holding(np.empty(0, np.uint64), launch)
    yield "some", _store_holding(np.concatenate([distinct[::2], foreign[:50]]), launch)
    from one_embedding.cache.device import DeviceFullStore, MAX_LOAD

    capacity = max(16, distinct.size)
    index_capacity = DeviceFullStore(1, capacity=capacity, launch=launch)._index.capacity
    limit = int(index_capacity * MAX_LOAD)
    held = np.concatenate([distinct[: limit // 2], foreign])[:limit]
    store = _store_holding(held, launch, capacity=limit)   # the same index capacity
    assert store._index.capacity == index_capacity and len(store) == limit   # no growth
    yield "full", store


def _check_fused_against_dedup_then_find(keys, launch):
    """``unique_ids_fixed_find`` (one kernel) against ``unique_ids_fixed`` then the store's
    ``find_live``: the same unique keys, inverse, first positions and count, the same slots
    (-2 past the count), the same lines copied and the same rows left untouched; and the store's
    ``dedup_find_found`` against its ``find_found``."""
    n = keys.size
    for name, store in _held_sets(keys, launch):
        want = device_unique.unique_ids_fixed(keys, launch=launch)
        want_out = np.full((n, store.line_size), -1.0, np.float32)
        want_slots = store._index.find_live(want.keys, want.count, store._rows, want_out)
        got_out = np.full((n, store.line_size), -1.0, np.float32)
        passes = device_unique.dedup_passes_fixed(keys, launch)
        got, got_slots = store._index.dedup_find_live(passes, store._rows, got_out)
        for a, b in zip((*got, got_slots, got_out), (*want, want_slots, want_out), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
        passes = device_unique.dedup_passes_fixed(keys, launch)
        slots_only, bare = store._index.dedup_find_live(passes)
        np.testing.assert_array_equal(bare, want_slots, err_msg=name)
        np.testing.assert_array_equal(slots_only.keys, want.keys, err_msg=name)
        found_out = np.full((n, store.line_size), -1.0, np.float32)
        passes = device_unique.dedup_passes_fixed(keys, launch)
        fixed, found = store.dedup_find_found(passes, found_out)
        want_found_out = np.full((n, store.line_size), -1.0, np.float32)
        want_found = store.find_found(want.keys, want_found_out, want.count)
        np.testing.assert_array_equal(found, want_found, err_msg=name)
        np.testing.assert_array_equal(found_out.view(np.uint32), want_found_out.view(np.uint32))
        np.testing.assert_array_equal(fixed.inverse, want.inverse, err_msg=name)
        if name == "some" and np.unique(keys).size > 1:   # some found, some not
            assert (want_slots[: int(want.count[0])] >= 0).any() and (want_slots == -1).any()


@pytest.mark.parametrize("case", sorted(KEY_SETS))
def test_dedup_output_fused_with_the_find_equals_the_two_passes(launch, emulation_seed, case):
    # the whole sets run through the dedup's own tests above; the fused pass's logic (a warp
    # per 32 ids, one probe per first occurrence, three stores) needs no more than their first
    # 1,024 ids here, and under a stress seed (slower) 256 (the suite's time: 58 s -> 21 s)
    keys = KEY_SETS[case][:1024] if emulation_seed is None else KEY_SETS[case][:256]
    _check_fused_against_dedup_then_find(keys, launch)
    assert "hashindex_dedup_output_find" in launch.launched or case == "empty"


def test_dedup_output_fused_with_the_find_of_many_random_batches(launch):
    """Batch sizes on both sides of a warp's 32 ids (the fused pass probes a warp's first
    occurrences one after another), with the marker and key 0 among them."""
    rng = np.random.default_rng(37)
    for n in (1, 2, 31, 32, 33, 63, 64, 65, 257):
        keys = rng.integers(0, max(1, int(rng.integers(1, 2 * n))), size=n).astype(np.uint64)
        keys[rng.random(n) < 0.1] = EMPTY
        keys[rng.random(n) < 0.1] = 0
        _check_fused_against_dedup_then_find(keys, launch)


def test_dedup_output_fused_with_the_find_reads_nothing(launch):
    store = _store_holding(KEY_SETS["zipf"][:100], launch)
    with host_sync.counting() as reads:
        passes = device_unique.dedup_passes_fixed(KEY_SETS["zipf"], launch)
        store._index.dedup_find_live(passes, store._rows,
                                     np.empty((KEY_SETS["zipf"].size, 5), np.float32))
    assert reads.total == 0, dict(reads.by_reason)
