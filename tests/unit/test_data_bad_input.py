"""Issue 12's data-layer defects: Parquet told by content, clear errors for bad Parquet files and
bad conversions, cut TSV downloads, over-wide categoricals, and skipped lines counted once."""

import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from one_embedding.config import TrainConfig
from one_embedding.data import (BatchLoader, CriteoTSVReader, KeyScheme, ParquetReader,
                                SyntheticCriteo, TSVSource, convert_tsv_to_parquet, parse_lines,
                                read_criteo_tsv, write_parquet)
from one_embedding.errors import ConfigError, InputError
from one_embedding.training_setup import make_loaders


def tsv_lines(rows, seed=0):
    """Full 40-field Criteo lines with 8-digit hex categoricals: list of str."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        ints = [str(int(v)) for v in rng.integers(-3, 1000, 13)]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 1 << 32, 26)]
        lines.append("\t".join([str(i % 2)] + ints + cats))
    return lines


def write_lines(path, lines, final_newline=True):
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))
    return path


def collect(batches):
    batches = list(batches)
    return [np.concatenate([getattr(b, k) for b in batches]) for k in ("dense", "ids", "labels")]


def assert_same(a, b):
    for x, y in zip(collect(a), collect(b)):
        np.testing.assert_array_equal(x, y)


def small_parquet(path, rows=600, row_group_rows=256):
    data = SyntheticCriteo("kaggle", scale=0.001, seed=4)
    write_parquet(path, [data.batch(rows, 0)], row_group_rows=row_group_rows)
    return path


# --- 1. a Parquet file is Parquet whatever it is called -------------------------------------------

def test_parquet_without_suffix_trains_through_make_loaders(tmp_path):
    named = small_parquet(tmp_path / "day_0.parquet")
    bare = tmp_path / "day_0"
    shutil.copy(named, bare)
    # make_loaders passes the TSV-only on_bad_line to any path not ending in .parquet
    cfg = TrainConfig(data=(str(bare),), batch_size=100, on_bad_line="skip", read_ahead=0)
    train, evaluate, features, _ = make_loaders(cfg)
    assert isinstance(train.source, ParquetReader) and features == 26
    reference = TrainConfig(data=(str(named),), batch_size=100, read_ahead=0)
    ref_train, ref_eval, _, _ = make_loaders(reference)
    assert_same(train, ref_train)
    assert_same(evaluate, ref_eval)


def test_tsv_named_parquet_is_read_as_tsv(tmp_path):
    lines = tsv_lines(30)
    misnamed = write_lines(tmp_path / "day_0.parquet", lines)
    plain = write_lines(tmp_path / "day_0.tsv", lines)
    assert isinstance(BatchLoader(misnamed, 8).source, TSVSource)
    assert_same(BatchLoader(misnamed, 8), BatchLoader(plain, 8))


def test_tsv_options_on_parquet_paths(tmp_path):
    path = small_parquet(tmp_path / "day_0")
    assert_same(BatchLoader(path, 100, on_bad_line="skip"), BatchLoader(path, 100))
    with pytest.raises(ConfigError, match=r"reader options \['has_label', 'unit_bytes'\] apply "
                                          r"to TSV files, but .*day_0'\] are Parquet"):
        BatchLoader(path, 100, unit_bytes=1000, has_label=False)


def test_missing_path_and_folder_are_named(tmp_path):
    with pytest.raises(InputError, match=r"nothere\.parquet: no such TSV file or Parquet file"):
        BatchLoader(tmp_path / "nothere.parquet", 4)
    with pytest.raises(InputError, match=rf"{tmp_path.name} is a folder with no data files"):
        BatchLoader(tmp_path, 4)


def test_convert_refuses_missing_source_folder_target_and_parquet_source(tmp_path):
    src = write_lines(tmp_path / "day_0", tsv_lines(10))
    with pytest.raises(InputError, match=r"day_9: no such TSV file"):
        convert_tsv_to_parquet(tmp_path / "day_9", tmp_path / "out.parquet", progress=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(InputError, match=r"out is a folder: name the output file, e\.g\. .*"
                                         r"out/day_0\.parquet"):
        convert_tsv_to_parquet(src, out_dir, progress=False)
    with pytest.raises(InputError, match=r"folder .*missing does not exist"):
        convert_tsv_to_parquet(src, tmp_path / "missing" / "x.parquet", progress=False)
    done = tmp_path / "done"  # a Parquet file without the suffix
    convert_tsv_to_parquet(src, done, progress=False)
    with pytest.raises(InputError, match=r"done is already a Parquet file"):
        convert_tsv_to_parquet(done, tmp_path / "again.parquet", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0", "done", "out"]


def test_convert_never_replaces_a_source_or_an_existing_file_unasked(tmp_path):
    """`convert day_0 day_0` made the raw TSV Parquet, and `convert day_0 day_1` (the output
    forgotten) replaced the raw day_1: a source is never the output, an existing output only
    with overwrite=True; a source without a row writes nothing."""
    src = write_lines(tmp_path / "day_0", tsv_lines(10))
    other = write_lines(tmp_path / "day_1", tsv_lines(12, seed=1))
    raw = (src.read_bytes(), other.read_bytes())
    with pytest.raises(InputError, match=r"output .*day_0 is also a source"):
        convert_tsv_to_parquet(src, src, progress=False, overwrite=True)
    with pytest.raises(InputError, match=r"output .*day_1 exists: pass --overwrite"):
        convert_tsv_to_parquet(src, other, progress=False)
    assert (src.read_bytes(), other.read_bytes()) == raw
    out = tmp_path / "out.parquet"
    assert convert_tsv_to_parquet(src, out, progress=False)["rows"] == 10
    with pytest.raises(InputError, match="exists"):
        convert_tsv_to_parquet(other, out, progress=False)
    assert convert_tsv_to_parquet(other, out, progress=False, overwrite=True)["rows"] == 12
    mine = tmp_path / "out.parquet.tmp"  # the temporary name of before: a file of the user's
    mine.write_bytes(b"keep me")
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.tsv: no row to convert \(no line\); nothing "
                                         "was written"):
        convert_tsv_to_parquet(empty, tmp_path / "e.parquet", progress=False)
    bad = write_lines(tmp_path / "bad.tsv", ["x\ty"] * 5)
    with pytest.raises(InputError, match="all 5 lines were malformed and skipped"):
        convert_tsv_to_parquet(bad, tmp_path / "b.parquet", progress=False, on_bad_line="skip")
    assert mine.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.tsv", "day_0", "day_1", "empty.tsv", "out.parquet", "out.parquet.tmp"]


@pytest.mark.parametrize("magic,name", [(b"\x1f\x8b\x08\x00", "gzip"),
                                        (b"\x28\xb5\x2f\xfd", "zstd"),
                                        (b"\xfd7zXZ\x00", "xz")])
def test_a_compressed_source_is_named_so_not_read_as_one_bad_line(tmp_path, magic, name):
    """Criteo 1TB ships day_N.gz: read as TSV it was one bad line, and the advice was to skip
    bad lines (every line)."""
    path = tmp_path / "day_0.gz"
    path.write_bytes(magic + bytes(range(256)))
    with pytest.raises(InputError, match=rf"day_0\.gz is {name}-compressed: decompress it first"):
        BatchLoader(path, 4)
    with pytest.raises(InputError, match=rf"is {name}-compressed"):
        convert_tsv_to_parquet(path, tmp_path / "out.parquet", progress=False)


def test_cli_convert_errors_are_one_line(tmp_path):
    from system.test_cli import run_cli  # tests/ is on sys.path (conftest)

    src = write_lines(tmp_path / "day_0", tsv_lines(10))
    for args, said in (((tmp_path / "nope", tmp_path / "o.parquet"), "nope: no such TSV file"),
                       ((src, tmp_path), "is a folder: name the output file"),
                       ((src, src), "is also a source"),
                       ((src, write_lines(tmp_path / "day_1", tsv_lines(3))),
                        "day_1 exists: pass --overwrite")):
        r = run_cli("convert", *args)
        assert r.returncode == 2 and said in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "error:" in r.stderr


# --- 2. bad Parquet files: InputError naming the file and the column ------------------------------

def criteo_columns(rows=8, seed=0):
    rng = np.random.default_rng(seed)
    columns = {"label": pa.array(rng.integers(0, 2, rows).astype(np.float32))}
    for i in range(1, 14):   # OneFlow's layout (no metadata of ours): raw + 1, integers
        columns[f"I{i}"] = pa.array(rng.integers(1, 100, rows).astype(np.float32))
    for i in range(1, 27):   # keys unique across columns, as OneFlow's tools make them
        columns[f"C{i}"] = pa.array(rng.integers(0, 1000, rows) + (i << 32))
    return columns


def test_string_labels_are_refused_naming_file_and_column(tmp_path):
    columns = criteo_columns()
    columns["label"] = pa.array(["0", "1"] * 4)  # numpy would quietly turn these into floats
    pq.write_table(pa.table(columns), tmp_path / "strings.parquet")
    with pytest.raises(InputError, match=r"strings\.parquet: column label is string, expected "
                                         r"float labels"):
        ParquetReader(tmp_path / "strings.parquet")


@pytest.mark.parametrize("bad", [7.0, -1.0, float("inf")])
def test_labels_outside_0_1_are_refused_naming_file_row_group_and_row(tmp_path, bad):
    """A label of 7 or -1 in a held-out row was never checked (the training loss checks its
    own rows): evaluation printed an AUC over it. The reader names the row."""
    columns = criteo_columns(rows=8)
    labels = np.array([0, 1, 0, 1, 0, bad, 1, 0], np.float32)
    columns["label"] = pa.array(labels)
    pq.write_table(pa.table(columns), tmp_path / "labels.parquet", row_group_size=4)
    with pytest.raises(InputError, match=rf"labels\.parquet: row group 1: row 5: label {bad} is "
                                         r"not a click label"):
        list(BatchLoader(tmp_path / "labels.parquet", 4))
    columns["label"] = pa.array(np.array([0, 1, 0.5, 1, 0, 0.25, 1, 0], np.float32))
    pq.write_table(pa.table(columns), tmp_path / "soft.parquet")  # soft labels: as training
    assert sum(len(b) for b in BatchLoader(tmp_path / "soft.parquet", 4)) == 8


def test_nan_labels_in_the_held_out_rows_are_refused_not_scored(tmp_path):
    from one_embedding.metrics import check_labels

    with pytest.raises(InputError, match=r"evaluation batch 3: labels\[2\] is nan: labels must "
                                         r"lie in \[0, 1\]"):
        check_labels(np.array([0, 1, np.nan, 1], np.float32), "evaluation batch 3")
    check_labels(np.array([0, 1, 0.5, 1], np.float32), "evaluation batch 0")


def test_missing_column_in_our_schema_is_refused(tmp_path):
    path = small_parquet(tmp_path / "ours.parquet")
    table = pq.read_table(path)
    pq.write_table(table.drop(["C3", "I2"]), tmp_path / "cut.parquet")  # keeps our metadata
    with pytest.raises(InputError, match=r"cut\.parquet: not a Criteo Parquet file, columns "
                                         r"\['I2', 'C3'\] are missing"):
        ParquetReader(tmp_path / "cut.parquet")


def test_nulls_name_the_file(tmp_path):
    columns = criteo_columns()
    columns["C5"] = pa.array([1, 2, None, 4, 5, 6, 7, 8])
    pq.write_table(pa.table(columns), tmp_path / "nulls.parquet")
    with pytest.raises(InputError, match=r"nulls\.parquet: row group 0: column C5 has 1 nulls"):
        list(BatchLoader(tmp_path / "nulls.parquet", 4))


def damage(path, group, column, out):
    """Copy ``path`` to ``out`` with 8 bytes flipped in the middle of one column chunk."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(column)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    middle = start + chunk.total_compressed_size // 2
    raw[middle:middle + 8] = bytes(b ^ 0x5A for b in raw[middle:middle + 8])
    out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize("column", [0, 9, 30])  # label, I9, C17
