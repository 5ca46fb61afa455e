"""Raw Criteo TSV parsing: every quirk against a plain-Python reference, keys, bad input."""

import math

import numpy as np
import pytest
import xxhash

from one_embedding.data import (CriteoTSVReader, KeyScheme, TSVSource, parse_lines,
                                read_criteo_tsv, xxh64_u64)
from one_embedding.errors import ConfigError, InputError


MOD = 1 << 32


def reference(lines, has_label=True, mod=MOD):
    """Plain-Python parse of full or right-stripped lines: (dense float64, ids int64, labels)."""
    dense, ids, labels = [], [], []
    for line in lines:
        fields = line.rstrip("\r").split("\t")
        fields += [""] * ((40 if has_label else 39) - len(fields))
        if has_label:
            labels.append(float(fields.pop(0)))
        else:
            labels.append(float("nan"))
        dense.append([math.log(max(int(x), 0) + 1) if x else 0.0 for x in fields[:13]])
        ids.append([_key(int(x, 16), c, mod) if x else mod * 26 + c
                    for c, x in enumerate(fields[13:])])
    return np.array(dense), np.array(ids, np.int64), np.array(labels, np.float32)


def _key(value: int, column: int, mod: int) -> int:
    """KeyScheme "mod": value % mod + mod * column; a value of more than 32 bits under the
    default range gets XXH64(its 8 little-endian bytes, seed=column) with the top bit set."""
    if value >= mod >= 1 << 32:
        h = xxhash.xxh64_intdigest(value.to_bytes(8, "little"), seed=column) | 1 << 63
        return h - (1 << 64)  # as int64
    return value % mod + mod * column


def make_line(label="1", ints=None, cats=None, strip=0):
    ints = [str(i * 7 - 3) for i in range(13)] if ints is None else ints
    cats = [f"{(c * 2654435761) & 0xFFFFFFFF:08x}" for c in range(26)] if cats is None else cats
    fields = ([label] if label is not None else []) + list(ints) + list(cats)
    return "\t".join(fields[:len(fields) - strip])


def write(tmp_path, lines, name="part.tsv", end="\n", final_newline=True):
    path = tmp_path / name
    text = end.join(lines) + (end if final_newline else "")
    path.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
    return path


