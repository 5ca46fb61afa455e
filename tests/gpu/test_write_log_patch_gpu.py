"""The write log's device patch (``write_log.patch_rows_on_device``) on a GPU: the hash-index
path (``hashindex_insert_positions`` and the finds that copy the put's lines, real blocks racing
for buckets) against the sort path it replaced (CuPy's argsort and searchsorted) and a host
reference, bit for bit, at the size of a DLRM step (393 k rows of a 1.7 M-capacity lookup, puts
of the same shape) and at small sizes with fixed-capacity puts, erases and placeholder rows.
Runs on the CPU dry run too (numpy and the emulator), at the small sizes only."""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding import write_log
from one_embedding.backend import cupy_available
from one_embedding.step import OwnerRows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))


def _case(rng, capacity, live, line_size, puts):
    """Rows of a fixed-capacity lookup (``live`` real keys, placeholders of key 0 after) and
    ``puts`` fixed-capacity puts, each holding half of the rows' keys among others, the last an
    erase. Host arrays: (keys, lines, found, live), [(keys, lines or None, count)]."""
    real = rng.choice(np.arange(1, 8 * capacity, dtype=np.uint64), size=live, replace=False)
    keys = np.zeros(capacity, np.uint64)
    keys[:live] = real
    lines = rng.standard_normal((capacity, line_size)).astype(np.float32)
    found = rng.random(capacity) < 0.5
    newer = []
    for j in range(puts):
        count = live - j
        theirs = rng.choice(real, size=count // 2, replace=False)
        others = rng.choice(np.arange(8 * capacity, 16 * capacity, dtype=np.uint64),
                            size=count - theirs.size, replace=False)
        put = np.zeros(capacity, np.uint64)
        put[:count] = rng.permutation(np.concatenate([theirs, others]))
        put[count] = real[0]                                  # a real key past the count
        put_lines = None if j == puts - 1 else \
            rng.standard_normal((capacity, line_size)).astype(np.float32)
        newer.append((put, put_lines, np.array([count], np.int64)))
    return (keys, lines, found, np.array([live], np.int64)), newer


def _reference(rows, newer):
    keys, lines, found, live = (a.copy() for a in rows)
    position = {int(k): i for i, k in enumerate(keys[:live[0]])}
    for put, put_lines, count in newer:
        hit = np.zeros(keys.shape[0], bool)
        for p, k in enumerate(put[:count[0]]):
            i = position.get(int(k))
            if i is not None:
                hit[i] = True
                if put_lines is not None:
                    lines[i] = put_lines[p]
        found = found & ~hit if put_lines is None else found | hit
    return lines, found


def _on_device(cp, rows, newer, hashed, monkeypatch):
    from one_embedding.kernels import device_ops

    monkeypatch.setattr(write_log, "HASHED_PATCH", hashed)
    keys, lines, found, live = (cp.asarray(a) for a in rows)
    owner = OwnerRows(keys, cp.zeros(keys.shape[0], cp.int32), lines, found, 0, 0, live=live)
    device = [(cp.asarray(k), None if v is None else cp.asarray(v), cp.asarray(c))
              for k, v, c in newer]
    write_log.patch_rows_on_device(cp, owner, device, device_ops.cupy_launcher())
    return cp.asnumpy(owner.lines), cp.asnumpy(owner.found)


SIZES = [(64, 40, 12), (300, 257, 7)] + ([] if DRY else [(1_703_936, 393_199, 128)])


@pytest.mark.parametrize("capacity,live,line_size", SIZES)
def test_the_hashed_patch_equals_the_sort_path_and_the_reference(monkeypatch, capacity, live,
                                                                 line_size):
    import cupy as cp

    rng = np.random.default_rng(capacity)
    rows, newer = _case(rng, capacity, live, line_size, puts=3)
    want_lines, want_found = _reference(rows, newer)
    got = _on_device(cp, rows, newer, True, monkeypatch)
    before = _on_device(cp, rows, newer, False, monkeypatch)
    np.testing.assert_array_equal(got[0].view(np.int32), before[0].view(np.int32))
    np.testing.assert_array_equal(got[1], before[1])
    np.testing.assert_array_equal(got[0].view(np.int32), want_lines.view(np.int32))
    np.testing.assert_array_equal(got[1], want_found)
    # placeholder rows are neither read nor written
    np.testing.assert_array_equal(got[0][live:].view(np.int32), rows[1][live:].view(np.int32))
    np.testing.assert_array_equal(got[1][live:], rows[2][live:])