def test_damaged_page_names_file_row_group_and_column(tmp_path, column):
    path = small_parquet(tmp_path / "good.parquet")
    bad = damage(path, 1, column, tmp_path / "bad.parquet")
    name = pq.ParquetFile(path).schema_arrow.names[column]
    loader = BatchLoader(bad, 100, read_ahead=2)  # the footer is intact: opening works
    got = []
    with pytest.raises(InputError, match=rf"bad\.parquet: row group 1: column {name}: damaged or "
                                         rf"unreadable data .*write or download it again"):
        for batch in loader:
            got.append(batch)
    assert sum(len(b) for b in got) <= 256


def test_cut_parquet_download_is_an_input_error(tmp_path):
    path = small_parquet(tmp_path / "good.parquet")
    (tmp_path / "cut").write_bytes(path.read_bytes()[:-100])  # starts with PAR1, no footer
    with pytest.raises(InputError, match=r"cut: not a readable Parquet file"):
        BatchLoader(tmp_path / "cut", 10)


# --- 3. TSV: cut downloads, over-wide categoricals, skipped lines counted once --------------------

def cut_file(tmp_path, lines, cut_from_end, name="day_0"):
    """A file of ``lines`` cut ``cut_from_end`` characters before the end of the last line."""
    text = "\n".join(lines)
    return (tmp_path / name).write_bytes(text[:len(text) - cut_from_end].encode()) and \
        tmp_path / name


