"""A KeyboardInterrupt (Ctrl-C) anywhere in a HashIndex call leaves the index as it was before the
call or as it is after it, never a mix (a count that disagrees with the buckets let ``items``
write past its arrays: heap corruption); kernels that fill sized outputs never write past them."""
import random
import signal

import numpy as np
import pytest

from one_embedding.tiers import hash_index
from one_embedding.tiers.hash_index import EMPTY, HashIndex, copy_found_rows


def _occupied(index):
    return int((index._slots != EMPTY).sum())


def _as_dict(index):
    # the buckets read directly (not through items(), which trusts the count)
    held = index._slots != EMPTY
    return dict(zip(index._keys[held].tolist(), index._slots[held].tolist()))


def _filled(n_batches=3, seed=0):
    rng = np.random.default_rng(seed)
    index = HashIndex(16)
    for _ in range(n_batches):
        index.find_or_insert(np.unique(rng.integers(0, 2**40, 500, dtype=np.uint64)))
    return index, rng


def _interrupt(monkeypatch, name, after):
    """Make the kernel ``name`` raise KeyboardInterrupt once, before or after it ran."""
    real = getattr(hash_index, name)
    fired = []

    def kernel(*args):
        if not fired:
            fired.append(1)
            if after:
                real(*args)
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(hash_index, name, kernel)
    return fired


def _check_consistent(index, expect_any):
    assert _occupied(index) == len(index), "the count disagrees with the buckets"
    got = _as_dict(index)
    assert any(got == e for e in expect_any)
    keys, slots = index.items()
    assert dict(zip(keys.tolist(), slots.tolist())) == got
    assert index.slot_limit > max(got.values(), default=-1)


@pytest.mark.parametrize("after", [False, True])
def test_interrupt_in_find_or_insert(monkeypatch, after):
    index, rng = _filled()
    before = _as_dict(index)
    batch = np.unique(rng.integers(0, 2**40, 200, dtype=np.uint64))  # no growth: 1700 < 0.7*4096
    fired = _interrupt(monkeypatch, "_find_or_insert", after)
    with pytest.raises(KeyboardInterrupt):
        index.find_or_insert(batch)
    assert fired
    got = _as_dict(index)
    _check_consistent(index, [got])
    assert {k: got.get(k) for k in before} == before
    if after:  # it took effect, whole
        assert set(got) == set(before) | set(batch.tolist())
    else:
        assert got == before
    # and it keeps working: a retry finds the keys (or inserts them), fresh slots stay unique
    slots, _ = index.find_or_insert(batch)
    assert np.array_equal(index.find(batch), slots)
    more = np.arange(2**41, 2**41 + 5000, dtype=np.uint64)
    index.find_or_insert(more)
    _check_consistent(index, [_as_dict(index)])
    held = list(_as_dict(index).values())
    assert len(set(held)) == len(held)


def test_interrupt_while_growing_loses_nothing(monkeypatch):
    index, rng = _filled()
    before = _as_dict(index)
    big = np.unique(rng.integers(2**41, 2**42, 5000, dtype=np.uint64))  # forces a rehash
    fired = _interrupt(monkeypatch, "_assign", after=False)  # the rehash's refill
    with pytest.raises(KeyboardInterrupt):
        index.find_or_insert(big)
    assert fired
    _check_consistent(index, [before])
    keys = np.array(list(before), np.uint64)
    assert np.array_equal(index.find(keys), np.array(list(before.values()), np.int64))
    index.find_or_insert(big)
    assert len(index) == len(before) + big.shape[0]


