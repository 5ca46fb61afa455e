"""Raw TSV files as they come: compressed downloads and a UTF-8 byte order mark, through every
read path (whole file, small blocks, byte-range units)."""

import bz2
import gzip
import lzma

import numpy as np
import pytest

from one_embedding.data import CriteoTSVReader, TSVSource, read_criteo_tsv
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
