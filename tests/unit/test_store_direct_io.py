"""The slot engine's block I/O: O_DIRECT and the buffered fallback agree byte for byte, the
fallback warns once, rewrites of a segment's last block keep its earlier rows, writes never
read, parallel reads equal serial ones, snapshots of either path (and of the engines before the
segment format) load."""
import errno
import json
import os
import warnings

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.errors import StoreError
from one_embedding.store import direct_io
from one_embedding.store.direct_io import block_runs
from one_embedding.store.slot_file import SlotFileStore, block_layout
from one_embedding.store.snapshots import SnapshotDirectory
from one_embedding.training import train

import helpers
from helpers import TierProbe


def lines_for(keys, line_size, salt=0.0):
    """A line that encodes its key, so a row read back from the wrong slot is caught."""
    k = (np.asarray(keys, np.uint64) % np.uint64(1 << 20)).astype(np.float64)[:, None]
    salt = np.asarray(salt, np.float64).reshape(-1, 1) if np.ndim(salt) else salt
    return (k * 0.001 + np.arange(line_size) + salt).astype(np.float32)


@pytest.fixture
def disk(tmp_path):
    """A folder on a filesystem that takes O_DIRECT (tmp_path, or skip)."""
    probe = SlotFileStore(4, str(tmp_path / "probe"))
    direct = probe.direct_io
    probe.close()
    if not direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    return tmp_path


def refuse_o_direct(monkeypatch):
    """Make open(O_DIRECT) fail with EINVAL, as tmpfs does."""
    real = direct_io._open

    def fake(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, mode)

    monkeypatch.setattr(direct_io, "_open", fake)