@pytest.mark.parametrize("after", [False, True])
def test_interrupt_in_erase(monkeypatch, after):
    index, _ = _filled()
    before = _as_dict(index)
    gone = np.array(list(before)[:300], np.uint64)
    rest = {k: v for k, v in before.items() if k not in set(gone.tolist())}
    _interrupt(monkeypatch, "_erase", after)
    with pytest.raises(KeyboardInterrupt):
        index.erase(gone)
    _check_consistent(index, [rest] if after else [before])
    # a slot freed by the interrupted erase is handed out again, never lost nor doubled
    new = np.arange(2**45, 2**45 + 300, dtype=np.uint64)
    if not after:
        index.erase(gone)
    slots, is_new = index.find_or_insert(new)
    assert is_new.all()
    assert set(slots.tolist()) == {before[k] for k in gone.tolist()}


@pytest.mark.parametrize("after", [False, True])
def test_interrupt_in_assign(monkeypatch, after):
    index = HashIndex(64)
    index.assign(np.arange(10, dtype=np.uint64), np.arange(10, dtype=np.int64))
    before = _as_dict(index)
    keys = np.arange(5, 25, dtype=np.uint64)
    slots = np.arange(100, 120, dtype=np.int64)
    _interrupt(monkeypatch, "_assign", after)
    with pytest.raises(KeyboardInterrupt):
        index.assign(keys, slots)
    done = {**before, **dict(zip(keys.tolist(), slots.tolist()))}
    _check_consistent(index, [done] if after else [before])
    assert index.slot_limit == (120 if after else 10)


def test_random_interrupts_leave_the_index_whole():
    """The fault campaign's way: SIGALRM at random points of find_or_insert / erase."""
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    rng = random.Random(0)
    keys_rng = np.random.default_rng(0)
    hits = 0
    try:
        for trial in range(150):
            index = HashIndex(16)
            for _ in range(3):
                index.find_or_insert(np.unique(keys_rng.integers(0, 2**40, 800, dtype=np.uint64)))
            before = _as_dict(index)
            batch = np.unique(keys_rng.integers(0, 2**40, 2000, dtype=np.uint64))
            erase = trial % 3 == 2
            armed[0] = True
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2e-4))
                if erase:
                    index.erase(np.array(list(before)[:1000], np.uint64))
                else:
                    index.find_or_insert(batch)
            except KeyboardInterrupt:
                hits += 1
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert _occupied(index) == len(index), f"trial {trial}"
            got = _as_dict(index)
            if erase:
                gone = set(list(before)[:1000])
                assert got in (before, {k: v for k, v in before.items() if k not in gone})
            else:
                assert {k: got.get(k) for k in before} == before
                assert got == before or set(got) == set(before) | set(batch.tolist())
            index.items()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert hits > 0


def test_occupied_never_writes_past_its_outputs():
    index, _ = _filled()
    n = len(index)
    buf_k = np.full(n, 7, np.uint64)
    buf_s = np.full(n, 7, np.int64)
    k = n // 2
    got = hash_index._occupied(index._keys, index._slots, buf_k[:k], buf_s[:k])
    assert got == n
    assert (buf_k[k:] == 7).all() and (buf_s[k:] == 7).all()


def test_a_wrong_count_is_an_error_not_a_corruption():
    index, _ = _filled()
    index._st[3][hash_index.SIZE] -= 5  # as an interrupt between kernel and count once did
    with pytest.raises(RuntimeError, match="inconsistent"):
        index.items()
    index._st[3][hash_index.SIZE] = index._keys.shape[0]  # a count past the table
    with pytest.raises(RuntimeError, match="inconsistent"):
        index.find_or_insert(np.arange(3, dtype=np.uint64))


def test_copy_found_rows_refuses_out_of_range_slots():
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    big = np.full((6, 4), -1, np.float32)
    out = big[:3]
    with pytest.raises(IndexError):
        copy_found_rows(rows, np.array([0, 10], np.int64), out, np.array([0, 1], np.int64))
    with pytest.raises(IndexError):
        copy_found_rows(rows, np.array([0, 1], np.int64), out, np.array([0, 3], np.int64))
    assert (big[3:] == -1).all()
    missing = copy_found_rows(rows, np.array([2, -1], np.int64), out, np.array([1, 0], np.int64))
    assert missing.tolist() == [1] and np.array_equal(out[1], rows[2])
