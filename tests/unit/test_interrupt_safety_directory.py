"""A KeyboardInterrupt (Ctrl-C) between any two bytecodes of the slot engine's directory
(``CompactIndex``), its block writes, its erase, and the memory store's insert: the object stays
consistent (the call took effect, or not, or its retry finishes it), nothing stored is lost and a
snapshot saved afterwards is correct.

Before: the directory's count was kept in Python after its kernels (an interrupt between left it
wrong: ``locations()`` wrote past its array, slots.json recorded wrong "rows"), growth and clear
emptied the table before refilling it (every key lost); an interrupted block write advanced the
rows CRC of blocks the retry rewrote (a full verify called good data damaged); an erase dropped
keys before their tombstones existed (a snapshot brought them back); the memory store's new keys
pointed at rows not yet written."""
import copy
import os
import random
import signal
import sys

import numpy as np
import pytest

import helpers

from one_embedding.store import slot_block_io
from one_embedding.store.memory import MemoryStore
from one_embedding.store.slot_file import SlotFileStore
from one_embedding.store.snapshots import SnapshotDirectory
from one_embedding.tiers import compact_index
from one_embedding.tiers.compact_index import EMPTY, CompactIndex

LINE = 8


# -- an interrupt at every bytecode ---------------------------------------------------------
class At:
    """A tracer that raises KeyboardInterrupt at the ``k``-th bytecode run in ``files``."""

    def __init__(self, k, files):
        self.k, self.files, self.seen, self.fired = k, set(files), 0, False

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in self.files:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._local

    def _local(self, frame, event, arg):
        if event == "opcode" and not self.fired:
            self.seen += 1
            if self.seen == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self._local


def every_interrupt(files, make, call, limit=4000, step=1):
    """Yield ``obj`` after ``call(obj)`` was interrupted at its 1st, 2nd, ... bytecode in
    ``files`` (``obj = make()`` fresh each time, untraced), until it runs to its end untouched;
    then yield that last ``obj`` with ``None`` (returns the number of interrupts)."""
    for k in range(1, limit, step):
        obj = make()
        tracer = At(k, files)
        sys.settrace(tracer)
        try:
            call(obj)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if not tracer.fired:
            yield obj, None
            return
        yield obj, k
    raise AssertionError("the call did not end")


CI_FILE = [compact_index.__file__]


class Rows:
    """The caller's keys by location (what the slot engine's key files are)."""

    def __init__(self, n=100_000):
        self.keys = np.zeros(n, np.uint64)

    def __call__(self, locs):
        return self.keys[locs]


def occupied(index):
    return int((index._locs != EMPTY).sum())


def held(index, rows):
    locs = index._locs[index._locs != EMPTY].astype(np.int64)  # the table itself
    return dict(zip(rows(locs).tolist(), locs.tolist()))


def check(index, rows):
    """The count agrees with the table; every entry is found by its key."""
    assert occupied(index) == len(index), "the count disagrees with the table"
    got = held(index, rows)
    assert len(got) == len(index), "a key is held twice"
    assert sorted(index.locations().tolist()) == sorted(got.values())
    if got:
        keys = np.array(list(got), np.uint64)
        assert index.find(keys, rows).tolist() == list(got.values())
    return got


def filled(rows, n, first_loc=0, seed=0):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**62, n + 50, dtype=np.uint64))[:n]
    rng.shuffle(keys)
    locs = np.arange(first_loc, first_loc + n, dtype=np.int64)
    rows.keys[locs] = keys
    index = CompactIndex(n)
    index.insert_new(keys, locs, rows)
    return index, dict(zip(keys.tolist(), locs.tolist()))


def clone(index):
    return copy.deepcopy(index)


@pytest.mark.parametrize("n_new", [30, 900])   # 900: the insert grows the table
def test_an_interrupt_anywhere_in_upsert(n_new):
    rows = Rows()
    base, before = filled(rows, 400)
    rng = np.random.default_rng(1)
    new_keys = np.unique(rng.integers(2**62, 2**63, n_new + 10, dtype=np.uint64))[:n_new]
    old_keys = np.array(list(before)[:50], np.uint64)
    keys = np.concatenate([old_keys, new_keys])
    locs = np.arange(10_000, 10_000 + keys.shape[0], dtype=np.int64)
    rows.keys[locs] = keys
    after = {**before, **dict(zip(keys.tolist(), locs.tolist()))}
    trials = 0
    for index, k in every_interrupt(CI_FILE, lambda: clone(base),
                                    lambda i: i.upsert(keys, locs, rows)):
        trials += 1
        got = check(index, rows)
        for key, loc in before.items():   # nothing held before is lost
            assert got[key] in (loc, after[key])
        assert set(got) <= set(after)
        if k is not None:
            index.upsert(keys, locs, rows)  # the retry finishes it
        assert check(index, rows) == after
    assert trials > 20


