"""Raw TSV files as they come: Kaggle's test.txt read as labelled, compressed downloads, a UTF-8
byte order mark, blank lines (concatenated files) and CRLF endings, through every read path
(whole file, small blocks, byte-range units, the loader and its resume)."""

import bz2
import gzip
import lzma

import numpy as np
import pytest

from one_embedding.data import (BatchLoader, CriteoTSVReader, TSVSource, convert_tsv_to_parquet,
                                read_criteo_tsv)
from one_embedding.data.tsv import FILE_SHIFT
from one_embedding.errors import InputError

ENGINES = ["numba", "numpy"]
BOM = b"\xef\xbb\xbf"


def labelled_lines(rows, seed=0, stripped=False):
    """Criteo lines, label first (40 fields); stripped: trailing empty fields removed, as some
    copies do (lines of 37..40 fields). list of str."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        ints = ["" if rng.random() < 0.2 else str(int(v)) for v in rng.integers(-3, 1000, 13)]
        cats = ["" if rng.random() < 0.2 else f"{int(v):08x}"
                for v in rng.integers(0, 1 << 32, 26)]
        fields = [str(i % 2)] + ints + cats
        if stripped:
            while len(fields) > 37 and fields[-1] == "":
                fields.pop()
        lines.append("\t".join(fields))
    return lines


def kaggle_test_lines(rows, seed=1):
    """Kaggle test.txt lines (I1..I13, C1..C26: 39 fields, no label) that each also read as a
    valid labelled line stripped of an empty C26: I1 is 0 or 1, C1 (which lands in I13) is
    all decimal digits or empty."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        ints = [str(i % 2)] + [str(int(v)) for v in rng.integers(0, 500, 12)]
        cats = ["" if i % 3 == 0 else f"{int(rng.integers(0, 10**8)):08d}"] + \
            [f"{int(v):08x}" for v in rng.integers(0, 1 << 32, 25)]
        lines.append("\t".join(ints + cats))
    return lines


def write(path, lines, end="\n", prefix=b""):
    path.write_bytes(prefix + (end.join(lines) + end).encode())
    return path


def rows_of(batch_or_chunks):
    """(dense, ids, labels) of a Batch or of a list of Chunks."""
    if isinstance(batch_or_chunks, list):
        return [np.concatenate([getattr(c, k) for c in batch_or_chunks]) if batch_or_chunks
                else None for k in ("dense", "ids", "labels")]
    return [batch_or_chunks.dense, batch_or_chunks.ids, batch_or_chunks.labels]


def assert_same_rows(a, b):
    for x, y in zip(rows_of(a), rows_of(b)):
        np.testing.assert_array_equal(x, y)


def unit_reads(path, unit_bytes, **options):
    """Every unit of a TSVSource, read one by one: (chunks, positions, skipped)."""
    source = TSVSource(path, unit_bytes=unit_bytes, **options)
    chunks = [c for unit in source.units() for c in source.read_unit(unit)]
    positions = np.concatenate([c.positions for c in chunks]) if chunks else np.zeros(0, np.int64)
    return chunks, positions, source.skipped


# --- Kaggle's test.txt (no label column) read as labelled ----------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_unlabelled_file_read_as_labelled_is_never_read_shifted(tmp_path, engine):
    """Every line here also reads as a labelled line stripped of its empty C26, every column
    shifted by one (label <- I1, ..., C1 <- I13): such lines were accepted under skip, and the
    error named no missing label column."""
    lines = kaggle_test_lines(60)
    path = write(tmp_path / "test.txt", lines)
    unlabelled = read_criteo_tsv(path, has_label=False, engine=engine)
    assert len(unlabelled) == 60 and np.isnan(unlabelled.labels).all()
    with pytest.raises(InputError, match=r"test\.txt:1: bad Criteo line \(39 fields, and no line "
                                         r".*has 40: a file without labels\?.* every column would "
                                         r"shift by one .*pass has_label=False; convert "
                                         r"--no-label\)"):
        read_criteo_tsv(path, engine=engine)
    for block_bytes in (100, 1 << 20):
        reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine, block_bytes=block_bytes)
        assert sum(len(c) for c in reader) == 0 and reader.skipped == 60
    chunks, _, skipped = unit_reads(path, 500, on_bad_line="skip", engine=engine)
    assert chunks == [] and skipped == 60
    assert list(BatchLoader(TSVSource(path, unit_bytes=500, on_bad_line="skip"), 8)) == []


