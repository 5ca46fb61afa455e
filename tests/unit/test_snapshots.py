"""Snapshots: exact round trip in a fresh process, atomic publication, clear errors, LOCK."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import one_embedding as oe

import helpers

ROOT = str(helpers.ROOT)


def _build(path, dim=8, key_type=np.int64, size_factor=3, dims=None):
    tables = [oe.make_table_options(oe.make_normal_initializer(0, 0.1)) for _ in range(2)]
    store = oe.make_device_mem_store_options(str(path), capacity=1000, size_factor=size_factor)
    if dims is not None:
        tables = [oe.make_table_options([oe.make_column_options(oe.make_normal_initializer())] * len(dims))] * 2
        return oe.MultiTableMultiColumnEmbedding("snap", dims, np.float32, key_type, tables, store)
    return oe.MultiTableEmbedding("snap", dim, np.float32, key_type, tables, store)


def _train(emb, steps, seed=0):
    opt = oe.Optimizer(oe.optim.Adam(lr=0.01), embeddings=[emb])
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 300, size=(64, 2))
        out = emb(ids)
        emb.backward(rng.standard_normal(out.shape).astype(np.float32))
        opt.step()


def test_snapshot_loads_bit_identically_in_a_fresh_process(tmp_path):
    emb = _build(tmp_path)
    _train(emb, 5)
    emb.save_snapshot("step5")
    keys, lines = emb.export()
    np.save(tmp_path / "want_keys.npy", keys)
    np.save(tmp_path / "want_lines.npy", lines)
    _train(emb, 3, seed=1)  # diverge after the snapshot
    emb.close()
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {ROOT!r})
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        sys.path.insert(0, {str(helpers.TESTS)!r})
        from test_snapshots import _build
        emb = _build({str(tmp_path)!r})
        emb.load_snapshot("step5")
        k, l = emb.export()
        assert np.array_equal(k, np.load({str(tmp_path / 'want_keys.npy')!r}))
        assert np.array_equal(l.view(np.uint32), np.load({str(tmp_path / 'want_lines.npy')!r}).view(np.uint32))
        print("OK", len(k))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK")


def test_load_restores_exactly_and_clears_pending(tmp_path):
    emb = _build(tmp_path)
    _train(emb, 3)
    emb.save_snapshot("a")
    want = emb.export()
    _train(emb, 2, seed=5)
    out = emb(np.array([[1, 2]]))
    emb.backward(np.ones_like(out))
    emb.load_snapshot("a")
    oe.Optimizer(oe.optim.Adam(lr=0.1), embeddings=[emb]).step()  # nothing pending after load
    got = emb.export()
    np.testing.assert_array_equal(want[0], got[0])
    np.testing.assert_array_equal(want[1], got[1])


def test_manifest_records_the_layout(tmp_path):
    emb = _build(tmp_path)
    _train(emb, 1)
    emb.save_snapshot("m")
    with open(tmp_path / "0-1" / "snapshots" / "m" / "manifest.json") as f:
        m = json.load(f)
    assert m["format_version"] == 1
    assert m["key_type"] == "int64" and m["embedding_dims"] == [8] and m["line_size"] == 24
    assert m["row_count"] == len(emb)
    assert set(m["files"]) == {"keys.npy", "lines.npy"}
    assert all(isinstance(v["crc32"], int) for v in m["files"].values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim=16, size_factor=3), r"embedding_dims=\[8\] but this embedding has embedding_dims=\[16\]"),
        (dict(size_factor=2), r"line_size=24 but this embedding has line_size=16"),
        (dict(key_type=np.uint64), r"key_type='int64' but this embedding has key_type='uint64'"),
        (dict(dims=[7, 1]), r"embedding_dims"),
    ],
)
def test_reopening_with_another_layout_raises(tmp_path, kwargs, match):
    emb = _build(tmp_path)
    _train(emb, 1)
    emb.save_snapshot("s")
    emb.close()
    other = _build(tmp_path, **kwargs)
    with pytest.raises(oe.SnapshotError, match=match):
        other.load_snapshot("s")


def test_missing_snapshot_and_bad_names(tmp_path):
    emb = _build(tmp_path)
    _train(emb, 1)
    emb.save_snapshot("exists")
    with pytest.raises(oe.SnapshotError, match=r"no snapshot named 'nope'.*available: \['exists'\]"):
        emb.load_snapshot("nope")
    with pytest.raises(oe.SnapshotError, match="not allowed"):
        emb.save_snapshot("../escape")
    no_path = oe.MultiTableEmbedding("x", 4, np.float32, np.int64, None,
                                     oe.make_device_mem_store_options(None, 10))
    with pytest.raises(oe.SnapshotError, match="needs a persistent_path"):
        no_path.save_snapshot("a")


def test_corrupted_snapshot_fails_its_checksum(tmp_path):
    emb = _build(tmp_path)
    _train(emb, 1)
    emb.save_snapshot("c")
    lines = tmp_path / "0-1" / "snapshots" / "c" / "lines.npy"
    data = bytearray(lines.read_bytes())
    data[-3] ^= 0xFF
    lines.write_bytes(bytes(data))
    with pytest.raises(oe.SnapshotError, match="fails its checksum"):
        emb.load_snapshot("c")


def test_interrupted_resave_keeps_the_old_snapshot(tmp_path):
    """A crash between 'old renamed away' and 'new renamed in' is repaired on open."""
    emb = _build(tmp_path)
    _train(emb, 2)
    emb.save_snapshot("s")
    want = emb.export()
    emb.close()
    snaps = tmp_path / "0-1" / "snapshots"
    os.rename(snaps / "s", snaps / (".old-s-" + "0" * 32))
    os.mkdir(snaps / ".tmp-s-deadbeef")  # an unfinished new copy
    again = _build(tmp_path)
    assert sorted(os.listdir(snaps)) == ["s"]
    again.load_snapshot("s")
    np.testing.assert_array_equal(again.export()[1], want[1])


def test_lock_keeps_a_second_process_out(tmp_path):
    emb = _build(tmp_path)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {ROOT!r})
        import one_embedding as oe
        try:
            oe.MultiTableEmbedding("x", 8, np.float32, np.int64, None,
                                   oe.make_device_mem_store_options({str(tmp_path)!r}, 10))
        except oe.LockedError as e:
            print("LOCKED", e)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "LOCKED" in r.stdout and f"pid {os.getpid()}" in r.stdout, r.stdout + r.stderr
    assert "another process" in r.stdout
    emb.close()  # releasing the lock lets the next one in
    _build(tmp_path).close()


def test_unwritable_persistent_path(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/one_embedding_cannot_write_here"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        target = str(ro / "table")
    with pytest.raises(oe.StoreError, match="persistent path|not writable"):
        oe.MultiTableEmbedding("x", 4, np.float32, np.int64, None,
                               oe.make_device_mem_store_options(target, 10))


def test_an_unchanged_memory_table_snapshot_links_the_last_one(tmp_path):
    """``final`` right after ``step-N`` (nothing changed) costs no second copy: the memory
    store hard-links the last snapshot's files; a changed table is written anew."""
    import numpy as np

    import one_embedding as oe

    emb = oe.MultiTableEmbedding("t", 8, np.float32, np.int64, None,
                                 oe.make_device_mem_store_options(str(tmp_path), 100))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    out = emb(np.arange(50))
    emb.backward(np.ones(out.shape, np.float32))
    opt.step()
    emb.save_snapshot("step-1")
    emb(np.arange(60))  # a lookup changes nothing
    emb.save_snapshot("final")
    snaps = tmp_path / "0-1" / "snapshots"
    for f in ("keys.npy", "lines.npy"):
        assert (snaps / "final" / f).stat().st_ino == (snaps / "step-1" / f).stat().st_ino
    out = emb(np.arange(5))
    emb.backward(np.ones(out.shape, np.float32))
    opt.step()
    emb.save_snapshot("step-2")
    assert (snaps / "step-2" / "lines.npy").stat().st_ino != (snaps / "final" / "lines.npy").stat().st_ino
    want = emb.export()
    assert emb.delete_snapshot("step-1")
    emb.load_snapshot("final")  # its links outlive the deleted snapshot
    assert emb.export()[0].shape == (50,)
    emb.load_snapshot("step-2")
    np.testing.assert_array_equal(emb.export()[1], want[1])
    emb.close()


