"""Raw Criteo TSV: Kaggle train.txt / test.txt and the 1TB set's day_N files.

A line is ``label, I1..I13, C1..C26`` (40 fields; Kaggle test.txt has no label: 39), tab-separated,
missing = empty field. Some copies strip trailing empty fields, so a line of 37..39 fields
(36..38 without label) is read as right-padded with missing fields. Integers may be negative;
categoricals are hex (Criteo's are 8 characters; see ``max_hex_digits`` below). Keys and the dense
transform follow ``schema.KeyScheme`` and ``schema.dense_log``.

Categorical width. Every path accepts up to 16 hex digits (data hashed to 64 bits) and keeps each
value its own key (``KeyScheme.keys``: under the default range a value past 32 bits is hashed into
a range of its own instead of folding); a longer field is a bad line. Only a custom ``mode="mod"``
range below 2**32 (OneFlow's ``--mod_idx``) folds wide values, so the paths that feed training,
``TSVSource`` (the loader's source) and ``convert_tsv_to_parquet``, accept only Criteo's 8 digits
there. See ``default_max_hex_digits``. A label is exactly ``0`` or ``1`` (``-0``, ``01`` are bad
lines).

Truncated files. The last line of a file that does not end in a newline may be a partial download.
It is accepted only if it has every field (40; 39 without labels) and its last field, C26, holds
exactly Criteo's 8 hex characters; any other such line is a bad line ("the file ends inside this
line"), as any line of a wrong field count is: cut inside a field, right after a tab, or right
after a complete field (which a stripped 37..39-field line would look like: a cut there cannot be
told from one, so it is refused too). A complete file whose last line is stripped, or ends in an
empty field or in a shorter hex value, needs a final newline to be read.

Unlabelled files read as labelled. A test.txt line (39 fields) would read as a labelled line
stripped of an empty C26 with every column shifted by one (label <- I1, ..., C1 <- I13) whenever
its I1 is 0 or 1 and its C1 all decimal digits. So a file read as labelled whose first 64 KiB hold
a 39-field line and no 40-field one is taken for such a file: none of its lines shorter than 40
fields is accepted (each is a bad line whose error says to pass has_label=False). A stripped
labelled file has whole lines among its first ones in practice (Criteo's C25 and C26 are missing
together, so its stripped lines have 37 or 38 fields; C26 is present in about half the rows). A
bad line that reads as an unlabelled line gets the same hint.

Other file quirks. A UTF-8 byte order mark at the start of a file is skipped (line 1 then starts,
and has its position, after it); one elsewhere is part of its line. Empty lines (``\\n``,
``\\r\\n``), e.g. where files were concatenated, are skipped: no row and no bad line. ``\\r\\n``
endings read as ``\\n``. A gzip, zstd, bzip2 or xz file is refused when a reader or source is made
(``refuse_compressed``).

Parsing is vectorized per block of lines (default 1 MiB): newline and tab positions give a
(lines, fields) table of field starts and ends, the first bytes of every field are gathered into a
(lines, fields, width) array, and digits are combined one character position at a time across all
fields. Only the explanation of a bad line re-reads that single line in Python. Measured ~0.25 M
rows/s (1TB-style lines, one core of the 2-core dev machine).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import numpy as np

from ..errors import ConfigError, InputError
from .schema import NUM_DENSE, NUM_SPARSE, Batch, KeyScheme, dense_log

MAX_LINE_BYTES = 1 << 20  # a "line" longer than this is binary garbage, not a Criteo row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark some editors write at a file's start: skipped
HEAD_BYTES = 64 << 10  # how much of a file's start tells a labelled file from an unlabelled one

#: (magic bytes, format, the tool that decompresses it) of compressed files a source may be
COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
              (b"BZh", "bzip2", "bunzip2 -k"), (b"\xfd7zXZ", "xz", "unxz -k"))


def refuse_compressed(path) -> None:
    """InputError when ``path`` starts with the magic bytes of a compressed format (Criteo 1TB
    ships ``day_N.gz``: read as TSV its bytes were a few bad lines, and skipping bad lines dropped
    them all). A file that cannot be opened is left to the read that follows."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return
    for magic, name, tool in COMPRESSED:
        if head.startswith(magic):
            raise InputError(f"{path} is {name}-compressed: decompress it first ({tool} "
                             f"{path}) and pass the file it gives")

