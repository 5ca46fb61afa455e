"""Parquet: our schema round trip through the converter, OneFlow's schema, detection errors."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from one_embedding.data import (DENSE_COLUMNS, SPARSE_COLUMNS, BatchLoader, KeyScheme,
                                ParquetReader, SyntheticCriteo, convert_tsv_to_parquet,
                                detect_schema, read_criteo_tsv, write_parquet)
from one_embedding.errors import InputError

CRITEO_DIR = Path(__file__).parents[1].parent / "shared" / "data" / "criteo"


def synthetic_tsv(path, rows=700, seed=0):
    """Random Criteo-shaped TSV with missing fields, negatives and stripped lines."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        ints = ["" if rng.random() < 0.2 else str(int(v)) for v in rng.integers(-3, 5000, 13)]
        cats = ["" if rng.random() < 0.1 else f"{int(v):08x}" for v in rng.integers(0, 1 << 32, 26)]
        fields = [str(i % 2)] + ints + cats
        while len(fields) > 37 and fields[-1] == "" and rng.random() < 0.7:
            fields.pop()
        lines.append("\t".join(fields))
    path.write_text("\n".join(lines) + "\n")
    return path


def collect(batches):
    batches = list(batches)
    return (np.concatenate([b.dense for b in batches]), np.concatenate([b.ids for b in batches]),
            np.concatenate([b.labels for b in batches]))


@pytest.mark.parametrize("scheme", [KeyScheme(), KeyScheme(mod=40_000_000), KeyScheme(mode="hash")])
def test_tsv_to_parquet_to_batches_equals_tsv_to_batches(tmp_path, scheme):
    tsv = synthetic_tsv(tmp_path / "day_0")
    out = tmp_path / "day_0.parquet"
    stats = convert_tsv_to_parquet(tsv, out, key_scheme=scheme, row_group_rows=256,
                                   progress=False, block_bytes=4096)
    assert stats == {"rows": 700, "skipped": 0, "row_groups": 3}
    assert detect_schema(out) == "one_embedding"
    assert [pq.ParquetFile(out).metadata.row_group(g).num_rows for g in range(3)] == [256, 256, 188]
    meta = json.loads(pq.read_schema(out).metadata[b"one_embedding.criteo"])
    assert meta["key_scheme"] == {"mode": scheme.mode, "mod": scheme.mod}
    from_tsv = collect(BatchLoader(tsv, 100, read_ahead=0, key_scheme=scheme))
    from_parquet = collect(BatchLoader(out, 100))
    for a, b in zip(from_tsv, from_parquet):
        np.testing.assert_array_equal(a, b)
    whole = read_criteo_tsv(tsv, key_scheme=scheme)
    np.testing.assert_array_equal(from_parquet[1], whole.ids)


def test_converter_skips_and_counts_bad_lines(tmp_path):
    tsv = synthetic_tsv(tmp_path / "a.tsv", rows=50)
    with open(tsv, "a") as f:
        f.write("1\tnot\ta\tcriteo\tline\n")
    out = tmp_path / "a.parquet"
    with pytest.raises(InputError, match=r"a\.tsv:51: "):
        convert_tsv_to_parquet(tsv, out, progress=False)
    assert not out.exists() and not Path(str(out) + ".tmp").exists()
    stats = convert_tsv_to_parquet([tsv, tsv], out, on_bad_line="skip", progress=False)
    assert stats["rows"] == 100 and stats["skipped"] == 2
    assert ParquetReader(out).num_rows == 100


def oneflow_table(raw_dense, keys, labels):
    """A table laid out like OneFlow's Criteo Parquet: I = raw + 1 (missing -> 1), C = keys."""
    columns = {"label": pa.array(labels, pa.float64())}
    for j, name in enumerate(DENSE_COLUMNS):
        columns[name] = pa.array(raw_dense[:, j] + 1.0, pa.float64())
    for j, name in enumerate(SPARSE_COLUMNS):
        columns[name] = pa.array(keys[:, j], pa.int64())
    return pa.table(columns)


def test_oneflow_schema(tmp_path):
    rng = np.random.default_rng(1)
    raw = rng.integers(-3, 100_000, (500, 13)).astype(np.float64)
    missing = rng.random((500, 13)) < 0.3
    raw[missing] = 0.0
    keys = rng.integers(0, 40_000_000, (500, 26)) + 40_000_000 * np.arange(26)
    labels = (rng.random(500) < 0.3).astype(np.float64)
    path = tmp_path / "part-00000.parquet"
    pq.write_table(oneflow_table(raw, keys, labels), path, row_group_size=200)
    reader = ParquetReader(path)
    assert reader.schemas == ["oneflow"] and len(reader.units()) == 3
    dense, ids, got_labels = collect(c.batch() for c in reader)
    np.testing.assert_allclose(dense, np.log(np.maximum(raw, 0.0) + 1.0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ids, keys)
    np.testing.assert_array_equal(got_labels, labels.astype(np.float32))


def test_schema_detection_errors(tmp_path):
    rng = np.random.default_rng(2)
    table = oneflow_table(np.zeros((4, 13)), rng.integers(0, 9, (4, 26)), np.zeros(4))
    pq.write_table(table.drop(["C7"]), tmp_path / "no_c7.parquet")
    with pytest.raises(InputError, match=r"columns \['C7'\] are missing"):
        ParquetReader(tmp_path / "no_c7.parquet")
    as_keys = table.set_column(1, "I1", pa.array(np.arange(4), pa.int64()))
    pq.write_table(as_keys, tmp_path / "dcn.parquet")
    with pytest.raises(InputError, match="column I1 is int64, expected float"):
        ParquetReader(tmp_path / "dcn.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        ParquetReader(tmp_path / "junk.parquet")
    nulls = table.set_column(0, "label", pa.array([0.0, None, 1.0, 0.0], pa.float64()))
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    with pytest.raises(InputError, match="column label has 1 nulls"):
        list(ParquetReader(tmp_path / "nulls.parquet"))


def test_write_parquet_round_trip(tmp_path):
    data = SyntheticCriteo("kaggle", scale=0.001, seed=4)
    batches = [data.batch(300, i) for i in range(3)]
    write_parquet(tmp_path / "syn.parquet", batches, row_group_rows=256)
    dense, ids, labels = collect(BatchLoader(tmp_path / "syn.parquet", 128))
    np.testing.assert_array_equal(ids, np.concatenate([b.ids for b in batches]))
    np.testing.assert_array_equal(dense, np.concatenate([b.dense for b in batches]))
    np.testing.assert_array_equal(labels, np.concatenate([b.labels for b in batches]))


@pytest.mark.skipif(not CRITEO_DIR.is_dir(), reason="real Criteo rows live in ../shared (absent)")
def test_real_rows_through_parquet(tmp_path):
    sources = sorted(CRITEO_DIR.glob("*.tsv"))
    out = tmp_path / "real.parquet"
    stats = convert_tsv_to_parquet(sources, out, progress=False)
    assert stats["rows"] == 1300 and stats["skipped"] == 0
    expected = [read_criteo_tsv(p) for p in sources]
    dense, ids, labels = collect(BatchLoader(out, 512))
    np.testing.assert_array_equal(ids, np.concatenate([b.ids for b in expected]))
    np.testing.assert_array_equal(dense, np.concatenate([b.dense for b in expected]))
    np.testing.assert_array_equal(labels, np.concatenate([b.labels for b in expected]))