@pytest.mark.parametrize("engine", ["numba", "numpy"])
@pytest.mark.parametrize("cut, reason", [
    (3, r"its last field C26 '[0-9a-f]{5}' has 5 characters, not 8"),   # inside the last field
    (8, r"its last field C26 is empty \(the line ends in a tab\)"),     # right after the tab
    (100, r"after \d+ of 37\.\.40 fields"),                              # many fields lost
])
def test_cut_last_line_is_detected(tmp_path, engine, cut, reason):
    lines = tsv_lines(20)
    path = cut_file(tmp_path, lines, cut)
    with pytest.raises(InputError, match=rf"day_0:20: bad Criteo line \(the file ends inside this "
                                         rf"line, without a newline.*{reason}"):
        read_criteo_tsv(path, engine=engine, block_bytes=700)
    reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine)
    assert sum(len(c) for c in reader) == 19 and reader.skipped == 1


def test_complete_last_line_without_newline_is_kept(tmp_path):
    lines = tsv_lines(20)
    path = write_lines(tmp_path / "f", lines, final_newline=False)
    with_newline = write_lines(tmp_path / "g", lines)
    np.testing.assert_array_equal(read_criteo_tsv(path).ids, read_criteo_tsv(with_newline).ids)
    # a stripped last line (38 fields, ends in C24) reads with its newline; without one it
    # cannot be told from a download cut after C24 (issue 29 item 9): refused
    stripped = lines[:-1] + ["\t".join(lines[-1].split("\t")[:38])]
    assert len(read_criteo_tsv(write_lines(tmp_path / "h", stripped))) == 20
    with pytest.raises(InputError, match=r"i:20: bad Criteo line \(the file ends inside this line, "
                                         r"without a newline, after 38 of 40 fields.*add the final "
                                         r"newline if it is complete"):
        read_criteo_tsv(write_lines(tmp_path / "i", stripped, final_newline=False))