def test_an_unlabelled_line_in_a_labelled_file_gets_the_hint(tmp_path):
    """A test.txt line whose I1 is 0 or 1 failed on I13 (its C1) with no word of the label."""
    fields = kaggle_test_lines(1)[0].split("\t")
    fields[13] = "f62f2a74"  # C1, read as labelled: I13
    path = write(tmp_path / "mixed.tsv", labelled_lines(5) + ["\t".join(fields)])
    with pytest.raises(InputError, match=r"mixed\.tsv:6: bad Criteo line \(I13 'f62f2a74' is not "
                                         r"an integer of at most 18 digits \(an unlabelled "
                                         r"test\.txt line\? pass has_label=False; convert "
                                         r"--no-label\)\)"):
        read_criteo_tsv(path)


@pytest.mark.parametrize("engine", ENGINES)
def test_stripped_labelled_lines_still_read(tmp_path, engine):
    """Lines stripped of trailing empty fields (37..39 fields) in a labelled file keep reading,
    padded with missing fields, a 39-field one included."""
    lines = labelled_lines(300, stripped=True)
    assert {len(line.split("\t")) for line in lines} == {37, 38, 39, 40}
    path = write(tmp_path / "stripped.tsv", lines)
    padded = write(tmp_path / "padded.tsv", labelled_lines(300))
    assert_same_rows(read_criteo_tsv(path, engine=engine), read_criteo_tsv(padded, engine=engine))


# --- compressed files ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, compress", [("gzip", gzip.compress), ("bzip2", bz2.compress),
                                            ("xz", lzma.compress),
                                            ("zstd", lambda b: b"\x28\xb5\x2f\xfd" + b)])
def test_compressed_file_is_refused_by_reader_and_source(tmp_path, name, compress):
    """Read as TSV, day_0.gz was a few bad lines (and the advice to skip them), or under skip no
    rows and no error."""
    good = write(tmp_path / "day_1", labelled_lines(20))
    path = tmp_path / "day_0.gz"
    path.write_bytes(compress(good.read_bytes()))
    refusal = rf"day_0\.gz is {name}-compressed: decompress it first"
    with pytest.raises(InputError, match=refusal):
        read_criteo_tsv(path)
    with pytest.raises(InputError, match=refusal):
        CriteoTSVReader(path, on_bad_line="skip")
    with pytest.raises(InputError, match=refusal):
        TSVSource(path, on_bad_line="skip")
    with pytest.raises(InputError, match=refusal):
        TSVSource([good, path], on_bad_line="skip")  # not only the first file is checked


# --- a UTF-8 byte order mark ---------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_byte_order_mark_at_the_start_is_skipped(tmp_path, engine, end):
    """'\\ufeff1' was a bad label: the file failed, or skip dropped its first row."""
    lines = labelled_lines(30)
    clean = read_criteo_tsv(write(tmp_path / "clean.tsv", lines, end), engine=engine)
    path = write(tmp_path / "bom.tsv", lines, end, prefix=BOM)
    for block_bytes in (7, 100, 1 << 20):
        assert_same_rows(read_criteo_tsv(path, engine=engine, block_bytes=block_bytes), clean)
    reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine)
    assert_same_rows(list(reader), clean)
    assert reader.skipped == 0
    # every split into byte ranges, a boundary inside the mark included, reads each row once
    for unit_bytes in (1, 2, 3, 4, 5, 50, 1000, 1 << 20):
        chunks, positions, skipped = unit_reads(path, unit_bytes, engine=engine)
        assert_same_rows(chunks, clean)
        assert skipped == 0 and positions[0] == len(BOM) and (np.diff(positions) > 0).all()
    # only at the file's start: a mark inside the file is a bad line
    (tmp_path / "inside.tsv").write_bytes((end.join(lines[:2]) + end).encode() + BOM +
                                          (end.join(lines[2:]) + end).encode())
    with pytest.raises(InputError, match=r"inside\.tsv:3: bad Criteo line \(label '\\ufeff0'"):
        read_criteo_tsv(tmp_path / "inside.tsv", engine=engine)


def test_byte_order_mark_then_the_only_line_without_newline(tmp_path):
    line = labelled_lines(1)[0]
    (tmp_path / "one.tsv").write_bytes(BOM + line.encode())
    (tmp_path / "clean.tsv").write_bytes(line.encode())
    assert_same_rows(read_criteo_tsv(tmp_path / "one.tsv"), read_criteo_tsv(tmp_path / "clean.tsv"))


# --- blank lines ---------------------------------------------------------------------------------

