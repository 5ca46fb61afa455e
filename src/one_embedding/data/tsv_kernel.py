"""The compiled TSV block parser: one pass over the bytes, same results as ``tsv.parse_lines``.

The numpy parser in ``tsv.py`` is the specification; this numba kernel walks each line once
(``njit(cache=True, nogil=True)``, so the loader's read-ahead thread parses while the caller trains)
and is tested for identical output on every quirk and bad line. Imported lazily: ``import
one_embedding`` does not import numba.
"""

from __future__ import annotations

import numba
import numpy as np

from .schema import NUM_DENSE, NUM_SPARSE

_HEX = np.full(256, -1, dtype=np.int64)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)

MISSING, OK, BAD = 0, 1, 2


@numba.njit(cache=True, nogil=True, inline="always")
def _int_field(buf, a, b):
    """Signed decimal of at most 18 digits in buf[a:b] -> (value, MISSING | OK | BAD)."""
    if a == b:
        return 0, MISSING
    neg = buf[a] == 45
    i = a + 1 if neg else a
    if b - i < 1 or b - i > 18:
        return 0, BAD
    value = 0
    for j in range(i, b):
        d = np.int64(buf[j]) - 48
        if d < 0 or d > 9:
            return 0, BAD
        value = value * 10 + d
    return (-value if neg else value), OK


@numba.njit(cache=True, nogil=True, inline="always")
def _hex_field(buf, a, b, table, max_digits):
    """Hex of at most ``max_digits`` (<= 16) digits in buf[a:b] -> (value as uint64,
    MISSING | OK | BAD)."""
    if a == b:
        return np.uint64(0), MISSING
    if b - a > max_digits:
        return np.uint64(0), BAD
    value = np.uint64(0)
    for j in range(a, b):
        d = table[buf[j]]
        if d < 0:
            return np.uint64(0), BAD
        value = (value << np.uint64(4)) | np.uint64(d)
    return value, OK


@numba.njit(cache=True, nogil=True)
def _scan(buf, has_label, min_fields, max_fields, max_hex_digits, table, line_starts, bad, labels,
          dense_raw, dense_present, hex_values, hex_present):
    first_dense = 1 if has_label else 0
    first_sparse = first_dense + NUM_DENSE
    n = buf.size
    pos = 0
    line = 0
    while pos < n:
        start = pos
        end = start
        while end < n and buf[end] != 10:
            end += 1
        pos = end + 1
        if end > start and buf[end - 1] == 13:
            end -= 1
        line_starts[line] = start
        is_bad = False
        field = 0
        field_start = start
        i = start
        while True:
            if i == end or buf[i] == 9:
                if field < max_fields:
                    if has_label and field == 0:
                        value, status = _int_field(buf, field_start, i)
                        # exactly "0" or "1": "-0", "01" or "+1" are not labels
                        if status != OK or value < 0 or value > 1 or i - field_start != 1:
                            is_bad = True
                        labels[line] = value
                    elif field < first_sparse:
                        value, status = _int_field(buf, field_start, i)
                        is_bad |= status == BAD
                        dense_raw[line, field - first_dense] = value
                        dense_present[line, field - first_dense] = status != MISSING
                    else:
                        hvalue, status = _hex_field(buf, field_start, i, table, max_hex_digits)
                        is_bad |= status == BAD
                        hex_values[line, field - first_sparse] = hvalue
                        hex_present[line, field - first_sparse] = status != MISSING
                field += 1
                if i == end:
                    break
                field_start = i + 1
            i += 1
        if field < min_fields or field > max_fields:
            is_bad = True
        bad[line] = is_bad
        line += 1
    return line


def scan_lines(buf: np.ndarray, has_label: bool, min_fields: int, max_fields: int,
               max_hex_digits: int = 16):
    """Raw fields of every line in ``buf`` (complete lines, as for ``tsv.parse_lines``); a
    categorical longer than ``max_hex_digits`` (<= 16) makes its line bad.

    Returns labels (N,) float32, dense_raw (N, 13) int64, dense_present (N, 13) bool,
    hex_values (N, 26) uint64, hex_present (N, 26) bool, line_starts (N,) int64, bad (N,) bool.
    """
    n_bytes = buf.size
    n = int(np.count_nonzero(buf == 10))
    if n_bytes and buf[n_bytes - 1] != 10:
        n += 1
    labels = np.zeros(n, np.float32)
    dense_raw = np.zeros((n, NUM_DENSE), np.int64)
    dense_present = np.zeros((n, NUM_DENSE), np.bool_)
    hex_values = np.zeros((n, NUM_SPARSE), np.uint64)
    hex_present = np.zeros((n, NUM_SPARSE), np.bool_)
    line_starts = np.zeros(n, np.int64)
    bad = np.zeros(n, np.bool_)
    _scan(buf, has_label, min_fields, max_fields, max_hex_digits, _HEX, line_starts, bad, labels,
          dense_raw, dense_present, hex_values, hex_present)
    return labels, dense_raw, dense_present, hex_values, hex_present, line_starts, bad