@pytest.mark.parametrize("engine", ["numba", "numpy"])
@pytest.mark.parametrize("has_label", [True, False])
def test_every_cut_point_of_a_last_line_is_refused(tmp_path, engine, has_label):
    """Issue 29 item 9: a last line cut at any byte, inside a field, after a tab or right after a
    complete field, is a bad line naming its number (or skipped and counted); only the whole
    line reads. The line has empty fields (a cut after one leaves a valid-looking count)."""
    lines = tsv_lines(3)
    fields = lines[-1].split("\t")
    fields[3] = fields[20] = fields[38] = ""  # an empty I3, C6 and C25
    lines[-1] = "\t".join(fields)
    if not has_label:
        lines = [line.split("\t", 1)[1] for line in lines]
    whole = "\n".join(lines)
    start = len(whole) - len(lines[-1])
    full = read_criteo_tsv(write_lines(tmp_path / "full", lines), has_label=has_label)
    for cut in range(start + 1, len(whole)):
        path = tmp_path / "cut"
        path.write_bytes(whole[:cut].encode())
        with pytest.raises(InputError, match=r"cut:3: bad Criteo line \(the file ends inside"):
            read_criteo_tsv(path, has_label=has_label, engine=engine)
        reader = CriteoTSVReader(path, has_label=has_label, on_bad_line="skip", engine=engine)
        assert sum(len(c) for c in reader) == 2 and reader.skipped == 1, cut
    path.write_bytes(whole.encode())
    np.testing.assert_array_equal(read_criteo_tsv(path, has_label=has_label, engine=engine).ids,
                                  full.ids)


def test_real_file_without_final_newline_still_reads(tmp_path, criteo_dir):
    path = criteo_dir / "kaggle_train_sample_b_100_stripped.tsv"
    assert not path.read_bytes().endswith(b"\n")
    assert len(read_criteo_tsv(path)) == 100
    cut = tmp_path / "cut.tsv"
    cut.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(InputError, match=r"cut\.tsv:100: .*the file ends inside this line"):
        read_criteo_tsv(cut)


