"""The row kernels of a fixed-capacity batch (``kernels/live_rows.py``) on the host emulator,
default and stress modes: below the live count they do what the CuPy expressions they replace
do (``LineLayout.reset_states_where``, the write log's select),
bit for bit; from the count on they neither write nor report anything, whatever the rows hold
(placeholders are never initialised: NaN here)."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import live_rows

pytestmark = pytest.mark.stress_seeds

N, L = 37, 11
#: line sizes of the warp-per-row kernel (patch_rows): 11 values (a value per
#: lane), 40 (16 bytes per lane: device_ops.line_vector) and 260 (65 vectors: lanes that take a
#: second and a third)
LINE_SIZES = [11, 40, 260]


def _lines(rng, line_size=L):
    lines = rng.standard_normal((N, line_size)).astype(np.float32)
    lines[-5:] = np.nan                       # placeholder rows past the count below
    return lines


@pytest.mark.parametrize("count", [0, 1, 32, N])
def test_fill_missing_resets_the_new_rows_below_the_count(launch, count):
    rng = np.random.default_rng(count)
    lines = _lines(rng)
    found = rng.random(N) < 0.5
    blocks = [(3, 4, 0.1), (7, 2, 0.0), (9, 2, 0.3)]   # 0.1, 0.3: rounded to float32 once
    want = lines.copy()
    new = np.flatnonzero(~found[:count])
    for start, width, value in blocks:
        want[new, start:start + width] = np.float32(value)
    live_rows.fill_missing(lines, found, np.array([count], np.int64), blocks, launch)
    np.testing.assert_array_equal(lines.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("line_size", LINE_SIZES)
@pytest.mark.parametrize("count", [0, 1, 32, N])
def test_patch_rows_copies_the_sources_below_the_count(launch, count, line_size):
    rng = np.random.default_rng(count + 20)
    lines = _lines(rng, line_size)
    put = rng.standard_normal((9, line_size)).astype(np.float32)
    source = rng.integers(-1, 9, N).astype(np.int64)
    want = lines.copy()
    for i in range(count):
        if source[i] >= 0:
            want[i] = put[source[i]]
    live_rows.patch_rows(lines, source, put, np.array([count], np.int64), launch)
    np.testing.assert_array_equal(lines.view(np.int32), want.view(np.int32))


def test_live_rows_refuse_bad_arguments(launch):
    lines = np.zeros((4, 3), np.float32)
    with pytest.raises(InputError, match="count"):
        live_rows.patch_rows(lines, np.zeros(4, np.int64), lines, np.array([1, 2], np.int64),
                             launch)
    with pytest.raises(InputError, match="outside"):
        live_rows.fill_missing(lines, np.zeros(4, bool), np.array([4], np.int64), [(2, 2, 0.0)],
                               launch)
    with pytest.raises(InputError, match="rows"):
        live_rows.fill_missing(lines, np.zeros(3, bool), np.array([4], np.int64), [], launch)
    with pytest.raises(InputError, match="do not fit"):
        live_rows.patch_rows(lines, np.zeros(4, np.int64), np.zeros((2, 2), np.float32),
                             np.array([4], np.int64), launch)
