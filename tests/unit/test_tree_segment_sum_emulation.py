"""The segment sums' tree order (``parallel.unique.segment_sum``'s docstring): a segment of at
most 32 rows in row order from +0, a longer one in chunks of 32 whose partials sum by the same
rule, recursively.

Checked against a pure-Python reference of that definition (float32 numpy operations only, no
float64 anywhere): the CPU kernel (numba), the device kernels on the host emulator
(``embedding_segment_sum`` + ``embedding_tree_counts`` / ``embedding_tree_level``), the fused
update (``optim_summed_<rule>`` reading the long keys' totals) and fixed-capacity batches with
placeholders past the live count. Segments of 1, 31, 32, 33, 1024, 1025 and 40000 rows,
interleaved, with -0.0, infinities and float32 subnormals (the emulator, as the CPU, keeps
subnormals; the GPU twins in tests/gpu avoid them). The emulator tests also run under its
stress seeds (tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import device_ops, device_unique, fused_update
from one_embedding.optim import SGD, Adam
from one_embedding.parallel.unique import SUM_CHUNK, segment_sum, unique_ids

pytestmark = pytest.mark.stress_seeds

LENGTHS = (1, 31, 32, 33, 1024, 1025, 40000)


def _tree_reference(rows: np.ndarray) -> np.ndarray:
    """rows: (L, E) float32 in row order -> (E,) float32, the definition read literally, in
    float32 operations only."""
    def in_order(items):
        acc = np.zeros(rows.shape[1], np.float32)          # +0
        for item in items:
            acc = acc + item                                # float32 + float32 -> float32
        return acc

    def tree(items):
        if len(items) <= SUM_CHUNK:
            return in_order(items)
        return tree([in_order(items[i:i + SUM_CHUNK]) for i in range(0, len(items), SUM_CHUNK)])

    assert rows.dtype == np.float32
    return tree(list(rows))


def _batch(seed: int, dim: int, lengths=LENGTHS, dtype=np.float32):
    """(values (n, dim), inverse (n,) int64, S): segment s has lengths[s] rows, the segments'
    rows interleaved at random; a wide dynamic range (every change of order shows in the bits),
    -0.0 rows, an infinity, subnormals, and segment 3 (33 rows) all -0.0."""
    rng = np.random.default_rng(seed)
    inverse = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    rng.shuffle(inverse)
    n = inverse.size
    values = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-6, 7, (n, dim))).astype(dtype)
    values[rng.integers(0, n, 50)] = -0.0
    tiny = np.float32(1e-40) if dtype == np.float32 else 1e-310      # subnormal
    values[rng.integers(0, n, 200), 0] = tiny * rng.integers(-3, 4, 200)
    values[rng.integers(0, n, 3), 1 % dim] = np.inf
    values[inverse == 3] = -0.0
    return values, inverse, len(lengths)


def _same_bits(got, want):
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_tree_levels_follow_the_longest_possible_segment():
    assert [device_unique.tree_levels(n) for n in (0, 1, 32, 33, 1024, 1025, 32768, 32769)] == \
        [0, 0, 0, 2, 2, 3, 3, 4]
    assert device_unique.tree_levels(100_000) == 4           # 3125 -> 98 -> 4 -> 1
    assert device_unique.tree_levels(1_700_000) == 5


def test_cpu_segment_sum_is_the_tree_order_not_the_row_order():
    values, inverse, n_segments = _batch(1, 3)
    got = segment_sum(values, inverse, n_segments)
    for s, length in enumerate(LENGTHS):
        rows = values[inverse == s]
        assert rows.shape[0] == length
        _same_bits(got[s], _tree_reference(rows))
    # a segment of at most 32 rows keeps the row order's bits; the long ones (here) do not
    row_order = np.zeros((n_segments, 3), np.float32)
    for i in range(inverse.size):
        row_order[inverse[i]] = row_order[inverse[i]] + values[i]
    _same_bits(got[:3], row_order[:3])
    assert (got[4:].view(np.int32) != row_order[4:].view(np.int32)).any()
    assert np.signbit(got[3]).sum() == 0 and (got[3] == 0).all()   # 33 rows of -0.0: +0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_segment_sum_is_the_cpu_tree_bit_for_bit(launch, dtype):
    values, inverse, n_segments = _batch(2, 4, dtype=dtype)
    want = segment_sum(values, inverse, n_segments)
    got = device_unique.segment_sum(values, inverse, n_segments, launch=launch)
    _same_bits(got, want)
    assert {"embedding_segment_sum", "embedding_tree_counts", "embedding_tree_level"} \
        <= launch.launched
    # a Zipf batch: many keys, a few long, each level's bounds met by real counts
    rng = np.random.default_rng(3)
    ids = rng.zipf(1.1, 6000).astype(np.uint64) % np.uint64(700)
    uniq, inverse = unique_ids(ids)
    values = rng.standard_normal((ids.size, 5)).astype(dtype)
    _same_bits(device_unique.segment_sum(values, inverse, uniq.size, launch=launch),
               segment_sum(values, inverse, uniq.size))


def test_long_segment_totals_write_only_the_live_long_segments(launch):
    """long_segment_totals leaves every row but the long segments' below ``live`` as it was."""
    values, inverse, n_segments = _batch(4, 2)
    rows_by_segment, offsets = device_unique.segment_order(np, inverse, n_segments)
    want = segment_sum(values, inverse, n_segments)
    sentinel = np.float32(-7.25)
    for live in (n_segments, 5):                   # 5: segments 5 (1025 rows) and 6 past it
        out = np.full((n_segments, 2), sentinel, np.float32)
        device_unique.long_segment_totals(launch, values, rows_by_segment, offsets, n_segments,
                                          out, np.array([live], np.int64))
        long = np.array([length > SUM_CHUNK for length in LENGTHS]) & (np.arange(n_segments) < live)
        _same_bits(out[long], want[long])
        assert (out[~long] == sentinel).all()