_HEX = np.full(256, -1, dtype=np.int16)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


@dataclasses.dataclass
class Chunk:
    """Rows read from one source, in file order.

    dense: (N, 13) float32; ids: (N, 26) int64; labels: (N,) float32 (NaN when unlabelled);
    positions: (N,) int64, the row's identity within its file (byte offset of the line for TSV,
    row index for Parquet and synthetic data), used by splits and shuffles.
    """

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index) -> "Chunk":
        return Chunk(self.dense[index], self.ids[index], self.labels[index], self.positions[index])

    def batch(self) -> Batch:
        return Batch(self.dense, self.ids, self.labels)


_DIGIT = np.full(256, -1, dtype=np.int8)
_DIGIT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """The first ``width`` bytes from each field start: (N, K, width) uint8, one index per field."""
    padded = np.concatenate([buf, np.zeros(width, np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    return windows[starts]


def _parse_ints(buf, starts, ends):
    """Signed decimal fields. Returns values (N, K) int64, present (N, K) bool, bad (N, K) bool."""
    lengths = ends - starts
    present = lengths > 0
    width = int(min(lengths.max(initial=0), 20))
    values = np.zeros(lengths.shape, np.int64)
    bad = np.zeros(lengths.shape, bool)
    if width == 0:
        return values, present, bad
    ch = _gather(buf, starts, width)
    neg = present & (ch[..., 0] == 45)  # '-'
    n_digits = lengths - neg
    bad |= present & ((n_digits < 1) | (n_digits > 18))
    for p in range(width):
        digit = _DIGIT[ch[..., p]]
        inside = (p < lengths) & ~(neg & (p == 0))
        bad |= inside & (digit < 0)
        values = np.where(inside, values * 10 + digit, values)
    values = np.where(neg, -values, values)
    return np.where(bad, 0, values), present, bad


def _parse_hex(buf, starts, ends, max_digits: int = 16):
    """Hex fields of at most ``max_digits`` digits.
    Returns values (N, K) uint64, present (N, K) bool, bad (N, K) bool."""
    lengths = ends - starts
    present = lengths > 0
    width = int(min(lengths.max(initial=0), max_digits + 1))
    values = np.zeros(lengths.shape, np.uint64)
    bad = lengths > max_digits
    if width == 0:
        return values, present, bad
    ch = _gather(buf, starts, width)
    for p in range(width):
        digit = _HEX[ch[..., p]]
        inside = p < lengths
        bad |= inside & (digit < 0)
        values = np.where(inside, (values << np.uint64(4)) | digit.astype(np.uint64), values)
    return values, present, bad


UNLABELLED_HINT = " (an unlabelled test.txt line? pass has_label=False; convert --no-label)"


def _field_problem(fields: list, has_label: bool, max_hex_digits: int) -> str | None:
    """Why the first bad field of a line of an accepted field count is bad (None: none is)."""
    names = (["label"] if has_label else []) + [f"I{i}" for i in range(1, 14)] + \
        [f"C{i}" for i in range(1, 27)]
    for name, field in zip(names, fields):
        text = field.decode("utf-8", "backslashreplace")
        if name == "label":
            if field not in (b"0", b"1"):
                return f"label {text!r} is not 0 or 1"
        elif name.startswith("I") and field:
            body = field[1:] if field[:1] == b"-" else field
            if not body.isdigit() or not body.isascii() or len(body) > 18:
                return f"{name} {text!r} is not an integer of at most 18 digits"
        elif name.startswith("C") and field:
            if any(b not in b"0123456789abcdefABCDEF" for b in field) or len(field) > 16:
                return f"{name} {text!r} is not a hex value of at most 16 digits"
            if len(field) > max_hex_digits:
                return (f"{name} {text!r} has {len(field)} hex digits, more than the "
                        f"{max_hex_digits} accepted (Criteo's have 8; under key_scheme "
                        f"mode='mod' a wider value folds, value % mod, onto another and shares "
                        f"its embedding row); if such values are meant, use "
                        f"KeyScheme(mode='hash'), which keeps all 64 bits")
    return None


def _reads_unlabelled(line: bytes, max_fields: int, max_hex_digits: int = 16) -> bool:
    """Whether a line that is not a whole labelled line (fewer than ``max_fields`` fields) reads
    as a line without a label (Kaggle's test.txt: 39 fields, or 36..38 when stripped)."""
    fields = line.rstrip(b"\r").split(b"\t")
    return max_fields - 4 <= len(fields) < max_fields and \
        _field_problem(fields, False, max_hex_digits) is None


def _explain(line: bytes, has_label: bool, min_fields: int, max_fields: int,
             max_hex_digits: int = 16, unlabelled_head: bool = False) -> str:
    """Why one line is bad, in words (the slow path, only for error messages). A labelled line
    that would read as an unlabelled one gets the hint to pass has_label=False; unlabelled_head:
    the file's start has no whole labelled line (``_head_is_unlabelled``), so none shorter is
    accepted."""
    fields = line.rstrip(b"\r").split(b"\t")
    count = len(fields)
    if not (min_fields <= count <= max_fields):
        reason = f"{count} tab-separated fields, expected {min_fields}..{max_fields}"
    else:
        fields += [b""] * (max_fields - len(fields))
        reason = _field_problem(fields, has_label, max_hex_digits)
    if reason is None and has_label and unlabelled_head and count < max_fields:
        reason = (f"{count} fields, and no line in the file's first {HEAD_BYTES >> 10} KiB has "
                  f"{max_fields}: a file without labels? Read as labelled, every column would "
                  f"shift by one (label <- I1, ..., C1 <- I13)")
    reason = reason or "unparseable line"
    if has_label and _reads_unlabelled(line, max_fields, max_hex_digits):
        reason += UNLABELLED_HINT
    return reason


CRITEO_HEX_DIGITS = 8  # Criteo's categoricals are 32-bit hashes written as 8 hex characters


def default_max_hex_digits(key_scheme: KeyScheme) -> int:
    """The widest categorical the training paths accept: 16 hex digits (64 bits, each value
    its own key: ``KeyScheme.keys``), except under a custom ``mode="mod"`` range smaller than
    2**32 (OneFlow's ``--mod_idx``), where only Criteo's 8 are accepted: a wider value would
    fold onto another and share its row."""
    if key_scheme.mode == "mod" and not key_scheme.keeps_wide_values:
        return CRITEO_HEX_DIGITS
    return 16


def _head_is_unlabelled(path: str, max_fields: int) -> bool:
    """Whether a file read as labelled looks like Kaggle's test.txt, which has no label column:
    among the whole lines of its first ``HEAD_BYTES`` none has ``max_fields`` (40) fields and one
    has one fewer (39). Such lines would read with every column shifted by one (label <- I1, ...,
    C1 <- I13) as lines stripped of an empty C26, so in such a file a line of fewer than 40
    fields is a bad line. A labelled file, stripped or not, has whole lines in its first lines
    (Criteo's C25 and C26 are missing together, so its stripped lines have 37 or 38 fields)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return False  # the read that follows names the problem
    if len(head) == HEAD_BYTES:
        head = head[:head.rfind(b"\n") + 1]  # whole lines only
    counts = {line.count(b"\t") + 1 for line in head.split(b"\n") if line.rstrip(b"\r")}
    return max_fields not in counts and max_fields - 1 in counts


def _blank_lines(buf: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(N,) bool: which of the lines starting at ``starts`` in ``buf`` are empty ("\\n",
    "\\r\\n", or a last "\\r"), e.g. where files were concatenated: skipped, not bad lines."""
    n = buf.size
    if not starts.size:
        return np.zeros(0, bool)
    first = buf[np.minimum(starts, n - 1)]
    second = np.where(starts + 1 < n, buf[np.minimum(starts + 1, n - 1)], 10)
    return (first == 10) | ((first == 13) & (second == 10))


def _explain_cut(line: bytes, min_fields: int, max_fields: int) -> str | None:
    """Why the final, newline-less line of a file looks cut off (None: it looks complete).

    The rule (module docstring): every field (``max_fields``; a stripped line cannot be told
    from one cut after a complete field), and a last field, C26, of exactly 8 characters."""
    fields = line.rstrip(b"\r").split(b"\t")
    count, last = len(fields), fields[-1]
    first_sparse = max_fields - NUM_SPARSE
    if not (min_fields <= count <= max_fields):
        return (f"the file ends inside this line, without a newline, after {count} of "
                f"{min_fields}..{max_fields} fields: a partial download? Fetch the file again")
    if count < max_fields:
        return (f"the file ends inside this line, without a newline, after {count} of "
                f"{max_fields} fields: a partial download? Fetch the file again, or add the final "
                f"newline if it is complete (a copy that strips trailing empty fields)")
    if len(last) == CRITEO_HEX_DIGITS:
        return None
    name = f"C{count - first_sparse}"
    what = "is empty (the line ends in a tab)" if not last else \
        f"{last[:20].decode('utf-8', 'backslashreplace')!r} has {len(last)} characters, not 8"
    return (f"the file ends inside this line, without a newline, and its last field {name} {what}: "
            f"a partial download? Fetch the file again, or add the final newline if it is complete")


ENGINES = ("numba", "numpy")


def _check_max_hex_digits(max_hex_digits) -> None:
    if not (isinstance(max_hex_digits, (int, np.integer)) and 1 <= max_hex_digits <= 16):
        raise ConfigError(f"max_hex_digits={max_hex_digits!r}: use 1..16 (8 for Criteo's 32-bit "
                          f"hashes, 16 for 64-bit values)")


def parse_lines(buf: np.ndarray, *, has_label: bool = True, key_scheme: KeyScheme = KeyScheme(),
                min_fields: int | None = None, engine: str = "numba", max_hex_digits: int = 16):
    """Parse a block of whole lines.

    buf: (nbytes,) uint8 holding complete lines, each ending in ``\\n`` except possibly the last.
    engine: "numba" (compiled single pass, ``tsv_kernel``) or "numpy" (the vectorized reference);
    both give the same rows and the same bad-line mask. max_hex_digits: a longer categorical makes
    its line bad (1..16).
    Returns ``(dense (N, 13) float32, ids (N, 26) int64, labels (N,) float32,
    line_starts (N,) int64, bad (N,) bool)`` over all N lines; the contents of bad lines' rows are
    unspecified.
    """
    max_fields = 1 + NUM_DENSE + NUM_SPARSE if has_label else NUM_DENSE + NUM_SPARSE
    min_fields = max_fields - 3 if min_fields is None else min_fields
    _check_max_hex_digits(max_hex_digits)
    if engine == "numba":
        from .tsv_kernel import scan_lines

        labels, dense_raw, dense_present, hex_vals, hex_present, line_starts, bad = scan_lines(
            buf, has_label, min_fields, max_fields, max_hex_digits)
        if not has_label:
            labels[:] = np.nan
        return (dense_log(dense_raw, dense_present), key_scheme.keys(hex_vals, hex_present),
                labels, line_starts, bad)
    if engine != "numpy":
        raise ConfigError(f"engine={engine!r}: use one of {ENGINES}")
    n_bytes = buf.size
    newlines = np.flatnonzero(buf == 10)
    if n_bytes and (newlines.size == 0 or newlines[-1] != n_bytes - 1):
        newlines = np.append(newlines, n_bytes)  # last line without a final newline
    line_ends = newlines.astype(np.int64)
    line_starts = np.concatenate([[0], line_ends[:-1] + 1]).astype(np.int64)[:line_ends.size]
    n = line_ends.size
    nonempty = line_ends > line_starts
    cr = np.zeros(n, bool)
    cr[nonempty] = buf[line_ends[nonempty] - 1] == 13
    line_ends = line_ends - cr  # "\r\n" endings

    tabs = np.flatnonzero(buf == 9)
    if tabs.size == n * (max_fields - 1) and n and \
            (np.searchsorted(tabs, line_starts) == np.arange(0, tabs.size, max_fields - 1)).all():
        # the common case, every line complete: the tab table is a plain reshape
        grid = tabs.reshape(n, max_fields - 1)
        starts = np.concatenate([line_starts[:, None], grid + 1], axis=1)
        ends = np.concatenate([grid, line_ends[:, None]], axis=1)
        bad = np.zeros(n, bool)
    else:
        tab_line = np.searchsorted(line_ends, tabs)
        counts = np.bincount(tab_line, minlength=n)
        n_fields = counts + 1
        bad = (n_fields < min_fields) | (n_fields > max_fields)
        rank = np.arange(tabs.size) - (np.cumsum(counts) - counts)[tab_line]
        starts = np.repeat(line_ends[:, None], max_fields, axis=1)
        ends = starts.copy()
        starts[:, 0] = line_starts
        keep = rank < max_fields - 1
        starts[tab_line[keep], rank[keep] + 1] = tabs[keep] + 1
        keep = rank < max_fields
        ends[tab_line[keep], rank[keep]] = tabs[keep]

    first_dense = 1 if has_label else 0
    first_sparse = first_dense + NUM_DENSE
    if has_label:
        label_vals, label_present, label_bad = _parse_ints(buf, starts[:, :1], ends[:, :1])
        label = label_vals[:, 0]
        bad |= label_bad[:, 0] | ~label_present[:, 0] | (label < 0) | (label > 1) | \
            (ends[:, 0] - starts[:, 0] != 1)  # exactly "0" or "1": not "-0", "01", "+1"
        labels = label_vals[:, 0].astype(np.float32)
    else:
        labels = np.full(n, np.nan, np.float32)
    dense_raw, dense_present, dense_bad = _parse_ints(
        buf, starts[:, first_dense:first_sparse], ends[:, first_dense:first_sparse])
    hex_vals, hex_present, hex_bad = _parse_hex(buf, starts[:, first_sparse:],
                                                ends[:, first_sparse:], max_hex_digits)
    bad |= dense_bad.any(1) | hex_bad.any(1)
    dense = dense_log(dense_raw, dense_present)
    ids = key_scheme.keys(hex_vals, hex_present)
    return dense, ids, labels, line_starts, bad


class CriteoTSVReader:
    """Streams a raw Criteo TSV file as ``Chunk`` objects of up to one block of lines each.

    path: the file; has_label: False for Kaggle test.txt (39 fields, labels come back NaN);
    key_scheme: see ``schema.KeyScheme``; on_bad_line: "error" raises ``InputError`` naming the file
    and 1-based line number, "skip" drops the line and counts it in ``self.skipped``;
    min_fields: fewest fields accepted (default: 3 fewer than a full line);
    engine: "numba" (compiled, default) or "numpy" (vectorized reference), see ``parse_lines``;
    start, end: byte range; the reader yields the lines whose first byte lies in [start, end), so
    consecutive ranges cover a file exactly once; max_hex_digits: longest categorical accepted
    (1..16, default 16; ``default_max_hex_digits`` gives the training paths' stricter choice).
    A final line without a newline is checked for a cut (module docstring, "Truncated files").
    Empty lines and a leading byte order mark are skipped; a file that reads as unlabelled is
    refused line by line; a compressed file is refused here (module docstring).

    After iteration, ``rows`` is the number of rows yielded and ``skipped`` the bad lines dropped.
    """

    def __init__(self, path, *, has_label: bool = True, key_scheme: KeyScheme = KeyScheme(),
                 on_bad_line: str = "error", min_fields: int | None = None,
                 block_bytes: int = 1 << 20, start: int = 0, end: int | None = None,
                 engine: str = "numba", max_hex_digits: int = 16):
        if on_bad_line not in ("error", "skip"):
            raise ConfigError(f"on_bad_line={on_bad_line!r}: use 'error' or 'skip'")
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: use one of {ENGINES}")
        self.engine = engine
        _check_max_hex_digits(max_hex_digits)
        self.max_hex_digits = int(max_hex_digits)
        if block_bytes < 1:
            raise ConfigError(f"block_bytes={block_bytes}: use a positive size such as 4 << 20")
        self.path = os.fspath(path)
        self.has_label = has_label
        self.key_scheme = key_scheme
        self.on_bad_line = on_bad_line
        self.min_fields = min_fields
        self.block_bytes = int(block_bytes)
        self.start = int(start)
        self.end = end
        self.skipped = 0
        self.rows = 0
        self._unlabelled_head = False  # set per iteration: _head_is_unlabelled
        refuse_compressed(self.path)

    def _line_number(self, offset: int) -> int:
        """1-based number of the line starting at byte ``offset`` (counts newlines before it)."""
        count = 0
        with open(self.path, "rb") as f:
            remaining = offset
            while remaining > 0:
                block = f.read(min(remaining, 16 << 20))
                if not block:
                    break
                count += block.count(b"\n")
                remaining -= len(block)
        return count + 1

    def _field_range(self) -> tuple[int, int]:
        max_fields = 1 + NUM_DENSE + NUM_SPARSE if self.has_label else NUM_DENSE + NUM_SPARSE
        return (max_fields - 3 if self.min_fields is None else self.min_fields), max_fields

    def _fail(self, offset: int, line: bytes, final: bool = False) -> None:
        min_fields, max_fields = self._field_range()
        reason = _explain_cut(line, min_fields, max_fields) if final else None
        if reason is None:
            reason = _explain(line, self.has_label, min_fields, max_fields, self.max_hex_digits,
                              self._unlabelled_head)
        elif self.has_label and _reads_unlabelled(line, max_fields, self.max_hex_digits):
            reason += UNLABELLED_HINT
        shown = line[:120].decode("utf-8", "backslashreplace")
        raise InputError(f"{self.path}:{self._line_number(offset)}: bad Criteo line ({reason}): "
                         f"{shown!r}; fix the file or pass on_bad_line='skip' (--on-bad-line "
                         "skip) to skip and count such lines")

    def _parse(self, data: bytes, file_offset: int, stop: int | None, final: bool = False):
        """Rows of the whole lines in ``data``; final: ``data`` is the file's last line, which
        has no newline (checked for a cut). Empty lines are skipped, not bad lines."""
        buf = np.frombuffer(data, dtype=np.uint8)
        min_fields, max_fields = self._field_range()
        if self._unlabelled_head:  # test.txt read as labelled: no line may pass as stripped
            min_fields = max_fields
        dense, ids, labels, starts, bad = parse_lines(
            buf, has_label=self.has_label, key_scheme=self.key_scheme, min_fields=min_fields,
            engine=self.engine, max_hex_digits=self.max_hex_digits)
        blank = _blank_lines(buf, starts)
        if final and bad.size == 1 and not blank[0] and \
                _explain_cut(data, *self._field_range()) is not None:
            bad[0] = True
        keep = ~blank
        if stop is not None:
            keep &= starts + file_offset < stop
        if not keep.all():
            dense, ids, labels, starts, bad = (a[keep] for a in (dense, ids, labels, starts, bad))
        if bad.any():
            first = int(np.argmax(bad))
            if self.on_bad_line == "error":
                begin = int(starts[first])
                finish = data.find(b"\n", begin)
                self._fail(file_offset + begin, data[begin:finish if finish >= 0 else len(data)],
                           final=final)
            self.skipped += int(bad.sum())
            good = ~bad
            dense, ids, labels, starts = dense[good], ids[good], labels[good], starts[good]
        self.rows += labels.size
        return Chunk(dense, ids, labels, starts + file_offset)

    def __iter__(self) -> Iterator[Chunk]:
        self.skipped = 0
        self.rows = 0
        stop = self.end
        self._unlabelled_head = self.has_label and \
            _head_is_unlabelled(self.path, self._field_range()[1])
        with open(self.path, "rb") as f:
            pos = self.start
            if pos == 0 and f.read(len(BOM)) == BOM:
                # a byte order mark is no part of line 1, which this range owns (its first
                # byte is the file's): it starts after the mark, where its position points
                pos = len(BOM)
                if stop is not None and 0 < stop <= pos:
                    stop = pos + 1
            elif pos > 0:
                f.seek(pos - 1)
                if f.read(1) != b"\n":
                    while True:  # the line under way belongs to the previous range
                        rest = f.readline(MAX_LINE_BYTES)
                        pos += len(rest)
                        if not rest or rest.endswith(b"\n"):
                            break
            f.seek(pos)
            carry = b""
            carry_offset = pos
            while stop is None or carry_offset < stop:
                block = f.read(self.block_bytes)
                data = carry + block
                if not block:
                    if data:  # the last line, without a final newline: a cut download?
                        chunk = self._parse(data, carry_offset, stop, final=True)
                        if len(chunk):
                            yield chunk
                    return
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    if len(data) > MAX_LINE_BYTES:
                        carry_offset = self._overlong_line(f, data, carry_offset)
                        carry = b""
                        continue
                    carry = data
                    continue
                chunk = self._parse(data[:cut], carry_offset, stop)
                carry, carry_offset = data[cut:], carry_offset + cut
                if len(chunk):
                    yield chunk

    def _overlong_line(self, f, data: bytes, offset: int) -> int:
        """A newline-free run longer than MAX_LINE_BYTES: raise, or skip to the next newline."""
        if self.on_bad_line == "error":
            raise InputError(f"{self.path}:{self._line_number(offset)}: a line longer than "
                             f"{MAX_LINE_BYTES} bytes without a newline (binary data?): "
                             f"{data[:60]!r}; fix the file or pass on_bad_line='skip' "
                             "(--on-bad-line skip)")
        self.skipped += 1
        offset += len(data)
        while True:
            rest = f.readline(MAX_LINE_BYTES)
            offset += len(rest)
            if not rest or rest.endswith(b"\n"):
                f.seek(offset)
                return offset


def read_criteo_tsv(path, **options) -> Batch:
    """Read a whole (small) TSV file into one ``Batch``; options as for ``CriteoTSVReader``.

    Returns Batch(dense (N, 13) float32, ids (N, 26) int64, labels (N,) float32).
    """
    chunks = list(CriteoTSVReader(path, **options))
    if not chunks:
        return Batch(np.zeros((0, NUM_DENSE), np.float32), np.zeros((0, NUM_SPARSE), np.int64),
                     np.zeros(0, np.float32))
    return Batch(np.concatenate([c.dense for c in chunks]), np.concatenate([c.ids for c in chunks]),
                 np.concatenate([c.labels for c in chunks]))


FILE_SHIFT = 44  # positions = file index << 44 | byte offset: files up to 16 TiB stay distinct


class TSVSource:
    """TSV files as a loader source: units are byte ranges, read by ``CriteoTSVReader``.

    paths: file(s); unit_bytes: target size of one unit; reader options (has_label, key_scheme,
    on_bad_line, ...) pass through, except that ``max_hex_digits`` defaults to
    ``default_max_hex_digits(key_scheme)`` (16 under the default key scheme: a wider categorical
    is a bad line). Chunk positions are ``file_index << 44 | line byte offset``.

    ``skipped_by_unit`` maps each unit read to the end to its bad lines skipped, and ``skipped``
    sums it: a unit read again (next epoch) replaces its count, so each bad line counts once.
    The mapping is replaced, never changed in place, so a reference to it is a snapshot.
    """

    def __init__(self, paths, *, unit_bytes: int = 256 << 20, **reader_options):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ConfigError("no TSV files given: pass a path or a non-empty list of paths")
        for p in self.paths:
            if not os.path.isfile(p):
                raise InputError(f"{p}: no such TSV file")
            refuse_compressed(p)
        if unit_bytes < 1:
            raise ConfigError(f"unit_bytes={unit_bytes}: use a positive size such as 256 << 20")
        self.unit_bytes = int(unit_bytes)
        reader_options.setdefault(
            "max_hex_digits", default_max_hex_digits(reader_options.get("key_scheme", KeyScheme())))
        CriteoTSVReader(self.paths[0], **reader_options)  # validates the options once, up front
        self.reader_options = reader_options
        self.skipped_by_unit: dict[tuple, int] = {}

    @property
    def skipped(self) -> int:
        """Bad lines skipped in the units read to the end so far, each line counted once."""
        return sum(self.skipped_by_unit.values())

    def units(self, min_units: int = 1) -> list[tuple[int, int, int]]:
        """(file index, start byte, end byte) ranges covering every file; at least ``min_units``
        ranges per file when the file is that large, so every rank gets work."""
        out = []
        for f, path in enumerate(self.paths):
            size = os.path.getsize(path)
            if size == 0:
                continue
            parts = max(-(-size // self.unit_bytes), min(min_units, size))
            bounds = [size * i // parts for i in range(parts + 1)]
            out += [(f, bounds[i], bounds[i + 1]) for i in range(parts)]
        return out

    def read_unit(self, unit) -> Iterator[Chunk]:
        f, start, end = unit
        reader = CriteoTSVReader(self.paths[f], start=start, end=end, **self.reader_options)
        for chunk in reader:
            chunk.positions = chunk.positions | np.int64(f << FILE_SHIFT)
            yield chunk
        # only a unit read to the end is counted: a partial count would depend on where a
        # consumer stopped; copy-on-write keeps earlier references valid snapshots
        self.skipped_by_unit = {**self.skipped_by_unit, tuple(unit): reader.skipped}
