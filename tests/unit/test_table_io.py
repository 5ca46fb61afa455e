"""OneFlow's persistent table writer / reader: writer -> load_snapshot -> export gives back what
was written (both engines, every store, one and two rank folders, re-sharded on load), the reader
round trip, duplicates, atomic publication, and clear errors for bad input."""
import os

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.embedding import keys_as_uint64
from one_embedding.parallel.shuffle import owner_rank
from one_embedding.shard import EmbeddingShard
from one_embedding.step import LineLayout

E = 4


def rows(n, storage_dim=2 * E, seed=0, key_high=10**12):
    """n distinct int64 keys and (n, storage_dim) float32 lines: embedding columns normal, the
    rest (optimizer state, e.g. Adagrad's accumulator) positive."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(key_high, size=n, replace=False).astype(np.int64)
    lines = rng.standard_normal((n, storage_dim)).astype(np.float32)
    lines[:, E:] = np.abs(lines[:, E:])
    return keys, lines


def by_key(keys, lines):
    order = np.argsort(keys, kind="stable")
    return keys[order], lines[order]


def store_options(kind, path, engine="slots", size_factor=2, **kw):
    if kind == "device_mem":
        return oe.make_device_mem_store_options(str(path), capacity=10_000, size_factor=size_factor, **kw)
    return oe.make_cached_ssd_store_options(0.01, str(path), size_factor=size_factor, engine=engine, **kw)


def embedding(path, kind="device_mem", engine="slots", dim=E, size_factor=2, key_type=np.int64, **kw):
    return oe.MultiTableEmbedding("t", dim, np.float32, key_type, None,
                                  store_options(kind, path, engine, size_factor, **kw))


def write(paths, name, keys, lines, engine="slots", key_type=np.int64, **kw):
    kw.setdefault("embedding_dims", [E])
    with oe.make_persistent_table_writer(paths, name, key_type, np.float32, lines.shape[1],
                                         engine=engine, **kw) as w:
        w.write(keys, lines)
    return w


def read_all(paths, name, storage_dim=2 * E, key_type=np.int64, **kw):
    with oe.make_persistent_table_reader(paths, name, key_type, np.float32, storage_dim, **kw) as r:
        parts = list(r)
    keys = np.concatenate([k for k, _ in parts])
    return keys, np.concatenate([v for _, v in parts]), len(parts)


# ---------------------------------------------------------------- writer -> load_snapshot


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
@pytest.mark.parametrize("kind, store_engine", [("device_mem", None), ("cached_ssd", "slots"),
                                                ("cached_ssd", "rocksdb")])
def test_written_rows_load_into_every_store_and_export_unchanged(engine, kind, store_engine, tmp_path):
    keys, lines = rows(500)
    write([tmp_path / "0-1"], "pretrained", keys, lines, engine=engine)
    emb = embedding(tmp_path, kind, store_engine or "slots")
    manifest = emb.load_snapshot("pretrained")
    assert manifest["engine"] == f"ssd.{engine}" and manifest["row_count"] == 500
    got_keys, got_lines = emb.export()
    want_keys, want_lines = by_key(keys_as_uint64(keys, np.dtype(np.int64)), lines)
    np.testing.assert_array_equal(got_keys, want_keys)
    assert np.array_equal(got_lines.view(np.uint32), want_lines.view(np.uint32))
    # the rows are served, and trained from: an Adagrad step reads the zero state written
    out = emb(keys[:3])
    np.testing.assert_array_equal(out, lines[:3, :E])
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    emb.backward(np.ones_like(out))
    opt.step()
    assert not np.array_equal(emb(keys[:3]), out)
    emb.close()


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_two_rank_folders_hold_their_owners_keys_and_load_at_world_1(engine, tmp_path):
    keys, lines = rows(800, seed=1)
    paths = [tmp_path / "0-2", tmp_path / "1-2"]
    w = write(paths, "pre", keys, lines, engine=engine)
    assert w.rows_written == 800 and w.replaced == 0
    owners = owner_rank(keys_as_uint64(keys, np.dtype(np.int64)), 2)
    for rank, folder in enumerate(paths):
        got_keys, got_lines, _ = read_all([folder], "pre")
        want_keys, want_lines = by_key(keys[owners == rank], lines[owners == rank])
        np.testing.assert_array_equal(np.sort(got_keys), want_keys)
        assert 0 < got_keys.shape[0] < 800
    # one process, persistent_path = the parent: re-sharded from the two folders
    emb = embedding(tmp_path, "cached_ssd", engine)
    emb.load_snapshot("pre")
    got_keys, got_lines = emb.export()
    want_keys, want_lines = by_key(keys_as_uint64(keys, np.dtype(np.int64)), lines)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_lines, want_lines)
    emb.close()


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_each_rank_of_two_loads_its_folder_directly(engine, tmp_path):
    keys, lines = rows(600, seed=2)
    write([tmp_path / "0-2", tmp_path / "1-2"], "pre", keys, lines, engine=engine)
    internal = keys_as_uint64(keys, np.dtype(np.int64))
    layout = LineLayout.from_store_options((E,), store_options("cached_ssd", tmp_path, engine))
    tables = [oe.make_table_options(oe.make_constant_initializer(0.0))]
    for rank in range(2):
        shard = EmbeddingShard("t", layout, tables, 0, store_options("cached_ssd", tmp_path, engine),
                               rank, 2)
        try:
            shard.load_snapshot("pre", {"key_type": "int64"})
            got_keys, got_lines = shard.export()
        finally:
            shard.close()
        mine = owner_rank(internal, 2) == rank
        want_keys, want_lines = by_key(internal[mine], lines[mine])
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(got_lines, want_lines)


def test_multi_column_embedding_dims_and_storage_dim_option(tmp_path):
    keys, lines = rows(50, storage_dim=12)
    write([tmp_path / "0-1"], "pre", keys, lines, embedding_dims=[3, 1])
    tables = [oe.make_table_options([oe.make_column_options(oe.make_normal_initializer())] * 2)]
    store = oe.make_device_mem_store_options(str(tmp_path), capacity=100, storage_dim=12)
    with oe.MultiTableMultiColumnEmbedding("t", [3, 1], np.float32, np.int64, tables, store) as emb:
        emb.load_snapshot("pre")
        np.testing.assert_array_equal(emb(keys), lines[:, :4])


def test_default_embedding_dims_is_the_whole_line(tmp_path):
    keys, lines = rows(20, storage_dim=E)
    with oe.make_persistent_table_writer([tmp_path / "0-1"], "pre", "int64", "float32", E) as w:
        w.write(keys, lines)
    with embedding(tmp_path, dim=E, size_factor=1) as emb:
        emb.load_snapshot("pre")
        np.testing.assert_array_equal(emb(keys), lines)
    # OneFlow's exact arguments: storage_dim equal to an Adagrad embedding's line size loads
    with oe.make_persistent_table_writer([tmp_path / "other" / "0-1"], "pre", np.int64,
                                         np.float32, E) as w:
        w.write(keys, lines)
    with embedding(tmp_path / "other", dim=E // 2, size_factor=2) as emb:
        emb.load_snapshot("pre")
        np.testing.assert_array_equal(emb(keys), lines[:, :E // 2])
    # told its columns, the writer records them and a different split is refused, by name
    with oe.make_persistent_table_writer([tmp_path / "told" / "0-1"], "pre", np.int64,
                                         np.float32, E, embedding_dims=E) as w:
        w.write(keys, lines)
    with embedding(tmp_path / "told", dim=E // 2, size_factor=2) as emb:
        with pytest.raises(oe.SnapshotError, match="embedding_dims"):
            emb.load_snapshot("pre")
    # a storage_dim other than the line size is refused, naming line_size
    with embedding(tmp_path / "other", dim=E, size_factor=2) as emb:
        with pytest.raises(oe.SnapshotError, match="line_size"):
            emb.load_snapshot("pre")


def test_other_physical_block_size_is_repacked_on_load(tmp_path):
    keys, lines = rows(300, storage_dim=2 * E)
    write([tmp_path / "0-1"], "pre", keys, lines, physical_block_size=512)
    with embedding(tmp_path, "cached_ssd", "slots") as emb:
        emb.load_snapshot("pre")
        got_keys, got_lines = emb.export()
    np.testing.assert_array_equal(got_lines, by_key(keys_as_uint64(keys, np.dtype(np.int64)),
                                                    lines)[1])


@pytest.mark.parametrize("key_type", [np.int32, np.uint32, np.int64, np.uint64])
def test_key_types_round_trip_through_an_embedding(key_type, tmp_path):
    info = np.iinfo(key_type)
    keys = np.array([info.min, info.max, 0, 1, info.max // 3], dtype=key_type)
    keys = np.unique(keys)
    lines = np.arange(keys.shape[0] * 2 * E, dtype=np.float32).reshape(-1, 2 * E)
    write([tmp_path / "0-1"], "pre", keys, lines, key_type=key_type)
    with embedding(tmp_path, key_type=key_type) as emb:
        emb.load_snapshot("pre")
        np.testing.assert_array_equal(emb(keys), lines[:, :E])
    got_keys, got_lines, _ = read_all([tmp_path / "0-1"], "pre", key_type=key_type)
    assert got_keys.dtype == np.dtype(key_type)
    order = np.argsort(got_keys)
    np.testing.assert_array_equal(got_keys[order], keys)
    np.testing.assert_array_equal(got_lines[order], lines)


# ---------------------------------------------------------------- reader


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_reader_round_trip_in_batches(engine, tmp_path):
    keys, lines = rows(1000, seed=3)
    paths = [tmp_path / "0-2", tmp_path / "1-2"]
    write(paths, "pre", keys, lines, engine=engine)
    got_keys, got_lines, n_batches = read_all(paths, "pre", batch_rows=128, engine=engine)
    assert n_batches >= 1000 // 128
    assert np.unique(got_keys).shape[0] == 1000  # every key once
    order = np.argsort(got_keys)
    want_keys, want_lines = by_key(keys, lines)
    np.testing.assert_array_equal(got_keys[order], want_keys)
    np.testing.assert_array_equal(got_lines[order], want_lines)


def test_reader_exports_a_snapshot_an_embedding_saved(tmp_path):
    with embedding(tmp_path, "cached_ssd", "rocksdb") as emb:
        opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
        ids = np.arange(40).reshape(20, 2)
        emb.backward(np.ones_like(emb(ids)))
        opt.step()
        emb.save_snapshot("final")
        want_keys, want_lines = emb.export()
    with oe.make_persistent_table_reader([tmp_path / "0-1"], "final", np.int64, np.float32,
                                         2 * E) as reader:
        assert reader.manifests[0]["engine"] == "ssd.rocksdb"
        (keys, lines), = list(reader)
    np.testing.assert_array_equal(keys.view(np.uint64), want_keys)
    np.testing.assert_array_equal(lines, want_lines)


def test_reader_close_stops_early(tmp_path):
    keys, lines = rows(300)
    write([tmp_path / "0-1"], "pre", keys, lines)
    reader = oe.make_persistent_table_reader([tmp_path / "0-1"], "pre", np.int64, np.float32,
                                             2 * E, batch_rows=100)
    next(reader)
    reader.close()
    with pytest.raises(StopIteration):
        next(reader)


# ---------------------------------------------------------------- duplicates, atomicity, lock


def test_duplicate_keys_last_value_wins(tmp_path):
    keys = np.array([1, 2, 1, 3, 1], np.int64)
    lines = np.arange(5 * 2 * E, dtype=np.float32).reshape(5, 2 * E)
    with oe.make_persistent_table_writer([tmp_path / "0-1"], "pre", np.int64, np.float32, 2 * E,
                                         embedding_dims=E) as w:
        w.write(keys, lines)
        assert w.replaced == 2
        w.write(np.array([3]), np.full((1, 2 * E), 7.0))  # a later write replaces the row
        assert w.replaced == 3 and w.rows_written == 6
    got_keys, got_lines, _ = read_all([tmp_path / "0-1"], "pre")
    np.testing.assert_array_equal(got_keys, [1, 2, 3])
    np.testing.assert_array_equal(got_lines, np.stack([lines[4], lines[1], np.full(2 * E, 7.0)]))


def test_a_with_block_that_raises_publishes_nothing(tmp_path):
    keys, lines = rows(10)
    write([tmp_path / "0-1"], "pre", keys, lines)
    with pytest.raises(RuntimeError):
        with oe.make_persistent_table_writer([tmp_path / "0-1"], "pre", np.int64, np.float32,
                                             2 * E, embedding_dims=E) as w:
            w.write(keys, lines + 1)
            raise RuntimeError("boom")
    got_keys, got_lines, _ = read_all([tmp_path / "0-1"], "pre")
    np.testing.assert_array_equal(got_lines, by_key(keys, lines)[1])  # the older snapshot
    leftovers = [e for e in os.listdir(tmp_path / "0-1" / "snapshots") if e.startswith(".")]
    assert leftovers == []


def test_writer_and_embedding_exclude_each_other(tmp_path):
    emb = embedding(tmp_path)
    with pytest.raises(oe.LockedError):
        oe.make_persistent_table_writer([tmp_path / "0-1"], "pre", np.int64, np.float32, 2 * E)
    emb.close()
    w = oe.make_persistent_table_writer([tmp_path / "0-1"], "pre", np.int64, np.float32, 2 * E,
                                        embedding_dims=E)
    with pytest.raises(oe.LockedError):
        embedding(tmp_path)
    w.close()
    with embedding(tmp_path) as emb:
        assert emb.load_snapshot("pre")["row_count"] == 0


def test_scratch_of_a_dead_writer_is_removed_on_open(tmp_path):
    stale = tmp_path / "0-1" / "snapshots" / ".tmp-table-writer-dead"
    (stale / "slots").mkdir(parents=True)
    write([tmp_path / "0-1"], "pre", *rows(5))
    assert not stale.exists()


# ---------------------------------------------------------------- bad input


def writer(tmp_path, **kw):
    args = dict(paths=[tmp_path / "0-1"], snapshot_name="pre", key_type=np.int64,
                value_type=np.float32, storage_dim=2 * E)
    args.update(kw)
    return oe.make_persistent_table_writer(**args)


@pytest.mark.parametrize("kw, error, match", [
    (dict(paths="one/path"), oe.ConfigError, "list of per-rank"),
    (dict(paths=[]), oe.ConfigError, "empty"),
    (dict(paths=["a/1-2", "a/0-2"]), oe.ConfigError, "in rank order"),
    (dict(paths=["a/0-1", "a/0-1"]), oe.ConfigError, "twice"),
    (dict(paths=["a/0-1", "a/1-2"]), oe.ConfigError, "rank 0 of 1, but"),
    (dict(snapshot_name="../x"), oe.SnapshotError, "not allowed"),
    (dict(key_type=np.int16), oe.ConfigError, "key_type"),
    (dict(value_type=np.float16), oe.ConfigError, "float32"),
    (dict(storage_dim=0), oe.ConfigError, "storage_dim"),
    (dict(storage_dim=2.5), oe.ConfigError, "storage_dim"),
    (dict(physical_block_size=-1), oe.ConfigError, "physical_block_size"),
    (dict(engine="leveldb"), oe.ConfigError, "engine"),
    (dict(embedding_dims=[E, 2 * E]), oe.ConfigError, "do not fit"),
    (dict(embedding_dims=[0]), oe.ConfigError, "positive"),
])
def test_bad_writer_arguments(kw, error, match, tmp_path):
    if isinstance(kw.get("paths"), list):
        kw = dict(paths=[tmp_path / p for p in kw["paths"]])
    with pytest.raises(error, match=match):
        writer(tmp_path, **kw)


@pytest.mark.parametrize("keys, values, match", [
    (np.array([1.0, 2.0]), np.zeros((2, 2 * E)), "integer"),
    (np.array([[1, 2]]), np.zeros((2, 2 * E)), "integer"),
    (np.array([1, 2]), np.zeros((2, E)), r"\(2, storage_dim=8\)"),
    (np.array([1, 2]), np.zeros((3, 2 * E)), r"\(2, storage_dim=8\)"),
    (np.array([1, 2]), np.zeros((2, 2 * E), np.int32), "float32"),
    (np.array([1, 2]), np.array([[0.0] * 2 * E, [np.nan] * 2 * E]), r"values\[1\] \(key 2\)"),
    (np.array([1, 2**63], np.uint64), np.zeros((2, 2 * E)), "does not fit key_type=int64"),
])
def test_bad_rows_are_refused_and_nothing_is_stored(keys, values, match, tmp_path):
    with writer(tmp_path, embedding_dims=E) as w:
        with pytest.raises(oe.InputError, match=match):
            w.write(keys, values)
    assert w.rows_written == 0 and w.replaced == 0
    with oe.make_persistent_table_reader([tmp_path / "0-1"], "pre", np.int64, np.float32,
                                         2 * E) as r:
        assert r.manifests[0]["row_count"] == 0 and list(r) == []


def test_negative_keys_need_a_signed_key_type(tmp_path):
    with writer(tmp_path, key_type=np.uint32) as w:
        with pytest.raises(oe.InputError, match="key -1 does not fit key_type=uint32"):
            w.write(np.array([-1]), np.zeros((1, 2 * E)))


def test_write_after_close_is_refused(tmp_path):
    w = writer(tmp_path)
    w.close()
    with pytest.raises(oe.InputError, match="closed"):
        w.write(np.array([1]), np.zeros((1, 2 * E)))
    assert w.close() == []


def test_bad_reader_arguments(tmp_path):
    write([tmp_path / "0-1"], "pre", *rows(5))
    folder = [tmp_path / "0-1"]
    with pytest.raises(oe.SnapshotError, match="no snapshot named 'other'.*available.*pre"):
        oe.make_persistent_table_reader(folder, "other", np.int64, np.float32, 2 * E)
    with pytest.raises(oe.SnapshotError, match="line_size=8 but this embedding has line_size=4"):
        oe.make_persistent_table_reader(folder, "pre", np.int64, np.float32, E)
    with pytest.raises(oe.SnapshotError, match="key_type='int64'"):
        oe.make_persistent_table_reader(folder, "pre", np.int32, np.float32, 2 * E)
    with pytest.raises(oe.SnapshotError, match="engine 'ssd.slots', not 'ssd.rocksdb'"):
        oe.make_persistent_table_reader(folder, "pre", np.int64, np.float32, 2 * E, engine="rocksdb")
    with pytest.raises(oe.SnapshotError, match="does not exist"):
        oe.make_persistent_table_reader([tmp_path / "nowhere"], "pre", np.int64, np.float32, 2 * E)
    with pytest.raises(oe.ConfigError, match="batch_rows"):
        oe.make_persistent_table_reader(folder, "pre", np.int64, np.float32, 2 * E, batch_rows=0)


def test_rank_folder_names_are_zero_padded_in_the_hint(tmp_path):
    paths = [tmp_path / f"{r:02d}-10" for r in range(10)]
    with pytest.raises(oe.ConfigError, match="'00-10', '01-10'"):
        writer(tmp_path, paths=paths[::-1])


def test_docstring_examples_run_and_leave_no_folder(tmp_path, monkeypatch):
    import doctest
    import tempfile

    import one_embedding.table_io as module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the examples' folders go
    assert doctest.testmod(module).failed == 0
    assert list(tmp_path.iterdir()) == []


def test_a_block_size_the_stores_refuse_is_refused_by_the_writer_and_reader(tmp_path, caplog):
    """1000 (or 2**20) was accepted by the writer and failed at its first write with a disk I/O
    error; the refusal leaves no warning behind at garbage collection (the writer's __del__
    found none of its attributes)."""
    import gc
    import logging

    with caplog.at_level(logging.WARNING):
        for bad in (1000, 2**20, True):
            with pytest.raises(oe.ConfigError, match=rf"physical_block_size={bad!r} must be a "
                                                     "power of two in 512..65536"):
                oe.make_persistent_table_writer([str(tmp_path / "w")], "s", np.int64,
                                                np.float32, 8, physical_block_size=bad)
            with pytest.raises(oe.ConfigError, match="physical_block_size"):
                oe.make_persistent_table_reader([str(tmp_path / "w")], "s", np.int64,
                                                np.float32, 8, physical_block_size=bad)
        with pytest.raises(oe.ConfigError, match="value_type"):
            oe.make_persistent_table_writer([str(tmp_path / "w")], "s", np.int64, np.float64, 8)
        gc.collect()
    assert not [r for r in caplog.records if "table writer" in r.getMessage()], caplog.text


def test_a_table_of_one_initializer_initialises_every_column_of_a_multi_column_embedding():
    """OneFlow applies a table's single initializer to every column; it was refused here."""
    init = oe.make_constant_initializer(0.25)
    store = oe.make_device_mem_store_options(None, capacity=100)
    emb = oe.MultiTableMultiColumnEmbedding("m", [2, 3], np.float32, np.int64,
                                            [oe.make_table_options(init)], store)
    np.testing.assert_array_equal(emb(np.arange(4)), np.full((4, 5), 0.25, np.float32))