@pytest.mark.parametrize("store,engine", [("cached_ssd", "slots"), ("cached_ssd", "rocksdb"),
                                          ("device_mem", "slots")])
def test_final_costs_no_second_copy_of_the_table(tmp_path, store, engine):
    """A run's ``final`` right after its last ``step-N`` shares that checkpoint's data: deleting
    it frees only its own small files (manifest, trainer state), whatever the store."""
    import os

    from one_embedding.config import TrainConfig
    from one_embedding.store.rocksdb_store import tree_disk_bytes
    from one_embedding.store.snapshots import SnapshotDirectory
    from one_embedding.training import train

    path = tmp_path / "run"
    train(TrainConfig(steps=10, batch_size=256, synthetic_rows=20000, store=store, engine=engine,
                      cache_mb=0.25, persistent_path=str(path), snapshot_interval=10,
                      eval_batches=1), metrics_path=os.devnull, progress=False)
    snaps = SnapshotDirectory(str(path / "0-1"))
    assert {"final", "step-10"} <= set(snaps.names())
    with_final = tree_disk_bytes(str(path))
    trainer_bytes = tree_disk_bytes(os.path.join(snaps.path("final"), "trainer"))
    assert snaps.delete("final")
    freed = with_final - tree_disk_bytes(str(path))
    assert freed <= trainer_bytes + 64 * 1024, (freed, trainer_bytes, with_final)