def test_wide_categoricals_keep_keys_of_their_own(tmp_path):
    """Values of 9-16 hex digits (data hashed to 64 bits) are kept as keys of their own on
    every path -- '100000000' and '00000000' are two keys -- and longer ones are bad lines."""
    lines = tsv_lines(10)
    fields = lines[4].split("\t")
    narrow = fields[16]
    fields[16] = "1" + narrow  # C3: 9 hex digits; folding mod 2**32 would give narrow's key
    lines[4] = "\t".join(fields)
    fields[16] = "0" * 8
    lines[5] = "\t".join(fields[:16] + ["100000000"] + fields[17:])
    lines[6] = "\t".join(fields[:16] + ["00000000"] + fields[17:])
    path = write_lines(tmp_path / "day_0", lines)
    ids = np.concatenate([b.ids for b in BatchLoader(path, 10)])
    assert ids[4, 2] != KeyScheme().keys(np.array([[int(narrow, 16)] * 26], np.uint64),
                                         np.ones((1, 26), bool))[0, 2]
    assert ids[5, 2] != ids[6, 2]  # '100000000' and '00000000'
    assert len(set(ids[:, 2].tolist())) == len(set(row.split("\t")[16] for row in lines))
    for reader_ids in (read_criteo_tsv(path).ids,):
        np.testing.assert_array_equal(np.sort(reader_ids, axis=0), np.sort(ids, axis=0))
    out = tmp_path / "out.parquet"
    convert_tsv_to_parquet(path, out, progress=False)
    parquet_ids = np.concatenate([b.ids for b in BatchLoader(out, 10)])
    np.testing.assert_array_equal(np.sort(parquet_ids, axis=0), np.sort(ids, axis=0))
    # 17 digits are refused on every path, clearly
    fields = lines[7].split("\t")
    fields[16] = "1" * 17
    lines[7] = "\t".join(fields)
    path = write_lines(tmp_path / "day_1", lines)
    long = r"C3 '1{17}' is not a hex value of at most 16 digits"
    with pytest.raises(InputError, match=rf"day_1:8: bad Criteo line \({long}"):
        list(BatchLoader(path, 4))
    with pytest.raises(InputError, match=long):
        read_criteo_tsv(path)
    # a custom mod range (OneFlow's --mod_idx) folds, so it still refuses what would fold
    with pytest.raises(InputError, match="more than the 8 accepted"):
        list(BatchLoader(write_lines(tmp_path / "day_2", lines[:7]), 4,
                         key_scheme=KeyScheme(mode="mod", mod=40_000_000)))


def test_labels_must_be_exactly_0_or_1(tmp_path):
    lines = tsv_lines(6)
    for i, label in ((1, "-0"), (2, "01"), (3, "+1")):
        lines[i] = label + lines[i][1:]
    path = write_lines(tmp_path / "day_0", lines)
    with pytest.raises(InputError, match=r"day_0:2: bad Criteo line \(label '-0' is not 0 or 1"):
        list(BatchLoader(path, 6))
    skipping = BatchLoader(path, 6, on_bad_line="skip")
    assert sum(len(b) for b in skipping) == 3 and skipping.skipped == 3


def test_both_parsers_agree_on_the_hex_width_limit():
    rng = np.random.default_rng(5)
    lines = []
    for width in range(1, 18):
        cats = ["".join(rng.choice(list("0123456789abcdef"), width))] + tsv_lines(1)[0].split(
            "\t")[15:]
        lines.append("\t".join(tsv_lines(1)[0].split("\t")[:14] + cats))
    buf = np.frombuffer("\n".join(lines).encode(), np.uint8)
    for limit in (8, 12, 16):
        fast = parse_lines(buf, engine="numba", max_hex_digits=limit)
        spec = parse_lines(buf, engine="numpy", max_hex_digits=limit)
        np.testing.assert_array_equal(fast[4], spec[4])
        np.testing.assert_array_equal(spec[4], np.arange(1, 18) > limit)
        good = ~spec[4]
        np.testing.assert_array_equal(fast[1][good], spec[1][good])
    with pytest.raises(ConfigError, match="max_hex_digits=17"):
        parse_lines(buf, max_hex_digits=17)


@pytest.mark.parametrize("read_ahead", [0, 3])
def test_skipped_lines_count_once_over_epochs(tmp_path, read_ahead):
    lines = tsv_lines(300)
    for bad in (10, 150, 290):
        lines[bad] = "1\tbroken"
    path = write_lines(tmp_path / "day_0", lines)
    loader = BatchLoader(path, 50, on_bad_line="skip", shuffle=True, seed=1, read_ahead=read_ahead,
                         unit_bytes=20_000)
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert sum(len(b) for b in loader) == 297
        assert loader.skipped == 3


def test_skipped_does_not_depend_on_read_ahead(tmp_path):
    lines = tsv_lines(400)
    lines[390] = "1\tbroken"  # in the last unit
    path = write_lines(tmp_path / "day_0", lines)
    counts = []
    for read_ahead in (0, 50):
        loader = BatchLoader(path, 20, on_bad_line="skip", read_ahead=read_ahead, unit_bytes=5000)
        batches = iter(loader)
        next(batches)
        time.sleep(0.5 if read_ahead else 0)  # the thread reads the whole file meanwhile
        counts.append(loader.skipped)
        rest = list(batches)
        assert len(rest) == 19 and loader.skipped == 1
    assert counts == [0, 0]