def test_an_interrupt_anywhere_in_erase_at():
    rows = Rows()
    base, before = filled(rows, 400)
    gone = np.array(list(before)[100:250], np.uint64)
    rest = {k: v for k, v in before.items() if k not in set(gone.tolist())}
    for index, k in every_interrupt(CI_FILE, lambda: clone(base),
                                    lambda i: i.erase_at(i.positions(gone, rows))):
        assert check(index, rows) in (before, rest)
        index.erase_at(index.positions(gone, rows))
        assert check(index, rows) == rest


def test_an_interrupt_anywhere_in_clear_or_a_grow_loses_nothing():
    rows = Rows()
    base, before = filled(rows, 400)
    for index, k in every_interrupt(CI_FILE, lambda: clone(base), lambda i: i._grow(5000, rows)):
        assert check(index, rows) == before
    assert index.n_buckets > base.n_buckets
    for index, k in every_interrupt(CI_FILE, lambda: clone(base), lambda i: i.clear()):
        assert check(index, rows) in (before, {})
    assert check(index, rows) == {}


def test_a_full_table_puts_the_entry_in_hand_in_the_reserve_not_outside():
    """With no room left (its stash full), the entry an insert holds goes to the reserve, the
    last stash position, never outside the table; the table grows before the next insert."""
    rows = Rows()
    keys = np.arange(1, 101, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    locs = np.arange(100, dtype=np.int64)
    rows.keys[locs] = keys
    st = compact_index._fresh(1)  # one bucket: 4 entries, then the stash
    placed = compact_index._insert(st[1], st[2], st[0], keys, locs, 7, st[3])
    assert placed == compact_index.WAYS + compact_index.STASH
    assert st[2][-1] != EMPTY and int(st[3][0]) == placed == int((st[2] != EMPTY).sum())
    assert compact_index._insert(st[1], st[2], st[0], keys[placed:], locs[placed:], 8, st[3]) == 0
    index = CompactIndex()
    index._st = st
    assert check(index, rows) == dict(zip(keys[:placed].tolist(), locs[:placed].tolist()))
    for idx, k in every_interrupt(CI_FILE, lambda: clone(index),
                                  lambda i: i.insert_new(keys[placed:], locs[placed:], rows)):
        got = check(idx, rows)
        assert set(keys[:placed].tolist()) <= set(got)
    assert got == dict(zip(keys.tolist(), locs.tolist()))
    assert idx._locs[-1] == EMPTY


def test_a_wrong_count_is_an_error_not_a_corruption():
    rows = Rows()
    index, _ = filled(rows, 300)
    n = len(index)
    buf = np.full(n, 7, np.int64)
    assert compact_index._occupied(index._locs, buf[:n // 2]) == n
    assert (buf[n // 2:] == 7).all()
    index._st[3][0] -= 5
    with pytest.raises(RuntimeError, match="inconsistent"):
        index.locations()
    index._st = (index._st[0] + 1,) + index._st[1:]  # n_buckets disagreeing with the arrays
    with pytest.raises(RuntimeError, match="inconsistent"):
        index.insert_new(np.array([5], np.uint64), np.array([5], np.int64), rows)


# -- the memory store: a new key never points at a row not yet written ----------------------
def test_an_interrupt_anywhere_in_a_memory_insert():
    from one_embedding.store import memory

    def make():
        store = MemoryStore(LINE, capacity=256)
        store.insert_or_assign(np.arange(100, dtype=np.uint64), lines_for(np.arange(100), 1.0))
        store.erase(np.arange(50, 100, dtype=np.uint64))  # their rows stay, to be reused
        return store

    keys = np.arange(30, 130, dtype=np.uint64)  # 20 held, 80 new (50 reuse freed rows)
    new_lines = lines_for(keys, 2.0)
    old = {k: lines_for(np.array([k]), 1.0)[0] for k in range(50)}
    trials = 0
    for store, k in every_interrupt([memory.__file__], make,
                                    lambda s: s.insert_or_assign(keys, new_lines)):
        trials += 1
        probe = np.arange(0, 130, dtype=np.uint64)
        out = np.full((probe.shape[0], LINE), -1, np.float32)
        missing = set(store.find(probe, out, np.arange(probe.shape[0])).tolist())
        for i, key in enumerate(probe.tolist()):
            if i in missing:
                assert key >= 50
                continue
            new = new_lines[key - 30] if key >= 30 else None
            ok = [x for x in (old.get(key), new) if x is not None]
            assert any(np.array_equal(out[i], x) for x in ok), f"key {key}: a row never written"
        assert len(store) == probe.shape[0] - len(missing)
        store.insert_or_assign(keys, new_lines)
        out = np.zeros((keys.shape[0], LINE), np.float32)
        assert store.find(keys, out, np.arange(keys.shape[0])).shape[0] == 0
        np.testing.assert_array_equal(out, new_lines)
    assert trials > 10


# -- the slot engine: block writes and erases -------------------------------------------------
def lines_for(keys, salt=0.0):
    return helpers.slot_lines(keys, LINE, salt)


def open_store(path):
    return SlotFileStore(LINE, str(path), direct_io=False, segment_rows=1024, io_threads=1)


save = helpers.save_slot_snapshot


def check_snapshot(path, model, name="s"):
    helpers.check_slot_snapshot(open_store, path, model, name)


write = helpers.write_slot_lines


def slot_store(path):
    store, model = open_store(path), {}
    write(store, model, np.arange(1, 301, dtype=np.uint64) * 977, 0.0)
    save(store, path, "first")
    write(store, model, np.arange(1, 50, dtype=np.uint64) * 977, 1.0)  # a partly filled block
    return store, model


def test_an_interrupted_block_write_then_another_write(tmp_path, monkeypatch):
    """The rows CRC advanced per block before the write was complete: the retry (other rows)
    rewrote those blocks but skipped their CRC, and a full verify called the snapshot damaged."""
    store, model = slot_store(tmp_path)
    monkeypatch.setattr(slot_block_io, "IO_CHUNK_BYTES", 2 * store.block_bytes)
    real = slot_block_io.block_checksums
    calls = []

    def second_chunk_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(slot_block_io, "block_checksums", second_chunk_fails)
    with pytest.raises(KeyboardInterrupt):
        write(store, {}, np.arange(1000, 1600, dtype=np.uint64) * 977, 5.0)  # 5 blocks
    # a read of the rows in the partly filled block, then other rows
    keys = np.arange(1, 50, dtype=np.uint64) * 977
    out = np.zeros((keys.shape[0], LINE), np.float32)
    assert store.find(keys, out, np.arange(keys.shape[0])).shape[0] == 0
    np.testing.assert_array_equal(out, lines_for(keys, 1.0))
    write(store, model, np.arange(2000, 2030, dtype=np.uint64) * 977, 6.0)
    save(store, tmp_path)
    store.close()
    check_snapshot(tmp_path, model)


@pytest.mark.slow  # an interrupt at every 7th bytecode of the call: ~10 s each
@pytest.mark.parametrize("op", ["write", "erase"])
def test_an_interrupt_anywhere_in_a_slot_write_or_erase(tmp_path, op):
    from one_embedding.store import slot_file

    files = [slot_file.__file__, slot_block_io.__file__]
    keys = (np.arange(200, 340, dtype=np.uint64) if op == "write"
            else np.arange(20, 90, dtype=np.uint64)) * 977
    made = []

    def make():
        path = tmp_path / str(len(made))
        store, model = slot_store(path)
        made.append((path, store, model))
        return store

    def call(store):
        if op == "write":
            store.insert_or_assign(keys, lines_for(keys, 7.0))
        else:
            store.erase(keys)

    trials = 0
    for store, k in every_interrupt(files, make, call, step=7):  # (each bytecode: minutes)
        path, _, model = made[-1]
        after = dict(model)
        if op == "write":
            after.update(zip(keys.tolist(), lines_for(keys, 7.0)))
        else:
            for key in keys.tolist():
                after.pop(key, None)
        save(store, path, "interrupted")   # a snapshot right after the interrupt: one of the two
        call(store)                        # the retry
        save(store, path)
        store.close()
        check_snapshot(path, after)
        try:
            check_snapshot(path, model, "interrupted")
        except AssertionError:
            if op == "erase":
                check_snapshot(path, after, "interrupted")
            else:  # a write may have placed a prefix of its keys: each key old or new
                check_partial(path, model, after)
        trials += 1
    assert trials > 20


def check_partial(path, model, after):
    store = open_store(path)
    try:
        folder = SnapshotDirectory(str(path)).path("interrupted")
        store.verify_snapshot(folder, full=True)
        store.load_snapshot(folder)
        keys = np.array(sorted(after), np.uint64)
        out = np.zeros((keys.shape[0], LINE), np.float32)
        assert store.find(keys, out, np.arange(keys.shape[0])).shape[0] == 0
        for i, key in enumerate(keys.tolist()):
            assert any(np.array_equal(out[i], m[key]) for m in (model, after) if key in m)
        assert len(store) == len(after)
    finally:
        store.close()