def _fixed_batch(seed: int, dim: int):
    """A fixed-capacity batch (unique_ids_fixed): ids whose keys have LENGTHS rows, so capacity
    n = sum(LENGTHS) and the keys from count = 7 on are placeholders."""
    values, inverse, _ = _batch(seed, dim)
    keys = np.array([11, 5, 900, 3, 77, 2**63, 40], np.uint64)[inverse]
    return values, keys


@pytest.mark.parametrize("optimizer", [SGD, Adam])
def test_fused_update_with_long_keys_and_placeholders(launch, optimizer):
    """The fused update of a fixed-capacity batch equals the CPU sums (numba) then update_lines
    on the live lines, bit for bit, and leaves the placeholder lines as they were."""
    dim = 3
    values, keys = _fixed_batch(5, dim)
    fixed = device_unique.unique_ids_fixed(keys, launch=launch)
    n = keys.size
    u = int(fixed.count[0])
    assert u == len(LENGTHS)
    fused_opt, two_opt = optimizer(lr=0.01), optimizer(lr=0.01)
    width = fused_opt.required_storage_dim(dim)
    rng = np.random.default_rng(6)
    lines = rng.uniform(-1, 1, (n, width)).astype(np.float32)
    lines[:, dim:] = np.abs(lines[:, dim:])
    want = lines[:u].copy()
    placeholders = lines[u:].copy()
    summed = fused_update.SummedGradients(values, fixed.inverse, n, launch, live=fixed.count)
    fused_update.update_lines_summed(fused_opt, lines, summed, 1)
    cpu_sums = segment_sum(values, fixed.inverse, u)
    device_ops.update_lines(two_opt, want, cpu_sums, 1, launch=launch)
    _same_bits(lines[:u], want)
    _same_bits(lines[u:], placeholders)
    assert f"optim_summed_{device_ops.optimizer_kernel(fused_opt, 0.1, 1)[0]}" in launch.launched
    assert "embedding_segment_sum" not in launch.launched and "embedding_tree_level" in launch.launched
    for at in range(u):                            # what a failed check reports about a key
        _same_bits(summed.row(np.int64(at)), cpu_sums[at])
    _same_bits(summed.materialize()[:u], cpu_sums)


def test_fused_update_is_the_two_kernel_update_with_long_keys(launch):
    """Without a live count: fused == device segment_sum then update_lines, bit for bit."""
    dim = 4
    values, inverse, u = _batch(7, dim)
    fused_opt, two_opt = Adam(lr=0.01), Adam(lr=0.01)
    rng = np.random.default_rng(8)
    lines = rng.uniform(-1, 1, (u, fused_opt.required_storage_dim(dim))).astype(np.float32)
    lines[:, dim:] = np.abs(lines[:, dim:])
    two = lines.copy()
    fused_update.update_lines_summed(fused_opt, lines,
                                     fused_update.SummedGradients(values, inverse, u, launch), 1)
    device_ops.update_lines(two_opt, two, device_unique.segment_sum(values, inverse, u,
                                                                    launch=launch), 1,
                            launch=launch)
    _same_bits(lines, two)


@pytest.mark.parametrize("lengths", [(33,) * 40, (1025,) * 4 + (33,) * 9, (33,) * 3 + (32,) * 5],
                         ids=["all-33", "1025-and-33", "33-and-32"])
def test_scratch_bounds_hold_at_their_worst_case(launch, lengths):
    """Every segment of 33 rows: level 1 holds exactly 2n / 33 partials, the scratch array's
    bound (a smaller one would leave partials unsummed); segments of 1025 rows put 33 partials
    each through a second chunked level."""
    values, inverse, n_segments = _batch(9, 2, lengths)
    values[~np.isfinite(values)] = 1.0
    n = inverse.size
    if lengths[0] == 33 and len(set(lengths)) == 1:
        assert 2 * n // 33 == 2 * len(lengths)              # the bound, met exactly
    want = np.stack([_tree_reference(values[inverse == s].astype(np.float32))
                     for s in range(n_segments)])
    _same_bits(segment_sum(values, inverse, n_segments), want)
    _same_bits(device_unique.segment_sum(values, inverse, n_segments, launch=launch), want)


def test_segment_order_groups_each_segments_rows_in_ascending_order():
    """The grouping the sums read: rows by (segment, row), each segment's rows ascending (its
    tree order depends on it), offsets where each segment starts; from the sort of the segment
    ids as int32 keys."""
    rng = np.random.default_rng(8)
    ids = rng.zipf(1.1, 5000).astype(np.uint64) % np.uint64(900)
    uniq, inverse = unique_ids(ids)
    rows_by_segment, offsets = device_unique.segment_order(np, inverse, uniq.size)
    want = np.lexsort((np.arange(ids.size), inverse))
    np.testing.assert_array_equal(rows_by_segment, want)
    assert rows_by_segment.dtype == np.int64
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(np.bincount(
        inverse, minlength=uniq.size))]))
    with pytest.raises(InputError, match="2147483648 segments in one batch"):
        device_unique.segment_order(np, inverse, 2**31)
