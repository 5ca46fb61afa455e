"""On-disk formats of older and newer versions: read correctly, or refused with a clear reason,
never read as something else (an empty table, a damaged snapshot)."""
import hashlib
import json
import os

import numpy as np
import pytest

from one_embedding.errors import SnapshotError
from one_embedding.store.rocksdb_store import INFO_FILE, RocksDBStore, encode_keys

LINE = 6


def _rows(n=700, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(1 << 40, size=n, replace=False).astype(np.uint64)
    return keys, rng.standard_normal((n, LINE)).astype(np.float32)


def _legacy_rocksdb_snapshot(folder, keys, lines):
    """A snapshot as one_embedding left it before the keys column family (28be611): a RocksDB
    checkpoint whose default column family maps 8-byte big-endian keys to the raw float32 line,
    and a rocksdb.json without a format field."""
    import rocksdict as rd
    work = os.path.join(os.path.dirname(folder), "legacy-work")
    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rd.Rdict(work, opts)
    batch = rd.WriteBatch(raw_mode=True)
    raw = lines.tobytes()
    for i, k in enumerate(encode_keys(keys)):
        batch.put(k, raw[i * 4 * LINE:(i + 1) * 4 * LINE])
    db.write(batch)
    db.flush()
    os.makedirs(folder)
    rd.Checkpoint(db).create_checkpoint(os.path.join(folder, "db"))
    db.close()
    assert rd.Rdict.list_cf(os.path.join(folder, "db")) == ["default"]
    files = {e: os.path.getsize(os.path.join(folder, "db", e))
             for e in sorted(os.listdir(os.path.join(folder, "db")))}
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        json.dump({"engine": "rocksdb", "line_size": LINE, "rows": len(keys), "db_files": files}, f)


def _digest(folder):
    out = {}
    for d, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _read_all(store):
    parts = list(store.export_batches())
    keys = np.concatenate([k for k, _ in parts]) if parts else np.empty(0, np.uint64)
    lines = np.concatenate([v for _, v in parts]) if parts else np.empty((0, LINE), np.float32)
    return keys, lines


def test_a_rocksdb_snapshot_without_the_keys_column_family_loads_every_row_bit_for_bit(tmp_path):
    keys, lines = _rows()
    snap = str(tmp_path / "snap")
    _legacy_rocksdb_snapshot(snap, keys, lines)
    before = _digest(snap)
    store = RocksDBStore(LINE, str(tmp_path / "store"))
    try:
        store.load_snapshot(snap)
        assert len(store) == len(keys)
        got_keys, got = _read_all(store)
        order = np.argsort(keys)
        np.testing.assert_array_equal(got_keys, keys[order])
        np.testing.assert_array_equal(got.view(np.uint32), lines[order].view(np.uint32))
        out = np.zeros((len(keys), LINE), np.float32)
        assert store.find(keys, out, np.arange(len(keys))).size == 0
        np.testing.assert_array_equal(out.view(np.uint32), lines.view(np.uint32))
        # writes count exactly afterwards (the keys are listed), and a save is the new format
        store.insert_or_assign(np.array([keys[0], 7], np.uint64), np.ones((2, LINE), np.float32))
        assert len(store) == len(keys) + 1
        os.makedirs(tmp_path / "resaved")
        store.save_snapshot(str(tmp_path / "resaved"))
    finally:
        store.close()
    assert _digest(snap) == before  # the user's snapshot is never written
    with open(tmp_path / "resaved" / INFO_FILE) as f:
        assert json.load(f)["format"] == 2
    again = RocksDBStore(LINE, str(tmp_path / "store2"))
    try:
        again.load_snapshot(str(tmp_path / "resaved"))
        assert len(again) == len(keys) + 1
    finally:
        again.close()


def _head_snapshot(tmp_path, name="head"):
    keys, lines = _rows(300)
    store = RocksDBStore(LINE, str(tmp_path / "w"))
    try:
        store.insert_or_assign(keys, lines)
        os.makedirs(tmp_path / name)
        store.save_snapshot(str(tmp_path / name))
    finally:
        store.close()
    return str(tmp_path / name), keys


def _edit_info(folder, **changes):
    path = os.path.join(folder, INFO_FILE)
    with open(path) as f:
        info = json.load(f)
    for k, v in changes.items():
        if v is None:
            info.pop(k, None)
        else:
            info[k] = v
    with open(path, "w") as f:
        json.dump(info, f)


def test_a_rocksdb_snapshot_of_a_newer_format_is_refused_as_newer(tmp_path):
    snap, _ = _head_snapshot(tmp_path)
    _edit_info(snap, format=3)
    store = RocksDBStore(LINE, str(tmp_path / "store"))
    try:
        with pytest.raises(SnapshotError, match=r"newer one_embedding \(rocksdb format 3"):
            store.load_snapshot(snap)
    finally:
        store.close()


def test_a_rocksdb_snapshot_without_format_whose_keys_disagree_with_its_rows_is_refused(tmp_path):
    """An older version writing into a current-layout DB added rows its keys family never
    listed (500 of 1000 rows were read): without a format field the counts tell."""
    snap, keys = _head_snapshot(tmp_path)
    _edit_info(snap, format=None)
    store = RocksDBStore(LINE, str(tmp_path / "store"))
    try:
        store.load_snapshot(snap)  # a current layout from before the format field: fine
        assert len(store) == len(keys)
        _edit_info(snap, rows=2 * len(keys))
        with pytest.raises(SnapshotError, match="older one_embedding"):
            store.load_snapshot(snap)
    finally:
        store.close()


def test_a_serve_follower_reads_the_segments_of_a_format_2_slots_snapshot(tmp_path):
    """slots.json format 2 names no block checksum (the legacy one): the follower's refresh
    read its entries as format 3 and raised 'a segment entry ... is malformed' at every poll."""
    from types import SimpleNamespace

    from one_embedding.serving.predictor import _segment_infos
    from one_embedding.store.segments import LEGACY_BLOCK_CHECKSUM

    entry = {"id": 5, "slots": 256, "rows_bytes": 4096, "rows_crc32": 1, "keys_crc32": 2,
             "sums_crc32": 3, "dead": 0, "dead_crc32": 0}
    with open(tmp_path / "slots.json", "w") as f:
        json.dump({"engine": "slots", "format": 2, "line_size": LINE, "pool": "../../segments",
                   "segments": [entry]}, f)
    rows = SimpleNamespace(store=SimpleNamespace(pool=object()))
    (info,) = _segment_infos(rows, str(tmp_path))
    assert (info.id, info.slots, info.block_checksum) == (5, 256, LEGACY_BLOCK_CHECKSUM)


def _run_with_newer_checkpoint(tmp_path):
    """A run folder whose only checkpoint a newer one_embedding wrote (manifest format_version
    2, sealed as that version would seal it)."""
    import one_embedding as oe
    from one_embedding.store.snapshots import MANIFEST, _manifest_crc

    path = tmp_path / "run"
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.05, 0.05))]
    store = oe.make_cached_ssd_store_options(0.01, str(path), size_factor=2, engine="rocksdb")
    emb = oe.MultiTableEmbedding("r", 4, np.float32, np.int64, tables, store)
    emb(np.arange(8, dtype=np.int64).reshape(-1, 1))
    emb.save_snapshot("step-10")
    emb.close()
    mpath = path / "0-1" / "snapshots" / "step-10" / MANIFEST
    with open(mpath) as f:
        m = json.load(f)
    m["format_version"] = 2
    m["checkpoint"] = {"step": 10}
    m.pop("manifest_crc32", None)
    m["manifest_crc32"] = _manifest_crc(m)
    with open(mpath, "w") as f:
        json.dump(m, f)
    return str(path)


