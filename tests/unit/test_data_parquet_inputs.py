"""Parquet files other tools write, and the paths they leave (data/parquet_inputs.py): ids
numbered within each column (NVTabular's Categorify, HugeCTR) silently shared rows across
columns, dense values another tool transformed were read as OneFlow's raw + 1 (the log taken of
normalized values), and a Spark / Dask output folder failed on its markers and summary file,
found by a fault campaign."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from one_embedding import cli
from one_embedding.data import BatchLoader, ParquetReader
from one_embedding.data.schema import DENSE_COLUMNS, SPARSE_COLUMNS
from one_embedding.errors import InputError

ROWS = 600


def _columns(seed=0, per_column=True, dense="raw"):
    """label int32, I1..I13 (raw + 1 as int32, or normalized float32), C1..C26 int64: per-column
    ids 0..card-1, or the same + column << 32."""
    rng = np.random.default_rng(seed)
    cols = {"label": pa.array(rng.integers(0, 2, ROWS).astype(np.int32))}
    for name in DENSE_COLUMNS:
        raw = rng.integers(0, 50, ROWS)
        if dense == "raw":
            cols[name] = pa.array((raw + 1).astype(np.int32))
        else:
            x = np.log1p(raw)
            cols[name] = pa.array(((x - x.mean()) / x.std()).astype(np.float32))
    for j, name in enumerate(SPARSE_COLUMNS):
        ids = rng.integers(0, 5 + 3 * j, ROWS)
        cols[name] = pa.array(ids if per_column else ids + (j << 32))
    return cols


def _write(path, **kw):
    pq.write_table(pa.table(_columns(**kw)), path)
    return path


def _ids(path, **kw):
    return np.concatenate([b.ids for b in BatchLoader(path, 100, read_ahead=0, **kw)])


def test_ids_numbered_per_column_are_refused_naming_both_ways(tmp_path):
    path = _write(tmp_path / "categorify.parquet")
    with pytest.raises(InputError, match=r"C\d+ holds ids .*per_column.*global"):
        ParquetReader(path)


def test_per_column_ids_become_one_key_range_per_column(tmp_path):
    raw = _write(tmp_path / "categorify.parquet")
    offset = _write(tmp_path / "offset.parquet", per_column=False)
    keyed = _ids(raw, keys="per_column")
    np.testing.assert_array_equal(keyed, _ids(offset))     # = id + column << 32
    columns = [set(keyed[:, j].tolist()) for j in range(len(SPARSE_COLUMNS))]
    assert sum(map(len, columns)) == len(set().union(*columns))   # no key in two columns
    # as stored, when the columns are meant to share ids
    stored = pq.read_table(raw).column("C2").to_numpy()
    np.testing.assert_array_equal(_ids(raw, keys="global")[:, 1], stored)


def test_per_column_refuses_an_id_outside_32_bits(tmp_path):
    path = _write(tmp_path / "offset.parquet", per_column=False)
    with pytest.raises(InputError, match=r"C2 = 4294967\d+ is outside \[0, 2\*\*32\)"):
        _ids(path, keys="per_column")


def test_a_file_with_overlapping_hashed_keys_or_disjoint_ranges_reads_as_stored(tmp_path):
    # OneFlow's tools: column * (mod + 1) offsets (disjoint ranges) or 64-bit hashes (negative)
    cols = _columns(per_column=False)
    cols["C1"] = pa.array(np.full(ROWS, -5, np.int64))
    path = tmp_path / "hashed.parquet"
    pq.write_table(pa.table(cols), path)
    assert ParquetReader(path).key_modes == ["global"]
    assert _ids(path)[0, 0] == -5


def test_transformed_dense_values_are_not_taken_for_oneflows_raw_plus_one(tmp_path):
    path = _write(tmp_path / "nvt.parquet", per_column=False, dense="normalized")
    with pytest.raises(InputError, match=r"row 0: I1 = -?\d+\.\d+ is not an integer.*"
                                         r"--parquet-layout one_embedding"):
        _ids(path)
    stored = pq.read_table(path).column("I1").to_numpy()
    dense = np.concatenate([b.dense for b in BatchLoader(path, 100, read_ahead=0,
                                                         layout="one_embedding")])
    np.testing.assert_array_equal(dense[:, 0], stored)


def test_a_nan_dense_value_names_the_file_and_row(tmp_path):
    cols = _columns(per_column=False, dense="normalized")
    i3 = cols["I3"].to_numpy().copy()
    i3[7] = np.nan
    cols["I3"] = pa.array(i3)
    path = tmp_path / "nan.parquet"
    pq.write_table(pa.table(cols), path)
    with pytest.raises(InputError, match=r"nan.parquet: row group 0: row 7: I3 is nan"):
        _ids(path, layout="one_embedding")


def test_spark_and_dask_output_folders_read_their_part_files(tmp_path):
    spark = tmp_path / "spark"
    spark.mkdir()
    for i in range(2):
        pq.write_table(pa.table(_columns(seed=i, per_column=False)), spark / f"part-{i:05d}.parquet")
    (spark / "_SUCCESS").write_bytes(b"")
    (spark / ".part-00000.parquet.crc").write_bytes(b"crc")
    parts = sorted(str(p) for p in spark.glob("part-*"))
    want = _ids(parts)
    np.testing.assert_array_equal(_ids(str(spark)), want)                 # the folder
    np.testing.assert_array_equal(_ids(sorted(map(str, spark.iterdir()))), want)   # DIR/*
    np.testing.assert_array_equal(_ids(str(spark / "part-*.parquet")), want)       # a pattern
    # a Dask summary file named on its own says what it is
    pq.write_metadata(pq.read_schema(parts[0]), spark / "_common_metadata")
    meta = pq.ParquetFile(parts[0]).metadata
    meta.set_file_path("part-00000.parquet")
    meta.write_metadata_file(str(spark / "_metadata"))
    np.testing.assert_array_equal(_ids(str(spark)), want)
    with pytest.raises(InputError, match="summary file.*part-00000.parquet"):
        ParquetReader(str(spark / "_metadata"))


def test_paths_that_hold_no_data_say_so(tmp_path):
    with pytest.raises(InputError, match="matches no data file"):
        _ids(str(tmp_path / "nothing-*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no data files"):
        _ids(str(tmp_path / "empty"))
    np.save(tmp_path / "day_0_sparse.npy", np.zeros((4, 26), np.int32))
    with pytest.raises(InputError, match="NumPy .npy file"):
        _ids(str(tmp_path / "day_0_sparse.npy"))


def test_the_cli_trains_on_per_column_ids_and_refuses_them_unnamed(tmp_path, capsys):
    path = str(_write(tmp_path / "categorify.parquet"))
    common = ["train", "--data", path, "--batch-size", "64", "--steps", "3", "--no-progress",
              "--eval-fraction", "0.2", "--eval-batches", "1"]
    assert cli.main(common) == 2
    assert "--parquet-keys per_column" in capsys.readouterr().err
    assert cli.main(common + ["--parquet-keys", "per_column", "--json"]) == 0
    assert cli.main(["train", "--parquet-keys", "global", "--steps", "1"]) == 2
    assert "--data synthetic has none" in capsys.readouterr().err
