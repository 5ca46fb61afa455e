"""The write log's patch on the device path (``write_log.patch_rows_on_device``) on the host
emulator, default and stress modes: a prefetched lookup's rows take every line put since, oldest
put first, and lose the keys erased since, exactly as a plain reference says; the hash-index
path (``hashindex_insert_positions`` + the finds that copy the put's lines) and the sort path it
replaced give the same lines, flags and erased rows, bit for bit, with fixed-capacity puts
(placeholder keys past their count, a real key among them), fixed-capacity rows (never touched
past their count) and erases between puts."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from one_embedding import write_log
from one_embedding.errors import InputError
from one_embedding.step import OwnerRows

pytestmark = pytest.mark.stress_seeds

V = 45          # rows of the lookup (several warps per block, several grid-stride rounds)
LINE = 12       # 16-byte copies (3 vectors a line); LINE_ODD: one value per lane
LINE_ODD = 7


def _rows(rng, line_size, live=None):
    keys = rng.choice(np.arange(1, 400, dtype=np.uint64), size=V, replace=False)
    lines = rng.standard_normal((V, line_size)).astype(np.float32)
    lines[0, 0] = np.float32(-0.0)
    found = rng.random(V) < 0.5
    if live is not None:                      # placeholders of a fixed-capacity lookup
        keys[live:] = 0
        lines[live:] = np.nan
    count = None if live is None else np.array([live], np.int64)
    return OwnerRows(keys, np.zeros(V, np.int32), lines, found, 0, 0, live=count)


def _put(rng, rows, line_size, erase=False, live=None, size=30):
    """A put of ``size`` unique keys: some of the rows' real keys, key 0 (the key of the rows'
    placeholders, which must not take its line), others; with ``live``, keys past it are
    placeholders: key 0 and a real key of the rows (never a match)."""
    real = rows.keys[rows.keys != 0]
    theirs = rng.choice(real, size=min(size // 2, real.size), replace=False)
    others = rng.choice(np.arange(1000, 2000, dtype=np.uint64), size=size - theirs.size - 1,
                        replace=False)
    keys = rng.permutation(np.concatenate([theirs, others, np.zeros(1, np.uint64)]))
    count = None
    if live is not None:
        missing = np.setdiff1d(rows.keys[rows.keys != 0], keys[:live])
        keys[live:] = 0
        if missing.size and live < size - 1:
            keys[live + 1] = missing[0]        # a real key past the count: not put
        count = np.array([live], np.int64)
    lines = None if erase else rng.standard_normal((size, line_size)).astype(np.float32)
    if lines is not None:
        lines[1, -1] = np.nan
    return keys, lines, count


def _reference(rows, newer):
    """Row by row, put by put: (lines, found, erased or None)."""
    lines, found = rows.lines.copy(), rows.found.copy()
    live = V if rows.live is None else int(rows.live[0])
    erased = None
    for keys, put_lines, count in newer:
        n = keys.shape[0] if count is None else int(count[0])
        where = {int(k): i for i, k in enumerate(keys[:n])}
        hit = np.array([i < live and int(k) in where for i, k in enumerate(rows.keys)])
        if put_lines is None:
            erased = hit.copy() if erased is None else erased | hit
            found &= ~hit
            continue
        for i in np.flatnonzero(hit):
            lines[i] = put_lines[where[int(rows.keys[i])]]
        found |= hit
        if erased is not None:
            erased &= ~hit
    return lines, found, erased


def _patched(rows, newer, launch, hashed, monkeypatch):
    monkeypatch.setattr(write_log, "HASHED_PATCH", hashed)
    rows = OwnerRows(rows.keys.copy(), rows.table_ids, rows.lines.copy(), rows.found.copy(), 0,
                     0, live=rows.live)
    erased = write_log.patch_rows_on_device(np, rows, newer, launch)
    return rows.lines, rows.found, erased


def _same(got, want):
    lines, found, erased = got
    np.testing.assert_array_equal(lines.view(np.int32), want[0].view(np.int32))
    np.testing.assert_array_equal(found, want[1])
    if want[2] is None:
        assert erased is None
    else:
        np.testing.assert_array_equal(erased, want[2])


CASES = {
    "one put": [dict()],
    "puts and an erase between": [dict(), dict(erase=True), dict()],
    "an erase last": [dict(), dict(erase=True)],
    "fixed-capacity puts": [dict(live=17), dict(live=0), dict(live=30)],
    "fixed-capacity erase": [dict(live=11, erase=True), dict(live=5)],
}


@pytest.mark.parametrize("line_size", [LINE, LINE_ODD])
@pytest.mark.parametrize("rows_live", [None, 0, 29, V])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_hashed_patch_gives_the_reference_and_the_sort_paths_bits(launch, monkeypatch, case,
                                                                      rows_live, line_size):
    rng = np.random.default_rng(zlib.crc32(repr((case, rows_live, line_size)).encode()))
    rows = _rows(rng, line_size, rows_live)
    newer = [_put(rng, rows, line_size, **spec) for spec in CASES[case]]
    want = _reference(rows, newer)
    hashed = _patched(rows, newer, launch, True, monkeypatch)
    _same(hashed, want)
    _same(_patched(rows, newer, launch, False, monkeypatch), want)
    if rows_live is not None:                 # placeholder rows: neither read nor written
        np.testing.assert_array_equal(hashed[0][rows_live:].view(np.int32),
                                      rows.lines[rows_live:].view(np.int32))
        np.testing.assert_array_equal(hashed[1][rows_live:], rows.found[rows_live:])


def test_the_hashed_patch_runs_two_kernels_a_put(launch, monkeypatch):
    """A put costs the hashed path one insert and one find (lines copied inside the find)."""
    rng = np.random.default_rng(4)
    rows = _rows(rng, LINE, live=40)
    newer = [_put(rng, rows, LINE, live=20), _put(rng, rows, LINE, erase=True)]
    names = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda family, name, *a, **k: (names.append(name),
                                                                      run(family, name, *a, **k))[1])
    _patched(rows, newer, launch, True, monkeypatch)
    assert names == ["insert_positions", "find_live"] * 2


def test_a_put_whose_lines_do_not_fit_the_rows_is_refused(launch, monkeypatch):
    rng = np.random.default_rng(5)
    rows = _rows(rng, LINE)
    keys, lines, _ = _put(rng, rows, LINE + 1)
    with pytest.raises(InputError, match="lines of 13 values do not fit rows of 12"):
        _patched(rows, [(keys, lines, None)], launch, True, monkeypatch)
