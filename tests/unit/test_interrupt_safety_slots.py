"""A KeyboardInterrupt (Ctrl-C) inside the slot engine's save_snapshot or segment creation: the
retry works, and the reopened store holds exactly the last completed snapshot's rows.

Before: an interrupt in a seal left the active segment unsealed and out of reach (the retry's
``s.info.as_dict()`` on None), and one in a segment's creation left its files while the next
segment asked for the same id (every later write: "cannot create the segment ... File exists")."""
import os
import random
import signal

import numpy as np
import pytest

import helpers

from one_embedding.store import segments
from one_embedding.store.segments import SegmentPool
from one_embedding.store.slot_file import SlotFileStore
from one_embedding.store.snapshots import SnapshotDirectory

LINE = 8


def lines_for(keys, salt=0.0):
    return helpers.slot_lines(keys, LINE, salt)


def open_store(path):
    return SlotFileStore(LINE, str(path), direct_io=False, segment_rows=1024)


save = helpers.save_slot_snapshot


def check_snapshot(path, model, name="s"):
    helpers.check_slot_snapshot(open_store, path, model, name)


write = helpers.write_slot_lines


def once(monkeypatch, owner, name, after=False):
    """``owner.name`` raises KeyboardInterrupt at its first call (before it runs, or after)."""
    real = getattr(owner, name)
    fired = []

    def wrapper(*args, **kwargs):
        if not fired:
            fired.append(1)
            if after:
                real(*args, **kwargs)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return fired


def filled(path):
    store, model = open_store(path), {}
    write(store, model, np.arange(1, 3001, dtype=np.uint64) * 977, 0.0)
    save(store, path, "first")
    write(store, model, np.arange(1, 800, dtype=np.uint64) * 977, 1.0)     # overwrites
    write(store, model, np.arange(5000, 5300, dtype=np.uint64) * 977, 2.0)  # new keys
    erased = np.arange(2000, 2100, dtype=np.uint64) * 977
    store.erase(erased)
    for k in erased.tolist():
        model.pop(k)
    return store, model


@pytest.mark.parametrize("where", [
    (segments, "_write_synced", False),      # the seal's first file
    (segments, "fsync_dir", False),          # its last step before the info
    (SegmentPool, "_finish_seal", False),    # files done, the RAM side not
    (segments.Segment, "cut_keys", True),    # keys file cut, not synced
])
def test_interrupted_seal_then_retry(tmp_path, monkeypatch, where):
    store, model = filled(tmp_path)
    fired = once(monkeypatch, *where)
    with pytest.raises(KeyboardInterrupt):
        save(store, tmp_path)
    assert fired
    # training goes on before the retry: no row goes into a half-sealed segment
    write(store, model, np.arange(7000, 7050, dtype=np.uint64) * 977, 3.0)
    save(store, tmp_path)   # the retry
    store.close()
    check_snapshot(tmp_path, model)


def test_interrupted_seal_then_plain_retry(tmp_path, monkeypatch):
    store, model = filled(tmp_path)
    once(monkeypatch, segments, "_write_synced")
    with pytest.raises(KeyboardInterrupt):
        save(store, tmp_path)
    save(store, tmp_path)
    store.close()
    check_snapshot(tmp_path, model)


@pytest.mark.parametrize("where", [
    (segments, "_allocate", False),      # the rows file made, not allocated
    (segments, "MappedWords", False),    # both files made, the Segment half built
    (SegmentPool, "create", True),       # made, not yet in the live table
])
def test_interrupted_segment_creation_then_retry(tmp_path, monkeypatch, where):
    store, model = filled(tmp_path)
    save(store, tmp_path)
    model_saved = dict(model)
    fired = once(monkeypatch, *where)
    keys = np.arange(9000, 9100, dtype=np.uint64) * 977
    with pytest.raises(KeyboardInterrupt):
        write(store, {}, keys, 4.0)   # the first write after a save makes a segment
    assert fired
    write(store, model, keys, 4.0)    # the retry (and every later write) works
    write(store, model, np.arange(9100, 9200, dtype=np.uint64) * 977, 5.0)
    if where[1] != "create":  # nothing of the interrupted segment stayed behind
        held = {s.id for s in store._segments.values()}
        orphans = store.pool.ids_on_disk() - held - store._pinned_ids()
        assert not orphans
    store.close()
    check_snapshot(tmp_path, model_saved)   # the last completed snapshot, as it was
    store = open_store(tmp_path)
    store.load_snapshot(SnapshotDirectory(str(tmp_path)).path("s"))
    write(store, model, np.arange(9200, 9300, dtype=np.uint64) * 977, 6.0)
    save(store, tmp_path)
    store.close()
    model = {**model_saved, **{k: v for k, v in model.items() if k >= 9200 * 977}}
    check_snapshot(tmp_path, model)


def test_a_taken_segment_name_is_named_as_such(tmp_path):
    store, model = filled(tmp_path)
    save(store, tmp_path)
    open(store.pool.path(store._next_id, "rows"), "wb").close()  # another writer's file
    with pytest.raises(Exception, match="exists already") as e:
        write(store, model, np.arange(9000, 9010, dtype=np.uint64), 1.0)
    assert "persistent_path this process can write" not in str(e.value)
    store.close()


def test_random_interrupts_in_save_snapshot(tmp_path):
    """The fault campaign's way: SIGALRM at a random point of save_snapshot, then a retry."""
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    rng = random.Random(1)
    hits = 0
    try:
        for trial in range(12):
            path = tmp_path / str(trial)
            store, model = filled(path)
            armed[0] = True
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 4e-3))
                save(store, path)
            except KeyboardInterrupt:
                hits += 1
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            save(store, path)
            store.close()
            check_snapshot(path, model)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert os.path.isdir(tmp_path)