def check(path, lines, has_label=True, **options):
    batch = read_criteo_tsv(path, has_label=has_label, **options)
    dense, ids, labels = reference(lines, has_label)
    np.testing.assert_array_equal(batch.ids, ids)
    np.testing.assert_allclose(batch.dense, dense, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(batch.labels, labels)
    assert batch.dense.dtype == np.float32 and batch.ids.dtype == np.int64
    return batch


@pytest.mark.parametrize("engine", ["numba", "numpy"])
@pytest.mark.parametrize("block_bytes", [64, 1 << 20])
def test_quirks_match_reference(tmp_path, block_bytes, engine):
    cats_missing = [f"{c:08x}" if c % 3 else "" for c in range(26)]
    ints_missing = ["" if i % 4 == 0 else str(i) for i in range(13)]
    lines = [
        make_line(),                                       # 40 fields, negative I1
        make_line("0", ints=["-3", "-1", "0"] + [""] * 10),  # negatives clamp to 0
        make_line("0", cats=["ffffffff", "80000000", "7fffffff"] + [""] * 23),  # > 0x7fffffff
        make_line("1", ints=ints_missing, cats=cats_missing),
        make_line("0", cats=["AbCdEf01"] + [""] * 25),    # upper-case hex
        make_line("1", strip=1),                           # 39 fields
        make_line("0", strip=2),                           # 38 fields
        make_line("1", strip=3),                           # 37 fields
        make_line("0", ints=["123456789012345678"] + [""] * 12),  # 18 digits
        make_line("1", cats=["1"] + ["ffffffffffffffff"] * 25),  # short and 64-bit hex
    ]
    path = write(tmp_path, lines)
    batch = check(path, lines, block_bytes=block_bytes, engine=engine)
    assert batch.dense[1, 0] == 0.0 and batch.dense[1, 1] == 0.0
    assert batch.ids[2, 0] == 0xFFFFFFFF and batch.ids[2, 1] == 0x80000000 + MOD


def test_trailing_tab_means_empty_last_field(tmp_path):
    lines = [make_line(cats=[f"{c:x}" for c in range(25)] + [""])]
    assert lines[0].endswith("\t")
    check(write(tmp_path, lines), lines)


def test_kaggle_test_file_without_label(tmp_path):
    lines = [make_line(None), make_line(None, strip=2), make_line(None, ints=[""] * 13)]
    path = write(tmp_path, lines)
    batch = check(path, lines, has_label=False)
    assert np.isnan(batch.labels).all()
    # read as labelled, line 1 is a valid 39-field stripped line whose label would be '-3'
    with pytest.raises(InputError, match=r"part\.tsv:1: .*label '-3' is not 0 or 1 \(an unlabelled "
                                         r"test\.txt line\? pass has_label=False; convert "
                                         r"--no-label\)"):
        read_criteo_tsv(path)


def test_crlf_and_missing_final_newline(tmp_path):
    lines = [make_line("1"), make_line("0", strip=2)]
    check(write(tmp_path, lines, end="\r\n"), lines)
    check(write(tmp_path, lines[::-1], name="b.tsv", final_newline=False), lines[::-1])
    # a stripped last line needs its newline: without one it looks like a cut (issue 29 item 9)
    with pytest.raises(InputError, match=r"c\.tsv:2: .*after 38 of 40 fields"):
        read_criteo_tsv(write(tmp_path, lines, name="c.tsv", final_newline=False))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.tsv"
    path.write_bytes(b"")
    batch = read_criteo_tsv(path)
    assert len(batch) == 0 and batch.ids.shape == (0, 26)


def test_missing_keys_are_reserved_and_distinct():
    scheme = KeyScheme(mod=1000)
    keys = scheme.keys(np.zeros((1, 26), np.uint64), np.zeros((1, 26), bool))[0]
    assert list(keys) == [26000 + c for c in range(26)]
    hashed = KeyScheme(mode="hash").missing_keys()
    assert len(set(hashed.tolist())) == 26 and (hashed >= 0).all()
    assert hashed[3] == xxhash.xxh64_intdigest(b"", seed=3) & ((1 << 63) - 1)


def test_mod_scheme_like_oneflow(tmp_path):
    lines = [make_line(cats=[f"{0xfedcba98 - c:08x}" for c in range(26)])]
    batch = read_criteo_tsv(write(tmp_path, lines), key_scheme=KeyScheme(mod=40_000_000))
    expected = [(0xfedcba98 - c) % 40_000_000 + 40_000_000 * c for c in range(26)]
    assert batch.ids[0].tolist() == expected


def test_hash_scheme_is_xxh64_of_value_and_column(tmp_path):
    values = [0xfedcba98 - 17 * c for c in range(25)]
    lines = [make_line(cats=[f"{v:08x}" for v in values] + [""])]
    batch = read_criteo_tsv(write(tmp_path, lines), key_scheme=KeyScheme(mode="hash"))
    expected = [xxhash.xxh64_intdigest(v.to_bytes(8, "little"), seed=c) & ((1 << 63) - 1)
                for c, v in enumerate(values)]
    expected.append(xxhash.xxh64_intdigest(b"", seed=25) & ((1 << 63) - 1))
    assert batch.ids[0].tolist() == expected
    rng = np.random.default_rng(0)
    v = rng.integers(0, 1 << 63, 1000, dtype=np.uint64)
    assert xxh64_u64(v, 7).tolist() == [xxhash.xxh64_intdigest(int(x).to_bytes(8, "little"), seed=7)
                                        for x in v]


def test_key_scheme_validation():
    with pytest.raises(ConfigError, match="mode='md5'"):
        KeyScheme(mode="md5")
    with pytest.raises(ConfigError, match="mod=0"):
        KeyScheme(mod=0)
    with pytest.raises(ConfigError, match="overflows int64"):
        KeyScheme(mod=1 << 60)


BAD_LINES = [
    (make_line(strip=4), r"36 tab-separated fields, expected 37\.\.40"),
    (make_line() + "\tx", r"41 tab-separated fields"),
    (make_line(cats=["12g45678"] + [""] * 25), r"C1 '12g45678' is not a hex value"),
    (make_line(ints=["1.5"] + [""] * 12), r"I1 '1\.5' is not an integer"),
    (make_line(ints=["-"] + [""] * 12), r"I1 '-' is not an integer"),
    (make_line(ints=["1234567890123456789"] + [""] * 12), r"at most 18 digits"),
    (make_line(label="2"), r"label '2' is not 0 or 1"),
    (make_line(label=""), r"label '' is not 0 or 1"),
    (make_line(cats=["12345678901234567"] + [""] * 25), r"at most 16 digits"),
    (" ", r"1 tab-separated fields"),  # an empty line is skipped, not bad (test_blank_lines_...)
]


@pytest.mark.parametrize("engine", ["numba", "numpy"])
@pytest.mark.parametrize("bad, reason", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, bad, reason, engine):
    lines = [make_line(), make_line("0"), bad, make_line()]
    path = write(tmp_path, lines)
    with pytest.raises(InputError, match=rf"part\.tsv:3: bad Criteo line \(.*{reason}"):
        read_criteo_tsv(path, block_bytes=50, engine=engine)
    reader = CriteoTSVReader(path, on_bad_line="skip", engine=engine)
    chunks = list(reader)
    assert reader.skipped == 1 and reader.rows == 3
    np.testing.assert_array_equal(np.concatenate([c.ids for c in chunks]),
                                  reference([lines[0], lines[1], lines[3]])[1])


def test_binary_garbage_and_non_utf8(tmp_path):
    good = make_line().encode()
    garbage = b"\x00\xff\xfe\x89PNG\r\x1a" + bytes(range(128, 200))
    non_utf8 = make_line(cats=["ab\xe9cd"] + [""] * 25).encode("latin-1")
    path = tmp_path / "bin.tsv"
    path.write_bytes(b"\n".join([good, good, good, garbage, non_utf8, good]) + b"\n")
    with pytest.raises(InputError, match=r"bin\.tsv:4: bad Criteo line"):
        read_criteo_tsv(path)
    reader = CriteoTSVReader(path, on_bad_line="skip")
    assert sum(len(c) for c in reader) == 4 and reader.skipped == 2


def test_overlong_binary_line(tmp_path, monkeypatch):
    import one_embedding.data.tsv as tsv
    monkeypatch.setattr(tsv, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "long.tsv"
    path.write_bytes((make_line() + "\n").encode() + b"\x01" * 10000 + b"\n" +
                     (make_line("0") + "\n").encode())
    with pytest.raises(InputError, match=r"long\.tsv:2: a line longer than 4096 bytes"):
        read_criteo_tsv(path, block_bytes=1000)
    reader = CriteoTSVReader(path, on_bad_line="skip", block_bytes=1000)
    labels = np.concatenate([c.labels for c in reader])
    assert labels.tolist() == [1.0, 0.0] and reader.skipped == 1


def test_line_numbers_in_a_later_byte_range(tmp_path):
    lines = [make_line()] * 50 + [make_line(label="7")] + [make_line()] * 9
    path = write(tmp_path, lines)
    size = path.stat().st_size
    with pytest.raises(InputError, match=r"part\.tsv:51: "):
        list(CriteoTSVReader(path, start=size // 2, end=size))


def test_byte_ranges_cover_each_line_once(tmp_path):
    rng = np.random.default_rng(3)
    lines = [make_line(str(i % 2), strip=int(rng.integers(0, 4)),
                       cats=[f"{int(v):x}" for v in rng.integers(0, 1 << 32, 26)])
             for i in range(300)]
    path = write(tmp_path, lines)
    whole = read_criteo_tsv(path)
    for parts in (1, 2, 7, 64):
        source = TSVSource(path, unit_bytes=10**9)
        units = source.units(min_units=parts)
        assert len(units) == parts
        chunks = [c for u in units for c in source.read_unit(u)]
        np.testing.assert_array_equal(np.concatenate([c.ids for c in chunks]), whole.ids)
        positions = np.concatenate([c.positions for c in chunks])
        assert len(np.unique(positions)) == len(lines)


def test_options_validated():
    with pytest.raises(ConfigError, match="on_bad_line='ignore'"):
        CriteoTSVReader("x.tsv", on_bad_line="ignore")


@pytest.mark.parametrize("name, rows, field_counts", [
    ("criteo1tb_day0_head1000.tsv", 1000, {40}),
    ("kaggle_train_sample_a_100.tsv", 100, {40}),
    ("kaggle_train_sample_b_100_stripped.tsv", 100, {37, 38, 40}),
    ("kaggle_train_sample_c_100_stripped.tsv", 100, {37, 38, 40}),
])
def test_real_criteo_rows(name, rows, field_counts, criteo_dir):
    path = criteo_dir / name
    lines = path.read_text().splitlines()
    assert {len(line.split("\t")) for line in lines} == field_counts
    batch = check(path, lines, block_bytes=4096)
    assert len(batch) == rows
    assert set(np.unique(batch.labels)) <= {0.0, 1.0}
    real = batch.ids[batch.ids < MOD * 26]
    assert ((real % MOD) > 0x7FFFFFFF).mean() > 0.3  # about 44% of Criteo's hex exceed int32


@pytest.mark.parametrize("has_label", [True, False])
def test_compiled_parser_matches_numpy_reference(has_label):
    """The numba kernel against the numpy specification on quirks, bad lines and random bytes."""
    rng = np.random.default_rng(8)
    label = "1" if has_label else None
    lines = [make_line(label, strip=int(k)) for k in rng.integers(0, 5, 40)]
    lines += [bad for bad, _ in BAD_LINES] + ["", "\t", "1\r", make_line(label) + "\r"]
    lines += [make_line(label, ints=[str(int(v)) for v in rng.integers(-10**18, 10**18, 13)])]
    text = "\n".join(lines).encode()
    noise = rng.integers(0, 256, 3000, dtype=np.uint8)
    noise[rng.random(3000) < 0.05] = 9
    noise[rng.random(3000) < 0.01] = 10
    for data in (text, text + b"\n", text + noise.tobytes(), b"", b"\n\n"):
        buf = np.frombuffer(data, np.uint8)
        fast = parse_lines(buf, has_label=has_label, engine="numba")
        spec = parse_lines(buf, has_label=has_label, engine="numpy")
        np.testing.assert_array_equal(fast[3], spec[3])  # line starts
        np.testing.assert_array_equal(fast[4], spec[4])  # bad mask
        good = ~spec[4]
        assert good.sum() >= (20 if data.startswith(text) else 0)
        for f, r in zip(fast[:3], spec[:3]):
            np.testing.assert_array_equal(f[good], r[good])