def test_a_checkpoint_of_a_newer_version_is_called_newer_never_damaged_or_absent(tmp_path):
    from one_embedding.checkpoint import checkpoints, why_no_checkpoint
    from one_embedding.inspect_snapshot import inspect_path
    from one_embedding.serving import Predictor

    path = _run_with_newer_checkpoint(tmp_path)
    newer = r"newer one_embedding \(format 2; this version reads 1\): upgrade"
    # resume (newest_checkpoint / why_no_checkpoint go through checkpoints()): never "no
    # complete checkpoint ... --overwrite", which would delete the newer version's checkpoints
    with pytest.raises(SnapshotError, match=newer):
        checkpoints(os.path.join(path, "0-1"))
    with pytest.raises(SnapshotError, match=newer):
        why_no_checkpoint(path)
    with pytest.raises(SnapshotError, match=newer):
        Predictor(path, cache_mb=1, scratch=str(tmp_path / "scratch"))
    (found,) = inspect_path(path)
    assert found["status"] == "newer" and "upgrade" in found["error"]


def _format1_slots_run(tmp_path):
    """A slots run whose snapshot 's' has the format-1 layout (2bf9b1a and before): layout.json,
    keys.npy, slots.npy and a copy of rows.bin in the snapshot folder, no slots.json."""
    import one_embedding as oe
    from one_embedding.store.snapshots import MANIFEST, _manifest_crc

    path = tmp_path / "run"
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.05, 0.05))]
    store = oe.make_cached_ssd_store_options(0.01, str(path), size_factor=2, engine="slots")
    emb = oe.MultiTableEmbedding("r", 4, np.float32, np.int64, tables, store)
    emb.save_snapshot("s")
    emb.close()
    folder = path / "0-1" / "snapshots" / "s"
    with open(folder / MANIFEST) as f:
        m = json.load(f)
    line, n, block = m["line_size"], 40, 4096
    rpb = block // (4 * line)
    keys = np.arange(100, 100 + n, dtype=np.uint64)
    slots = np.arange(n, dtype=np.uint64)[::-1].copy()  # rows stored out of key order
    lines = np.random.default_rng(0).standard_normal((n, line)).astype(np.float32)
    rows = np.zeros((-(-n // rpb) * rpb, line), np.float32)
    rows[slots.astype(np.int64)] = lines
    os.remove(folder / "slots.json")
    np.save(folder / "keys.npy", keys)
    np.save(folder / "slots.npy", slots)
    rows.tofile(folder / "rows.bin")
    with open(folder / "layout.json", "w") as f:
        json.dump({"engine": "slots", "line_size": line, "rows": n, "rows_per_block": rpb,
                   "block_bytes": block}, f)
    import zlib
    m["files"] = {}
    for name in ("keys.npy", "layout.json", "rows.bin", "slots.npy"):
        data = (folder / name).read_bytes()
        m["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    m["row_count"] = n
    m.pop("manifest_crc32", None)
    m["manifest_crc32"] = _manifest_crc(m)
    with open(folder / MANIFEST, "w") as f:
        json.dump(m, f)
    return str(path), keys, lines


@pytest.mark.parametrize("quick", [False, True])
def test_inspect_reads_a_format_1_slots_snapshot_as_load_does(tmp_path, quick):
    from one_embedding.inspect_snapshot import inspect_path

    path, keys, lines = _format1_slots_run(tmp_path)
    (found,) = inspect_path(path, rows=5, quick=quick)
    assert found["status"] == "ok", found.get("error")
    assert found["row_count"] == len(keys)
    assert [r["key"] for r in found["rows"]] == keys[:5].tolist()
    np.testing.assert_allclose([r["embedding"] + r["state"] for r in found["rows"]],
                               np.round(lines[:5], 6), atol=1e-6)
    # damage to the format-1 files is still found (the manifest's CRC32s of the folder's files)
    with open(os.path.join(path, "0-1", "snapshots", "s", "rows.bin"), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    (found,) = inspect_path(path, quick=quick)
    assert found["status"] == "damaged" and "rows.bin" in found["error"]


def test_inspect_names_a_newer_versions_checkpoint_on_stderr_and_exits_1(tmp_path, capsys):
    from one_embedding import cli

    path = _run_with_newer_checkpoint(tmp_path)
    assert cli.main(["inspect", path]) == 1   # a script sees it cannot be read here
    err = capsys.readouterr().err
    assert "inspect: written by a newer version:" in err and "upgrade" in err


def test_a_checkpoint_with_its_losses_in_json_resumes_as_one_with_them_binary(tmp_path):
    """Checkpoints before the losses went binary (state/losses in arrays.npz) kept them as a JSON
    list in state.json's progress: such a run resumes to the same final record."""
    import io
    import os

    from one_embedding.config import TrainConfig
    from one_embedding.store.durable import file_crc32
    from one_embedding.store.snapshots import MANIFEST, _manifest_crc
    from one_embedding.training import Trainer

    tiny = dict(batch_size=128, synthetic_rows=4_000, synthetic_scale=0.001, eval_batches=2,
                snapshot_interval=4)

    def run(path, steps, resume=False):
        cfg = TrainConfig(steps=steps, persistent_path=str(path), resume=resume, **tiny)
        return Trainer(cfg, metrics_path=os.devnull, progress=False).run()

    want = run(tmp_path / "whole", 8)
    run(tmp_path / "old", 4)
    folder = tmp_path / "old" / "0-1" / "snapshots" / "final"
    trainer = folder / "trainer"
    state = json.loads((trainer / "state.json").read_text())
    with np.load(trainer / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    state["state"]["progress"]["losses"] = arrays.pop("state/losses").tolist()
    (trainer / "state.json").write_text(json.dumps(state))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (trainer / "arrays.npz").write_bytes(buffer.getvalue())
    with open(folder / MANIFEST) as f:
        m = json.load(f)
    for rel in ("trainer/state.json", "trainer/arrays.npz"):
        m["files"][rel] = {"bytes": os.path.getsize(folder / rel),
                           "crc32": file_crc32(str(folder / rel))}
    m["manifest_crc32"] = _manifest_crc(m)
    (folder / MANIFEST).write_text(json.dumps(m))
    got = run(tmp_path / "old", 8, resume=True)
    for key in ("loss_first_10pct", "loss_last_10pct", "auc", "logloss", "samples"):
        assert got[key] == want[key], key