def workload(store, rng, n_keys=3000, rounds=6):
    """Inserts, overwrites of random subsets (mostly partial blocks) and finds; returns what each
    find saw. Keys: a permutation of spread uint64s."""
    keys = rng.permutation(np.unique(rng.integers(0, 2**64 - 1, n_keys + 100, dtype=np.uint64))[:n_keys])
    seen = []
    store.insert_or_assign(keys[:n_keys // 2], lines_for(keys[:n_keys // 2], store.line_size))
    for r in range(rounds):
        subset = rng.choice(n_keys, n_keys // 3, replace=False)
        store.insert_or_assign(keys[subset], lines_for(keys[subset], store.line_size, salt=r + 1.0))
        probe = keys[rng.choice(n_keys, 500, replace=False)]
        seen.append(store.find(probe))
    return keys, seen


def snapshot_files(store, name="snap"):
    """Save ``store`` as snapshot ``name`` under its folder; returns (folder, {file: bytes}) of
    the snapshot's own files and of every segment file it lists."""
    snaps = SnapshotDirectory(store.directory)
    snaps.save(name, store.save_snapshot, {})
    folder = snaps.path(name)
    files = {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
             if f != "manifest.json"}  # the manifest holds a time stamp
    layout = json.loads(files["slots.json"])
    for seg in layout["segments"]:
        for kind in ("rows", "keys"):
            fname = f"{seg['id']:016x}.{kind}"
            files[fname] = open(os.path.join(folder, layout["pool"], fname), "rb").read()
    return folder, files


# ---------------------------------------------------------------- the two I/O paths agree
@pytest.mark.parametrize("line_size", [5, 32, 1100])
def test_direct_and_buffered_give_identical_reads_writes_and_snapshots(line_size, disk):
    direct = TierProbe(SlotFileStore(line_size, str(disk / "d")))
    buffered = TierProbe(SlotFileStore(line_size, str(disk / "b"), direct_io=False))
    assert direct.direct_io and not buffered.direct_io
    _, seen_d = workload(direct, np.random.default_rng(3))
    _, seen_b = workload(buffered, np.random.default_rng(3))
    for (found_d, got_d), (found_b, got_b) in zip(seen_d, seen_b):
        np.testing.assert_array_equal(found_d, found_b)
        np.testing.assert_array_equal(got_d, got_b)
    snap_d, files_d = snapshot_files(direct)
    _, files_b = snapshot_files(buffered)
    assert "slots.json" in files_d and any(f.endswith(".rows") for f in files_d)
    assert files_d == files_b  # byte for byte, every segment's rows and keys included
    # and a snapshot of one path loads into the other
    buffered.load_snapshot(snap_d)
    exported_b = list(buffered.export_batches())
    exported_d = list(direct.export_batches())
    for (kd, ld), (kb, lb) in zip(exported_d, exported_b):
        np.testing.assert_array_equal(kd, kb)
        np.testing.assert_array_equal(ld, lb)
    direct.close()
    buffered.close()


@pytest.mark.parametrize("find_between_writes", [False, True])
def test_rows_read_back_equal_a_model_of_the_table(find_between_writes, disk):
    """Many rounds of overwrites: garbage piles up in sealed segments until compaction appends
    their live rows again and retires them; every key reads back its newest line throughout,
    and the live segments stay within the garbage bound."""
    line_size = 32  # 128 B rows: 32 to a 4 KiB block
    store = TierProbe(SlotFileStore(line_size, str(disk), segment_rows=2048))
    rng = np.random.default_rng(0)
    n = 20_000
    keys = np.arange(n, dtype=np.uint64) * np.uint64(7919)
    salt = np.zeros(n)
    store.insert_or_assign(keys, lines_for(keys, line_size))
    for r in range(1, 40):
        subset = np.sort(rng.choice(n, int(rng.integers(50, 3000)), replace=False))
        salt[subset] = r
        store.insert_or_assign(keys[subset], lines_for(keys[subset], line_size, salt=r))
        if find_between_writes:
            probe = rng.choice(n, 2000, replace=False)
            found, got = store.find(keys[probe])
            assert found.all()
            np.testing.assert_array_equal(got, lines_for(keys[probe], line_size, salt[probe]))
        d = store.describe()
        # garbage above the ratio only until the next write compacts (plus the active segment)
        assert d["garbage_rows"] <= 0.3 * d["slots_total"] + 2048
    d = store.describe()
    assert d["compactions"] > 0 and d["compacted_rows"] > 0 and d["deleted_segments"] > 0
    found, got = store.find(keys)
    assert found.all()
    np.testing.assert_array_equal(got, lines_for(keys, line_size, salt))
    store.close()


def test_rewrites_of_the_last_block_keep_its_earlier_rows(disk):
    """Small batches share blocks: each write rewrites the segment's partly filled last block
    with the rows it held. The bytes on disk agree with the directory."""
    line_size = 16  # 64 B rows, 64 to a block
    store = SlotFileStore(line_size, str(disk))
    rpb = store.rows_per_block
    keys = np.arange(rpb * 5 + 11, dtype=np.uint64)
    for start in range(0, keys.shape[0], 7):  # 7 rows at a time: most writes end mid-block
        store.insert_or_assign(keys[start:start + 7], lines_for(keys[start:start + 7], line_size))
    every_third = keys[::3]
    store.insert_or_assign(every_third, lines_for(every_third, line_size, salt=5.0))
    want = lines_for(keys, line_size)
    want[::3] = lines_for(every_third, line_size, salt=5.0)
    out = np.empty((keys.shape[0], line_size), np.float32)
    assert store.find(keys, out, np.arange(keys.shape[0])).shape[0] == 0
    np.testing.assert_array_equal(out, want)
    locs = store._index.find(keys, store._keys_of)
    seg, slot = store._split(locs)
    for key, s_, sl in zip(keys[::5], seg[::5], slot[::5]):
        raw = np.fromfile(store.pool.path(store._segments[int(s_)].id, "rows"), np.uint8)
        start = (sl // rpb) * store.block_bytes + (sl % rpb) * 4 * line_size
        np.testing.assert_array_equal(raw[start:start + 4 * line_size].view(np.float32),
                                      want[int(key)])
    store.close()


def test_writes_never_read(disk):
    """Rows are appended, never updated in place: overwriting every key reads no block and
    writes one block per rows_per_block rows."""
    store = SlotFileStore(32, str(disk))
    keys = np.arange(32 * 100, dtype=np.uint64)
    store.insert_or_assign(keys, lines_for(keys, 32))
    before = dict(store.io_counts)
    store.insert_or_assign(keys, lines_for(keys, 32, salt=1.0))
    assert store.io_counts["read_blocks"] == before["read_blocks"]
    assert store.io_counts["written_blocks"] - before["written_blocks"] <= 100 + 1
    store.close()


# ---------------------------------------------------------------- parallel reads
def test_parallel_reads_equal_serial_reads(disk):
    line_size = 24
    store = SlotFileStore(line_size, str(disk), io_threads=16)
    rng = np.random.default_rng(1)
    keys = rng.permutation(np.arange(50_000, dtype=np.uint64) * np.uint64(31))
    for s in range(0, keys.shape[0], 7000):
        store.insert_or_assign(keys[s:s + 7000], lines_for(keys[s:s + 7000], line_size, salt=s))
    probe = np.concatenate([rng.choice(keys, 9000, replace=False), np.array([5, 7], np.uint64)])
    results = {}
    for threads in (16, 1, 3):
        store.io_threads = threads
        out = np.full((probe.shape[0], line_size), -1.0, np.float32)
        missing = store.find(probe, out, np.arange(probe.shape[0]))
        results[threads] = (missing, out)
    for threads in (1, 3):
        np.testing.assert_array_equal(results[threads][0], results[16][0])
        np.testing.assert_array_equal(results[threads][1], results[16][1])
    assert results[16][0].tolist() == [9000, 9001]
    store.close()


def test_block_runs_merge_neighbours_and_split_long_runs():
    blocks = np.array([1, 2, 3, 4, 5, 9, 10, 20, 21, 22, 23, 24, 25, 26], np.int64)
    starts, stops = block_runs(blocks, np.arange(blocks.shape[0]), max_run=3)
    assert list(zip(starts.tolist(), stops.tolist())) == [(0, 3), (3, 5), (5, 7), (7, 10), (10, 13),
                                                          (13, 14)]
    # adjacent on disk but not in the buffer: separate calls
    starts, _ = block_runs(np.array([4, 5, 6], np.int64), np.array([0, 2, 3], np.int64), 8)
    assert starts.tolist() == [0, 1]
    assert block_runs(np.empty(0, np.int64), np.empty(0, np.int64), 4)[0].shape == (0,)


# ---------------------------------------------------------------- fallback
def test_fallback_warns_once_and_works(tmp_path, monkeypatch):
    refuse_o_direct(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TierProbe(SlotFileStore(8, str(tmp_path)))
        keys = np.arange(5000, dtype=np.uint64)
        store.insert_or_assign(keys, lines_for(keys, 8))
        store.insert_or_assign(keys[::2], lines_for(keys[::2], 8, salt=1.0))
        found, got = store.find(keys)
        store.close()
        again = SlotFileStore(8, str(tmp_path))  # the same path: no second warning
        again.close()
    assert not store.direct_io
    assert found.all()
    want = lines_for(keys, 8)
    want[::2] = lines_for(keys[::2], 8, salt=1.0)
    np.testing.assert_array_equal(got, want)
    mine = [w for w in caught if "O_DIRECT" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    text = str(mine[0].message)
    assert os.path.join(str(tmp_path), "slots", "segments") in text and "page cache" in text
    assert "\n" not in text


def test_tmpfs_falls_back_to_buffered_io():
    if not os.path.isdir("/dev/shm") or os.statvfs("/dev/shm").f_bsize == 0:
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        with open(os.path.join(folder, "t"), "wb"):
            pass
        try:
            os.close(os.open(os.path.join(folder, "t"), os.O_RDONLY | os.O_DIRECT))
            pytest.skip("/dev/shm takes O_DIRECT here")
        except OSError:
            pass
        with pytest.warns(RuntimeWarning, match="page cache"):
            store = SlotFileStore(8, folder)
        assert not store.direct_io
        keys = np.arange(300, dtype=np.uint64)
        store.insert_or_assign(keys, lines_for(keys, 8))
        out = np.empty((300, 8), np.float32)
        assert store.find(keys, out, np.arange(300)).shape[0] == 0
        np.testing.assert_array_equal(out, lines_for(keys, 8))
        store.close()


def test_forced_buffered_io_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = SlotFileStore(8, str(tmp_path), direct_io=False)
    assert not store.direct_io and store.describe()["direct_io"] is False
    store.close()


# ---------------------------------------------------------------- failures and old snapshots
def test_a_failed_write_is_a_store_error_until_a_snapshot_is_loaded(disk, monkeypatch):
    store = TierProbe(SlotFileStore(8, str(disk / "p")))
    keys = np.arange(1000, dtype=np.uint64)
    store.insert_or_assign(keys, lines_for(keys, 8))
    snap, _ = snapshot_files(store)

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(direct_io, "_pwrite_runs", lambda *args: 0)  # the first run "fails"
    monkeypatch.setattr(direct_io.os, "pwritev", failing)
    with pytest.raises(StoreError, match="Input/output error"):
        store.insert_or_assign(keys[:10], lines_for(keys[:10], 8, salt=1.0))
    monkeypatch.undo()
    with pytest.raises(StoreError, match="load_snapshot"):
        store.find(keys)
    store.load_snapshot(snap)
    found, got = store.find(keys)
    assert found.all()
    np.testing.assert_array_equal(got, lines_for(keys, 8))
    store.close()


def write_snapshot_of_the_mmap_engine(folder, keys, lines, physical_block_size=4096):
    """A snapshot as the engine wrote it before O_DIRECT: slots dense in insertion order, the
    used blocks of rows.bin, keys and slots sorted by key."""
    line_size = lines.shape[1]
    rpb, block_bytes = block_layout(line_size, physical_block_size)
    n = keys.shape[0]
    slots = np.arange(n, dtype=np.int64)
    n_blocks = -(-n // rpb)
    raw = np.zeros((n_blocks, block_bytes), np.uint8)
    view = np.ndarray((n_blocks, rpb, line_size), np.float32, buffer=raw,
                      strides=(block_bytes, 4 * line_size, 4))
    view[slots // rpb, slots % rpb] = lines
    os.makedirs(folder)
    order = np.argsort(keys)
    np.save(os.path.join(folder, "keys.npy"), keys[order])
    np.save(os.path.join(folder, "slots.npy"), slots[order])
    raw.tofile(os.path.join(folder, "rows.bin"))
    with open(os.path.join(folder, "layout.json"), "w") as f:
        json.dump({"engine": "slots", "line_size": line_size, "rows": n, "rows_per_block": rpb,
                   "block_bytes": block_bytes}, f)


@pytest.mark.parametrize("direct", [True, False])
def test_a_snapshot_of_the_mmap_engine_still_loads(direct, disk):
    keys = np.arange(3, 9003, dtype=np.uint64) * np.uint64(101)
    lines = lines_for(keys, 20, salt=0.5)
    write_snapshot_of_the_mmap_engine(str(disk / "old"), keys, lines)
    store = TierProbe(SlotFileStore(20, str(disk / "p"), direct_io=direct))
    store.load_snapshot(str(disk / "old"))
    assert len(store) == keys.shape[0]
    found, got = store.find(keys)
    assert found.all()
    np.testing.assert_array_equal(got, lines)
    # the restored table takes writes into its free slots and keeps the rest
    store.insert_or_assign(keys[::5], lines_for(keys[::5], 20, salt=9.0))
    new = np.arange(10, dtype=np.uint64) + np.uint64(1)
    store.insert_or_assign(new, lines_for(new, 20))
    found, got = store.find(keys)
    want = lines.copy()
    want[::5] = lines_for(keys[::5], 20, salt=9.0)
    np.testing.assert_array_equal(got, want)
    store.close()


def test_training_final_record_keeps_per_tier_store_stats(tmp_path):
    cfg = TrainConfig(store="cached_ssd", persistent_path=str(tmp_path), cache_mb=0.05,
                                steps=4, batch_size=256, synthetic_rows=20_000, eval_batches=1)
    final = train(cfg, metrics_path=os.devnull, progress=False)
    stats = final["store_stats"]
    assert all({"tier", "hits", "misses"} <= set(s) for s in stats)
    ssd = [s for s in stats if "ssd" in s["tier"]]
    assert len(ssd) == 1 and ssd[0]["hits"] + ssd[0]["misses"] > 0
    assert isinstance(ssd[0]["direct_io"], bool)


def resident_pages(path):
    """Pages of ``path`` in the page cache now (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    mapped = np.frombuffer(mm, np.uint8)
    vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    try:
        if libc.mincore(ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(size),
                        ctypes.c_void_p(vec.ctypes.data)) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return int(np.count_nonzero(vec & 1))
    finally:
        del mapped
        mm.close()


@pytest.mark.parametrize("direct", [True, False])
def test_the_page_cache_holds_the_rows_only_on_the_buffered_path(direct, disk):
    store = SlotFileStore(32, str(disk), direct_io=direct)
    keys = np.arange(50_000, dtype=np.uint64)
    store.insert_or_assign(keys, lines_for(keys, 32))
    out = np.empty((keys.shape[0], 32), np.float32)
    store.find(keys, out, np.arange(keys.shape[0]))
    rows_files = [store.pool.path(s.id, "rows") for s in store._segments.values()]
    resident = sum(resident_pages(p) for p in rows_files)
    SnapshotDirectory(store.directory).save("s", store.save_snapshot, {})  # reads no row
    after_snapshot = sum(resident_pages(p) for p in rows_files)
    store.close()
    if direct:
        assert resident == 0 and after_snapshot == 0
    else:
        assert resident >= 50_000 * 128 // 4096


@pytest.mark.slow
def test_bench_ssd_runs_and_reports_the_ratio(disk):
    import json
    import subprocess
    import sys

    root = helpers.ROOT
    env = {**os.environ, "ONE_EMBEDDING_BENCH_RESULTS": str(disk),
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_ssd", "--keys", "60000",
                        "--steps", "6", "--rounds", "2", "--seconds", "0.3", "--raw-mb", "32",
                        "--prefill-batch", "1024", "--find-batch", "1024", "--dir", str(disk)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "machine:" in r.stdout and "raw random 4 KiB O_DIRECT reads" in r.stdout
    data = json.loads((disk / "bench_ssd.json").read_text())
    assert data["training_ratio"] > 0 and data["training"]["ssd_hits"] > 0
    assert "ssd" in data["training"]["ssd_tier"]
