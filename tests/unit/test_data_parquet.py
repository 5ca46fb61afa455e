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
    keys = rng.integers(0, 9, (4, 26)) + 10 * np.arange(26)   # OneFlow's: column offsets
    table = oneflow_table(np.zeros((4, 13)), keys, np.zeros(4))
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


def test_real_rows_through_parquet(tmp_path, criteo_dir):
    sources = sorted(criteo_dir.glob("*.tsv"))
    out = tmp_path / "real.parquet"
    stats = convert_tsv_to_parquet(sources, out, progress=False)
    assert stats["rows"] == 1300 and stats["skipped"] == 0
    expected = [read_criteo_tsv(p) for p in sources]
    dense, ids, labels = collect(BatchLoader(out, 512))
    np.testing.assert_array_equal(ids, np.concatenate([b.ids for b in expected]))
    np.testing.assert_array_equal(dense, np.concatenate([b.dense for b in expected]))
    np.testing.assert_array_equal(labels, np.concatenate([b.labels for b in expected]))


# ---------------------------------------------------------------------------------------------
# OneFlow's layout (dense = raw + 1, log taken when read) beside ours (dense already logged)
# ---------------------------------------------------------------------------------------------
def raw_rows(rows=600, seed=3):
    """Criteo-like rows as raw values: (labels, raw (N, 13) int64, present (N, 13), hex values
    (N, 26) uint64, hex present (N, 26)), with negatives, large values and missing fields."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(-3, 5000, (rows, 13))
    raw[rng.random((rows, 13)) < 0.05] = rng.integers(10 ** 6, 3 * 10 ** 7, 1)  # beyond 2**24
    present = rng.random((rows, 13)) > 0.2
    hexes = rng.integers(0, 1 << 32, (rows, 26)).astype(np.uint64)
    hex_present = rng.random((rows, 26)) > 0.1
    labels = (rng.random(rows) < 0.3).astype(np.int64)
    return labels, raw, present, hexes, hex_present


def write_tsv(path, labels, raw, present, hexes, hex_present):
    lines = []
    for i in range(len(labels)):
        ints = [str(int(v)) if p else "" for v, p in zip(raw[i], present[i])]
        cats = [f"{int(v):08x}" if p else "" for v, p in zip(hexes[i], hex_present[i])]
        lines.append("\t".join([str(labels[i])] + ints + cats))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_oneflow_layout_and_ours_give_identical_batches(tmp_path):
    from one_embedding.data import dense_log
    from one_embedding.data.parquet import SOURCE_KEY

    labels, raw, present, hexes, hex_present = raw_rows()
    tsv = write_tsv(tmp_path / "day_0", labels, raw, present, hexes, hex_present)
    ours, theirs = tmp_path / "ours.parquet", tmp_path / "oneflow.parquet"
    convert_tsv_to_parquet(tsv, ours, row_group_rows=256, progress=False, block_bytes=4096)
    stats = convert_tsv_to_parquet(tsv, theirs, row_group_rows=256, progress=False,
                                   block_bytes=4096, layout="oneflow")
    assert stats == {"rows": 600, "skipped": 0, "row_groups": 3}
    assert detect_schema(ours) == "one_embedding" and detect_schema(theirs) == "oneflow"
    # the OneFlow file holds raw + 1 (missing -> 1, negatives kept) and says where it came from
    stored = pq.read_table(theirs)
    want_stored = np.where(present, raw + 1, 1).astype(np.int32)
    np.testing.assert_array_equal(np.stack([stored.column(c).to_numpy() for c in DENSE_COLUMNS],
                                           axis=1), want_stored)
    meta = json.loads(stored.schema.metadata[SOURCE_KEY])
    assert meta["layout"] == "oneflow" and meta["dense"] == "raw_plus_one"
    assert b"one_embedding.criteo" not in stored.schema.metadata
    # OneFlow's own files: no metadata, float64 or int32 raw + 1, integer labels
    keys = KeyScheme().keys(hexes, hex_present)
    for dtype, name in [(pa.float64(), "f64"), (pa.int32(), "i32")]:
        columns = {"label": pa.array(labels, pa.int32())}
        for j, col in enumerate(DENSE_COLUMNS):
            columns[col] = pa.array(np.where(present[:, j], raw[:, j] + 1, 1)).cast(dtype)
        for j, col in enumerate(SPARSE_COLUMNS):
            columns[col] = pa.array(keys[:, j], pa.int64())
        pq.write_table(pa.table(columns), tmp_path / f"{name}.parquet", row_group_size=100)
    batches = {path.stem: collect(BatchLoader(path, 128))
               for path in [ours, theirs] + [tmp_path / f"{n}.parquet" for n in ("f64", "i32")]}
    from_tsv = collect(BatchLoader(tsv, 128, read_ahead=0))
    # dense = log(max(raw, 0) + 1) exactly once, whatever the layout
    np.testing.assert_array_equal(from_tsv[0], dense_log(raw, present))
    for name, got in batches.items():
        for a, b in zip(from_tsv, got):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_layout_option_and_its_conflicts_with_metadata(tmp_path):
    from one_embedding.errors import ConfigError

    tsv = synthetic_tsv(tmp_path / "day_0", rows=300)
    ours = tmp_path / "ours.parquet"
    convert_tsv_to_parquet(tsv, ours, progress=False)
    want = collect(BatchLoader(ours, 100))
    # a rewrite that drops the metadata: detection would call it OneFlow's, the option says ours
    stripped = tmp_path / "stripped.parquet"
    pq.write_table(pq.read_table(ours).replace_schema_metadata(None), stripped)
    assert detect_schema(stripped) == "oneflow"
    reader = ParquetReader(stripped, layout="one_embedding")
    assert reader.schemas == ["one_embedding"]
    for a, b in zip(want, collect(c.batch() for c in reader)):
        np.testing.assert_array_equal(a, b)
    # an option against the file's own metadata would log twice (or not at all): refused
    with pytest.raises(InputError, match=r"layout='oneflow' but the file's metadata says it is "
                                         r"'one_embedding'.*log a second time"):
        ParquetReader(ours, layout="oneflow")
    theirs = tmp_path / "oneflow.parquet"
    convert_tsv_to_parquet(tsv, theirs, progress=False, layout="oneflow")
    with pytest.raises(InputError, match=r"says it is 'oneflow'.*unlogged"):
        ParquetReader(theirs, layout="one_embedding")
    assert ParquetReader(theirs, layout="oneflow").schemas == ["oneflow"]
    with pytest.raises(ConfigError, match=r"layout='log1p': use 'one_embedding'"):
        ParquetReader(ours, layout="log1p")
    with pytest.raises(ConfigError, match=r"layout='parquet': use 'one_embedding'"):
        convert_tsv_to_parquet(tsv, tmp_path / "x.parquet", progress=False, layout="parquet")
    # 64-bit integer dense columns stay refused (OneFlow's DCN layout: I1..I13 are keys)
    as_int = pq.read_table(theirs).replace_schema_metadata(None)
    as_int = as_int.set_column(1, "I1", pa.array(np.ones(300, np.int64)))
    pq.write_table(as_int, tmp_path / "dcn.parquet")
    with pytest.raises(InputError, match=r"column I1 is int64, expected float"):
        ParquetReader(tmp_path / "dcn.parquet")


def test_oneflow_layout_skips_bad_lines_like_ours(tmp_path):
    tsv = synthetic_tsv(tmp_path / "a.tsv", rows=120)
    with open(tsv, "a") as f:
        f.write("1\tnot\ta\tcriteo\tline\n")
    with open(tsv, "a") as f:
        f.write("\n".join(synthetic_tsv(tmp_path / "b.tsv", rows=40, seed=9).read_text()
                          .splitlines()) + "\n")
    ours, theirs = tmp_path / "ours.parquet", tmp_path / "oneflow.parquet"
    a = convert_tsv_to_parquet(tsv, ours, on_bad_line="skip", progress=False, block_bytes=2048)
    b = convert_tsv_to_parquet(tsv, theirs, on_bad_line="skip", progress=False, block_bytes=2048,
                               layout="oneflow")
    assert a == b and a["skipped"] == 1 and a["rows"] == 160
    for x, y in zip(collect(BatchLoader(ours, 64)), collect(BatchLoader(theirs, 64))):
        np.testing.assert_array_equal(x, y)


def test_oneflow_float32_files_read_exactly_below_2_to_24(tmp_path):
    # OneFlow's Scala tool stores raw + 1 as float32: exact (and so read bit-identically to our
    # layout) while raw + 1 <= 2**24
    from one_embedding.data import dense_log

    labels, raw, present, hexes, hex_present = raw_rows(seed=4)
    raw = np.minimum(raw, 2 ** 24 - 1)
    keys = KeyScheme().keys(hexes, hex_present)
    table = oneflow_table(np.where(present, raw, 0).astype(np.float64), keys,
                          labels.astype(np.float64))
    table = table.cast(pa.schema([pa.field(f.name, pa.float32() if f.name != "label" and
                                           f.name.startswith("I") else f.type)
                                  for f in table.schema]))
    pq.write_table(table, tmp_path / "part-0.parquet")
    dense, ids, got_labels = collect(BatchLoader(tmp_path / "part-0.parquet", 200))
    np.testing.assert_array_equal(dense, dense_log(raw, present))
    np.testing.assert_array_equal(ids, keys)
    np.testing.assert_array_equal(got_labels, labels.astype(np.float32))


def test_cli_convert_writes_either_layout(tmp_path, capsys):
    from one_embedding.cli import main

    tsv = synthetic_tsv(tmp_path / "day_0", rows=200)
    for layout in ("one_embedding", "oneflow"):
        out = tmp_path / f"{layout}.parquet"
        assert main(["convert", str(tsv), str(out), "--layout", layout]) == 0
        assert json.loads(capsys.readouterr().out)["rows"] == 200
        assert detect_schema(out) == layout
    a, b = (collect(BatchLoader(tmp_path / f"{n}.parquet", 50)) for n in ("one_embedding",
                                                                         "oneflow"))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_oneflow_layout_refuses_a_value_beyond_int32(tmp_path):
    labels, raw, present, hexes, hex_present = raw_rows(rows=20)
    raw[7, 4], present[7, 4] = 3_000_000_000, True
    tsv = write_tsv(tmp_path / "big.tsv", labels, raw, present, hexes, hex_present)
    with pytest.raises(InputError, match=r"big\.tsv: the line at byte \d+: I5 = 3000000000 "
                                         r"does not fit OneFlow's int32 raw "
                                         r"\+ 1: write layout='one_embedding'"):
        convert_tsv_to_parquet(tsv, tmp_path / "big.parquet", progress=False, layout="oneflow")
    assert not (tmp_path / "big.parquet").exists()
    convert_tsv_to_parquet(tsv, tmp_path / "big.parquet", progress=False)  # ours holds it
