"""Raw TSV files as they come: compressed downloads refused by the reader and the source."""

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