def with_blanks(lines, end):
    """The text of ``lines`` with empty lines at the start, between files (twice in a row) and at
    the end, as concatenating files or ``echo >> file`` leave them."""
    return (end + end.join(lines[:10]) + end + end + end + end.join(lines[10:25]) + end + end +
            end.join(lines[25:]) + end + end).encode()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_blank_lines_are_skipped_not_bad(tmp_path, engine, end):
    """A blank line was a hard error ('1 tab-separated fields ...: ''')."""
    lines = labelled_lines(40, stripped=True)
    clean = read_criteo_tsv(write(tmp_path / "clean.tsv", lines, end), engine=engine)
    path = tmp_path / "blank.tsv"
    path.write_bytes(with_blanks(lines, end))
    for block_bytes in (5, 100, 1 << 20):
        assert_same_rows(read_criteo_tsv(path, engine=engine, block_bytes=block_bytes), clean)
        reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine, block_bytes=block_bytes)
        assert_same_rows(list(reader), clean)
        assert reader.skipped == 0 and reader.rows == 40
    for unit_bytes in (1, 2, 40, 333, 1000, 1 << 20):
        chunks, positions, skipped = unit_reads(path, unit_bytes, engine=engine)
        assert_same_rows(chunks, clean)
        assert skipped == 0 and (np.diff(positions) > 0).all()
    # with a bad line among them, the bad line's number counts the blank lines before it
    bad = lines[:20] + ["1\tbroken"] + lines[20:]
    path.write_bytes(with_blanks(bad, end))
    with pytest.raises(InputError, match=r"blank\.tsv:24: bad Criteo line \(2 tab-separated"):
        read_criteo_tsv(path, engine=engine)
    reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine)
    assert_same_rows(list(reader), clean)
    assert reader.skipped == 1


def test_only_blank_lines_and_a_byte_order_mark(tmp_path):
    for data in (b"\n", b"\n\n\n", b"\r\n\r\n", BOM, BOM + b"\n", BOM + b"\r\n\n"):
        (tmp_path / "empty.tsv").write_bytes(data)
        reader = CriteoTSVReader(tmp_path / "empty.tsv", on_bad_line="error")
        assert list(reader) == [] and reader.skipped == 0, data
        chunks, _, skipped = unit_reads(tmp_path / "empty.tsv", 1)
        assert chunks == [] and skipped == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_blank_lines_keep_positions_and_resume_consistent(tmp_path, shuffle):
    """Positions identify rows (the byte offset of each line): the same whatever the units, so
    the loader's split and resume see the same rows with the blank lines skipped."""
    lines = labelled_lines(400, seed=3)
    path = tmp_path / "day_0.tsv"
    path.write_bytes(BOM + with_blanks(lines, "\n"))
    clean = read_criteo_tsv(write(tmp_path / "clean.tsv", lines))
    _, reference, _ = unit_reads(path, 1 << 30)
    for unit_bytes in (3000, 7001):
        chunks, positions, _ = unit_reads(path, unit_bytes)
        np.testing.assert_array_equal(positions, reference)
        assert_same_rows(chunks, clean)
        assert (positions >> FILE_SHIFT == 0).all()
    text = path.read_bytes()
    starts = np.array([i for i in range(len(text))
                       if (i == len(BOM) or text[i - 1:i] == b"\n") and text[i:i + 1] != b"\n"
                       and i < len(text)])
    np.testing.assert_array_equal(reference, starts)  # each row at its line's first byte
    options = dict(shuffle=shuffle, shuffle_buffer=100, seed=5, split="train", eval_fraction=0.25)
    full = list(BatchLoader(TSVSource(path, unit_bytes=3000), 32, read_ahead=0, **options))
    assert len(full) >= 6
    for k in (1, len(full) // 2, len(full) - 1):
        loader = BatchLoader(TSVSource(path, unit_bytes=3000), 32, read_ahead=0, **options)
        loader.set_epoch(0, start_batch=k)
        tail = list(loader)
        assert len(tail) == len(full) - k
        for got, want in zip(tail, full[k:]):
            np.testing.assert_array_equal(got.ids, want.ids)
            np.testing.assert_array_equal(got.labels, want.labels)


@pytest.mark.parametrize("layout", ["one_embedding", "oneflow"])
def test_conversion_of_a_file_with_a_mark_and_blank_lines(tmp_path, layout):
    """Both layouts (OneFlow's re-scans each block for the raw integers and finds its rows by
    position) convert the file as they convert it clean."""
    import pyarrow.parquet as pq

    lines = labelled_lines(60, seed=4, stripped=True)
    path = tmp_path / "quirks.tsv"
    path.write_bytes(BOM + with_blanks(lines, "\r\n"))
    clean = write(tmp_path / "clean.tsv", lines)
    out = {}
    for name, src in (("quirks", path), ("clean", clean)):
        out[name] = tmp_path / f"{name}.parquet"
        stats = convert_tsv_to_parquet(src, out[name], layout=layout, progress=False,
                                       block_bytes=512)
        assert stats["rows"] == 60 and stats["skipped"] == 0
    assert pq.read_table(out["quirks"]).equals(pq.read_table(out["clean"]))
