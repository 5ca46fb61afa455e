"""The embedding side on a GPU: every CuPy op of kernels.device_ops and the device tiers of
cache.device against their CPU twins.

Every test needs CuPy and a CUDA device and is skipped cleanly without them. Checks:
- bit for bit: unique + inverse, segment sums, gathers, the fused optimizer updates, the int8
  and fp16 codecs, every hash-index slot and find, every cache hit, victim and evicted line.
  CuPy compiles with -ftz=true, so inputs here avoid float32 subnormals (below 1.18e-38): a
  subnormal input or result of a float32 operation (a segment sum, int8 scaling, the final
  rounding of an update) would read as 0 on the GPU and differ from numpy there, and nowhere else;
- within 1 float32 ulp, rarely off by one: initial values (CUDA's float64 log1p / cos may differ
  from the host libm in the last ulp) and Ftrl with lr_power other than +-0.5 (pow).
Sizes range from empty batches to a million keys, so the grid-stride loops run many rounds and
real blocks race (the emulation tests, tests/test_device_cache_emulation.py, run one block at a
time).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding import options as opt_mod
from one_embedding.backend import cupy_available
from one_embedding.errors import InputError

import helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]


def _cp():
    import cupy

    return cupy


def _get(a):
    return _cp().asnumpy(a)


def _exact(got, want):
    got = _get(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8))


def _ulps(a, b):
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def _keys(rng, n, universe=None):
    if universe is None:
        keys = np.unique(rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False))
    else:
        keys = np.unique(universe[rng.integers(0, universe.size, size=n)])
    rng.shuffle(keys)
    return keys


def _normal_floats(rng, shape, dtype=np.float32, spread=6):
    """Random values over many magnitudes, never float32-subnormal (see the module docstring)."""
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-spread, spread + 1, shape)
    x[np.abs(x) < 1e-30] = 1.0
    return x.astype(dtype)


# ---------------------------------------------------------------- unique + inverse


def _ids(kind, n, rng):
    if kind == "zipf":
        return rng.zipf(1.1, n).astype(np.uint64)
    if kind == "distinct":
        return rng.permutation(n).astype(np.uint64) * np.uint64(2**40 + 7)
    return np.full(n, 2**64 - 1, np.uint64)


@pytest.mark.parametrize("kind", ["zipf", "distinct", "all_same"])
@pytest.mark.parametrize("n", [0, 1, 33, 1000, 100_000, 1_000_000])
def test_unique_ids_equal_the_cpu_unique(n, kind):
    from one_embedding.kernels import device_unique
    from one_embedding.parallel.unique import unique_ids

    cp = _cp()
    keys = _ids(kind, n, np.random.default_rng(n))
    got_unique, got_inverse = device_unique.unique_ids(cp.asarray(keys))
    want_unique, want_inverse = unique_ids(keys)
    _exact(got_unique, want_unique)
    _exact(got_inverse, want_inverse)


def _dedup_case(kind: str, n: int, seed_offset: int):
    """(keys (n,) uint64 of ``kind`` drawn with seed n + ``seed_offset``, and the CPU's unique
    keys, inverse and first positions): n capped at 20,000 on the dry run (the emulator runs one
    thread at a time)."""
    from one_embedding.parallel.unique import first_occurrence, unique_ids

    if os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1":
        n = min(n, 20_000)
    rng = np.random.default_rng(n + seed_offset)
    if kind == "marker_and_zero":
        keys = rng.choice(np.array([0, 2**64 - 1, 1, 2**63], np.uint64), n)
    else:
        keys = _ids(kind, n, rng)
    want_unique, want_inverse = unique_ids(keys)
    return keys, want_unique, want_inverse, first_occurrence(want_inverse, want_unique.size)


@pytest.mark.parametrize("kind", ["zipf", "distinct", "all_same", "marker_and_zero"])
@pytest.mark.parametrize("n", [1, 2, 1000, 100_000, 1_700_000])
def test_hash_dedup_equals_the_sort_and_the_cpu(n, kind):
    """The hash-table dedup (unique_ids) against the sort-based one it replaced and the CPU's,
    with first positions, under real concurrency: blocks race for buckets and hot keys' atomics."""
    from one_embedding.kernels import device_unique

    cp = _cp()
    keys, want_unique, want_inverse, want_first = _dedup_case(kind, n, 1)
    device_keys = cp.asarray(keys)
    for _ in range(2):   # the buckets may differ between runs, the results may not
        got = device_unique.unique_ids(device_keys, return_first=True)
        for a, b in zip(got, (want_unique, want_inverse, want_first), strict=True):
            _exact(a, b)
    for a, b in zip(device_unique.unique_ids_by_sorting(device_keys, return_first=True),
                    (want_unique, want_inverse, want_first), strict=True):
        _exact(a, b)


@pytest.mark.parametrize("kind", ["zipf", "distinct", "all_same", "marker_and_zero"])
@pytest.mark.parametrize("n", [0, 1, 1000, 100_000, 1_700_000])
def test_fixed_capacity_dedup_keeps_its_count_on_the_device(n, kind):
    """``unique_ids_fixed`` under real concurrency: arrays of capacity n whose first ``count``
    entries are the CPU's unique keys and first positions (placeholders of key 0 and position 0
    behind them), the CPU's inverse, the count a (1,) int64 device array, and no counted read."""
    from one_embedding import host_sync
    from one_embedding.kernels import device_unique

    cp = _cp()
    keys, want_unique, want_inverse, want_first = _dedup_case(kind, n, 2)
    n = keys.size
    u = want_unique.size
    device_keys = cp.asarray(keys)
    with host_sync.counting() as reads:
        fixed = device_unique.unique_ids_fixed(device_keys)
    assert reads.total == 0, dict(reads.by_reason)
    _exact(fixed.count, np.array([u], np.int64))
    _exact(fixed.keys, np.concatenate([want_unique, np.zeros(n - u, np.uint64)]))
    _exact(fixed.first, np.concatenate([want_first, np.zeros(n - u, np.int64)]))
    _exact(fixed.inverse, want_inverse)


@pytest.mark.parametrize("kind", ["zipf", "distinct", "marker_and_zero"])
@pytest.mark.parametrize("n", [0, 33, 1000, 100_000, 1_000_000])
def test_dedup_output_fused_with_the_store_find(n, kind):
    """``hashindex_dedup_output_find`` under real concurrency: the fixed-capacity dedup's
    output pass probing a device store's index (half the batch's keys stored, among foreign
    ones) gives ``unique_ids_fixed`` then ``find_live``'s arrays, slots and lines bit for bit,
    and the CPU's unique keys; no counted read."""
    from one_embedding import host_sync
    from one_embedding.cache.device import DeviceFullStore
    from one_embedding.kernels import device_unique
    from one_embedding.parallel.unique import unique_ids

    cp = _cp()
    if os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1":
        n = min(n, 20_000)   # the emulator runs one thread at a time
    rng = np.random.default_rng(n + 3)
    if kind == "marker_and_zero":
        keys = rng.choice(np.array([0, 2**64 - 1, 1, 2**63], np.uint64), n)
    else:
        keys = _ids(kind, n, rng)
    line = 129
    distinct = np.unique(keys)
    held = np.concatenate([distinct[::2], rng.integers(0, 2**64, 1000, dtype=np.uint64,
                                                       endpoint=False)])
    held = np.unique(held)
    store = DeviceFullStore(line, capacity=held.size + 16)
    store.insert_or_assign(cp.asarray(held), cp.asarray(_normal_floats(rng, (held.size, line))))
    device_keys = cp.asarray(keys)
    want = device_unique.unique_ids_fixed(device_keys)
    want_out = cp.full((n, line), 7.0, dtype=cp.float32)
    want_slots = store._index.find_live(want.keys, want.count, store._rows, want_out)
    got_out = cp.full((n, line), 7.0, dtype=cp.float32)
    with host_sync.counting() as reads:
        got, got_slots = store._index.dedup_find_live(
            device_unique.dedup_passes_fixed(device_keys), store._rows, got_out)
    assert reads.total == 0, dict(reads.by_reason)
    for a, b in zip((*got, got_slots, got_out), (*want, want_slots, want_out), strict=True):
        _exact(a, _get(b))
    u = unique_ids(keys)[0].size
    _exact(got.keys[:u], unique_ids(keys)[0])


# ---------------------------------------------------------------- segment sums, gathers


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segment_sum_tree_order_of_long_segments_is_the_cpu_sum(dtype):
    """Segments of 1, 31, 32, 33, 1024, 1025, 40000 (and 10^5, a Zipf batch's hottest key) rows,
    interleaved: the level kernels of the tree order (embedding_tree_level) against the CPU's
    tree order (numba), bit for bit, with -0.0 rows, and no counted host read."""
    from one_embedding import host_sync
    from one_embedding.kernels import device_unique
    from one_embedding.parallel.unique import segment_sum

    cp = _cp()
    dry = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"
    rng = np.random.default_rng(41)
    lengths = [1, 31, 32, 33, 1024, 1025, 40_000] + ([] if dry else [100_000])
    inverse = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    rng.shuffle(inverse)
    dim = 8 if dry else 64
    values = _normal_floats(rng, (inverse.size, dim), dtype)
    values[rng.integers(0, inverse.size, 50)] = -0.0
    values[inverse == 3] = -0.0
    values_d, inverse_d = cp.asarray(values), cp.asarray(inverse)
    with host_sync.counting() as reads:
        got = device_unique.segment_sum(values_d, inverse_d, len(lengths), check_inverse=False)
    assert reads.total == 0, dict(reads.by_reason)
    _exact(got, segment_sum(values, inverse, len(lengths)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,dim,n_keys", [(1, 1, 1), (1000, 16, 30), (4097, 64, 4097), (200_000, 128, 5000)])
def test_segment_sum_is_the_cpu_sum_bit_for_bit(n, dim, n_keys, dtype):
    from one_embedding.kernels import device_unique
    from one_embedding.parallel.unique import segment_sum, unique_ids

    cp = _cp()
    rng = np.random.default_rng(n + dim)
    values = _normal_floats(rng, (n, dim), dtype)
    uniq, inverse = unique_ids(rng.zipf(1.2, n).astype(np.uint64) % np.uint64(n_keys))
    got = device_unique.segment_sum(cp.asarray(values), cp.asarray(inverse), uniq.size)
    _exact(got, segment_sum(values, inverse, uniq.size))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,dim,index_shape", [(1, 1, (1,)), (50, 37, (64, 26)), (10_000, 128, (4096, 26)),
                                                  (7, 3, (0,))])
def test_gather_rows_equal_the_reference(rows, dim, index_shape, dtype):
    from one_embedding.kernels import device_ops, reference

    cp = _cp()
    rng = np.random.default_rng(rows)
    src = _normal_floats(rng, (rows, dim), dtype)
    index = rng.integers(-1, rows, index_shape)
    _exact(device_ops.gather_rows(cp.asarray(src), cp.asarray(index)), reference.gather_rows(src, index))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [4, 8, 12, 128, 129])
def test_vector_gather_equals_the_scalar_gather(dim, dtype):
    """The gathers at 16 bytes per thread (embedding_gather_vector, embedding_gather_into_vector)
    against the scalar kernels (vector=False) and the references, bit for bit: rows of exactly
    dim and whole lines read in place (stride > dim), padding, an empty index, and rows 4 or 8
    bytes off the 16-byte boundary (an offset view: the scalar kernel must run, a vector read
    there would fault); vector_lanes on CuPy's device pointers says which kernel runs."""
    from one_embedding.kernels import device_ops, layout_ops, reference

    cp = _cp()
    dry = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"
    rng = np.random.default_rng(dim)
    n_rows, index_shape = (50, (6, 5)) if dry else (20_000, (4096, 26))
    lanes = 16 // np.dtype(dtype).itemsize
    launch = device_ops.cupy_launcher()
    for stride in (dim, dim + 4):
        src = _normal_floats(rng, (n_rows, stride), dtype)
        src[0, :2] = [np.nan, -0.0]
        columns = None if stride == dim else dim
        src_d = cp.asarray(src)
        # the aligned case is the vectorised one wherever the widths allow it
        out_d = cp.empty((1, dim), dtype)
        want_vector = dim % lanes == 0 and stride % lanes == 0
        assert bool(device_ops.vector_lanes(dtype, (dim, stride), (src_d, out_d))) == want_vector
        for index in [rng.integers(-1, n_rows, index_shape), np.empty(0, np.int64)]:
            want = reference.gather_rows(np.ascontiguousarray(src[:, :dim]), index)
            index_d = cp.asarray(index)
            _exact(device_ops.gather_rows(src_d, index_d, columns=columns), want)
            _exact(device_ops.gather_rows(src_d, index_d, columns=columns, vector=False), want)
    # rows one element (and 8 bytes) past the boundary: a view into a larger buffer
    for offset in sorted({1, 8 // np.dtype(dtype).itemsize}):
        flat = cp.asarray(_normal_floats(rng, (n_rows * 16 + offset,), dtype))
        view = flat[offset:].reshape(n_rows, 16)
        assert device_ops.vector_lanes(dtype, (16, 16), (view,)) == 0
        index = rng.integers(-1, n_rows, index_shape)
        _exact(device_ops.gather_rows(view, cp.asarray(index)),
               reference.gather_rows(_get(view), index))
    if dtype != np.float32:
        return
    # into the interaction's input, float32 and the fp16 / bf16 patterns
    rows = _normal_floats(rng, (n_rows, dim + 4), np.float32)
    index = rng.integers(-1, n_rows, index_shape[:1] + (5,))
    for precision in ("off", "fp16", "bf16"):
        twin = layout_ops.empty_input(np, index.shape[0], 6, dim, precision, 1)
        twin.data[...] = 7
        layout_ops.gather_into(rows, index, twin, 1, None, dim)
        for vector in (True, False):
            target = layout_ops.empty_input(cp, index.shape[0], 6, dim, precision, 1, launch)
            target.data[...] = 7
            layout_ops.gather_into(cp.asarray(rows), cp.asarray(index), target, 1, launch, dim,
                                   vector=vector)
            _exact(target.data, twin.data)


# ---------------------------------------------------------------- initial values


INITIALIZERS = {
    "constant": opt_mod.ConstantInitializer(0.25),
    "uniform": opt_mod.UniformInitializer(-0.05, 0.05),
    "normal": opt_mod.NormalInitializer(0.1, 2.0),
    "trunc_normal": opt_mod.TruncNormalInitializer(0.0, 1.0, -0.5, 1.5),
    "trunc_normal_clipped": opt_mod.TruncNormalInitializer(3.0, 0.01, -0.1, 0.1),
}


@pytest.mark.parametrize("keyset", ["random", "sequential"])
@pytest.mark.parametrize("name", list(INITIALIZERS))
def test_initial_values_equal_numpy_within_one_ulp(name, keyset):
    from one_embedding.initializers import fill_initial_values, initial_values
    from one_embedding.kernels import device_init

    cp = _cp()
    init = INITIALIZERS[name]
    rng = np.random.default_rng(5)
    keys = _keys(rng, 20_000) if keyset == "random" else np.arange(20_000, dtype=np.uint64)
    seed, col_start, n_cols, offset, width = 12345, 64, 64, 0, 192
    lines = cp.full((keys.size, width), 9.0, dtype=cp.float32)
    rows = rng.permutation(keys.size).astype(np.int64)
    device_init.fill_initial_values(lines, cp.asarray(rows), cp.asarray(keys), init, seed, col_start, n_cols,
                                   offset)
    got = _get(lines)[rows, offset:offset + n_cols]
    want = initial_values(np, init, seed, keys, np.arange(col_start, col_start + n_cols, dtype=np.uint64))
    ulps = _ulps(got, want)
    assert ulps.max() <= 1 and (ulps > 0).mean() < 0.01
    numba = np.full((keys.size, width), 9.0, np.float32)
    fill_initial_values(numba, rows, keys, init, seed, col_start, n_cols, offset)
    assert _ulps(got, numba[rows, offset:offset + n_cols]).max() <= 1
    assert (_get(lines)[:, n_cols:] == 9.0).all()


def test_init_missing_equals_the_cpu_initial_lines_within_one_ulp():
    """The masked one-launch init of a lookup's missing rows (issue 30 item 2) against the CPU
    path's per-table fill: initial values within 1 ulp, states zeroed, other rows untouched."""
    from one_embedding.initializers import fill_initial_values
    from one_embedding.kernels import device_init

    cp = _cp()
    tables = list(INITIALIZERS.values())
    columns = [(0, 64), (64, 1)]
    rng = np.random.default_rng(9)
    n, width, seed = 20_000, 65 * 2, 77
    keys = _keys(rng, n)
    table_ids = rng.integers(0, len(tables), size=n).astype(np.int32)
    missing = rng.random(n) < 0.5
    start = rng.uniform(-1, 1, (n, width)).astype(np.float32)
    lines = cp.asarray(start)
    spec = device_init.init_spec(columns, [[init, init] for init in tables])
    device_init.init_missing(lines, cp.asarray(missing), cp.asarray(table_ids), cp.asarray(keys),
                            spec, seed)
    want = start.copy()
    for t, init in enumerate(tables):
        rows = np.flatnonzero(missing & (table_ids == t)).astype(np.int64)
        want[rows, 65:] = 0.0
        for offset, dim in columns:
            fill_initial_values(want, rows, keys[rows], init, seed, offset, dim, offset)
    got = _get(lines)
    assert (got[~missing] == start[~missing]).all() and (got[missing, 65:] == 0).all()
    assert _ulps(got[missing, :65], want[missing, :65]).max() <= 1


# ---------------------------------------------------------------- fused optimizer updates




@pytest.mark.parametrize("n,dim", [(257, 13), (50_000, 128)])
@pytest.mark.parametrize("name", list(helpers.row_optimizer_cases()))
def test_fused_optimizer_update_is_the_cpu_update(name, n, dim):
    from one_embedding.kernels import device_ops

    cp = _cp()
    make = helpers.row_optimizer_cases()[name]
    gpu_opt, cpu_opt = make(), make()
    rng = np.random.default_rng(n + len(name))
    width = (1 + gpu_opt.n_states) * dim + 3
    want = rng.uniform(-1, 1, (n, width)).astype(np.float32)
    want[:, dim:] = np.abs(want[:, dim:]) + np.float32(0.01)   # accumulators positive, not tiny
    lines = cp.asarray(want)
    for step in range(1, 6):
        grads = rng.uniform(-1, 1, (n, dim)).astype(np.float32)
        grads[:2] = 0.0
        if step == 4:
            gpu_opt.grad_scale = cpu_opt.grad_scale = 0.25
        device_ops.update_lines(gpu_opt, lines, cp.asarray(grads), step)
        states = [want[:, (k + 1) * dim:(k + 2) * dim] for k in range(cpu_opt.n_states)]
        cpu_opt.update(want[:, :dim], states, grads, step)
    if name == "ftrl_power":
        assert _ulps(_get(lines), want).max() <= 1
    else:
        _exact(lines, want)


@pytest.mark.parametrize("n,dim", [(257, 13), (50_000, 128)])
def test_smart_decay_adam_rows_are_the_cpu_update(n, dim):
    """Rows updated on a sparse schedule (k = steps since the row's last update up to 9): the
    fused kernel and the step-writing kernel equal the numba kernel bit for bit."""
    from one_embedding.kernels import device_ops
    from one_embedding.optim import SmartDecayAdam

    cp = _cp()
    gpu_opt, cpu_opt = (SmartDecayAdam(lr=0.01, weight_decay=0.01) for _ in range(2))
    rng = np.random.default_rng(n)
    col = cpu_opt.row_column_offset(dim)
    want = np.zeros((n, cpu_opt.required_storage_dim(dim)), np.float32)
    want[:, :dim] = rng.uniform(-1, 1, (n, dim))
    lines = cp.array(want)                  # a copy (cp.asarray of numpy aliases in a dry run)
    for step in range(1, 12):
        rows = np.flatnonzero(rng.random(n) < 0.3)
        grads = rng.uniform(-1, 1, (rows.size, dim)).astype(np.float32)
        sub = cp.ascontiguousarray(lines[cp.asarray(rows)])
        device_ops.update_lines(gpu_opt, sub, cp.asarray(grads), step)
        lines[cp.asarray(rows)] = sub
        cpu = np.ascontiguousarray(want[rows])
        cpu_opt.update(cpu[:, :dim], [cpu[:, dim:2 * dim], cpu[:, 2 * dim:3 * dim]], grads, step,
                       last_step=cpu[:, col:col + 2])
        want[rows] = cpu
    _exact(lines, want)


# ---------------------------------------------------------------- row codecs


@pytest.mark.parametrize("shape", [(1, 1), (4096, 16), (100_000, 128), (3, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("exchange", ["fp32", "fp16", "int8"])
def test_codec_equals_codec_py_byte_for_byte(exchange, dtype, shape):
    from one_embedding.kernels import codec_ops
    from one_embedding.parallel import codec

    cp = _cp()
    rng = np.random.default_rng(shape[0])
    rows = _normal_floats(rng, shape, dtype, spread=3)
    if shape[0] > 2:
        rows[0] = 0.0                       # f = 0
        rows[1, :1] = 127.0                 # exact .5 ties in x * 127 / f
        rows[1, 1:shape[1] // 2] = 0.5
    payload = codec_ops.encode(cp.asarray(rows), exchange)
    want = codec.encode(rows, exchange)
    _exact(payload, want)
    _exact(codec_ops.decode(payload, exchange, shape[1]), codec.decode(want, exchange, shape[1]))


def test_fp16_codec_rounds_every_float32_class_as_numpy():
    from one_embedding.kernels import codec_ops
    from one_embedding.parallel import codec

    cp = _cp()
    rng = np.random.default_rng(14)
    bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = bits[~np.isnan(bits)]          # NaN payload bits are not specified
    values = values[: values.size // 64 * 64].reshape(-1, 64)
    payload = codec_ops.encode(cp.asarray(values), "fp16")
    with np.errstate(over="ignore"):
        _exact(payload, codec.encode(values, "fp16"))
    _exact(codec_ops.decode(payload, "fp16", 64), codec.decode(_get(payload), "fp16", 64))


def test_int8_codec_of_nan_and_inf_rows_is_the_cpu_codec():
    """A row holding NaN or inf: f = NaN, q = 0 on the GPU too (warps of real lanes)."""
    from one_embedding.kernels import codec_ops
    from one_embedding.parallel import codec

    cp = _cp()
    rows = (np.arange(1, 1 + 64 * 100, dtype=np.float32).reshape(64, 100) / 7).astype(np.float32)
    for r, c, v in [(1, 3, np.nan), (2, 99, np.inf), (3, 0, -np.inf), (5, 40, np.nan), (5, 41, np.inf),
                    (63, 31, np.nan), (62, 32, np.inf)]:
        rows[r, c] = v
    payload = codec_ops.encode(cp.asarray(rows), "int8")
    want = codec.encode(rows, "int8")
    _exact(payload, want)
    decoded, want_rows = _get(codec_ops.decode(payload, "int8", 100)), codec.decode(want, "int8", 100)
    np.testing.assert_array_equal(decoded, want_rows)      # NaN where NaN (its payload bits are
    assert np.isnan(decoded[[1, 2, 3, 5, 62, 63]]).all()   # the platform's), the rest exact
    _exact(decoded[~np.isnan(want_rows)], want_rows[~np.isnan(want_rows)])


# ---------------------------------------------------------------- the "full" index and store


@pytest.mark.parametrize("batch", [100, 10_000, 300_000])
def test_device_hash_index_assigns_the_cpu_slots(batch):
    from one_embedding.cache.device import DeviceHashIndex
    from one_embedding.tiers import HashIndex

    cp = _cp()
    rng = np.random.default_rng(batch)
    dev, cpu = DeviceHashIndex(0), HashIndex(0)
    universe = rng.integers(0, 2**64, 3 * batch, dtype=np.uint64, endpoint=False)
    for _ in range(4):                      # grows several times on the way
        keys = _keys(rng, batch, universe)
        slots, is_new = dev.find_or_insert(cp.asarray(keys))
        want_slots, want_new = cpu.find_or_insert(keys)
        _exact(slots, want_slots)
        _exact(is_new, want_new)
        probe = _keys(rng, batch, np.concatenate([universe, rng.integers(0, 2**64, 100, np.uint64)]))
        _exact(dev.find(cp.asarray(probe)), cpu.find(probe))
    assert len(dev) == len(cpu) and dev.slot_limit == cpu.slot_limit


def test_device_hash_index_gives_a_repeated_key_one_slot():
    from one_embedding.cache.device import DeviceHashIndex
    from one_embedding.tiers import HashIndex

    cp = _cp()
    rng = np.random.default_rng(5)
    dev, cpu = DeviceHashIndex(0), HashIndex(0)
    pool = rng.integers(0, 2**64, 5000, dtype=np.uint64, endpoint=False)
    for size in [10, 3000, 60_000]:
        keys = rng.choice(pool, size)       # every key many times, racing threads on a GPU
        slots, is_new = dev.find_or_insert(cp.asarray(keys))
        want_slots, want_new = cpu.find_or_insert(keys)
        _exact(slots, want_slots)
        _exact(is_new, want_new)
        stored = _get(dev.items()[0])
        assert len(dev) == len(cpu) == stored.size == np.unique(stored).size


def test_device_hash_index_assign_overwrites_and_inserts():
    from one_embedding.cache.device import DeviceHashIndex
    from one_embedding.tiers import HashIndex

    cp = _cp()
    rng = np.random.default_rng(3)
    dev, cpu = DeviceHashIndex(0), HashIndex(0)
    probe = np.arange(20_000, dtype=np.uint64) * np.uint64(2**40)
    for _ in range(3):
        keys = _keys(rng, 8000, probe)
        slots = rng.integers(0, 10**6, keys.size).astype(np.int64)
        dev.assign(cp.asarray(keys), cp.asarray(slots))
        cpu.assign(keys, slots)
        _exact(dev.find(cp.asarray(probe)), cpu.find(probe))
    assert len(dev) == len(cpu) and dev.slot_limit == cpu.slot_limit


@pytest.mark.parametrize("line", [1, 64, 129])
def test_device_full_store_matches_memory_store(line):
    from one_embedding.cache.device import DeviceFullStore
    from one_embedding.store.memory import MemoryStore

    cp = _cp()
    rng = np.random.default_rng(line)
    dev, cpu = DeviceFullStore(line, capacity=50_000), MemoryStore(line, capacity=50_000)
    universe = rng.integers(0, 2**64, 60_000, dtype=np.uint64, endpoint=False)
    for size in [0, 5000, 20_000, 1, 30_000]:
        keys = _keys(rng, size, universe)
        lines = _normal_floats(rng, (keys.size, line))
        dev.insert_or_assign(cp.asarray(keys), cp.asarray(lines))
        cpu.insert_or_assign(keys, lines)
        probe = _keys(rng, 10_000, universe)
        out = cp.full((probe.size + 5, line), 7.0, dtype=cp.float32)
        want = np.full((probe.size + 5, line), 7.0, np.float32)
        out_rows = rng.permutation(probe.size + 5)[: probe.size].astype(np.int64)
        _exact(dev.find(cp.asarray(probe), out, cp.asarray(out_rows)), cpu.find(probe, want, out_rows))
        _exact(out, want)
        assert len(dev) == len(cpu)
    for (k1, l1), (k2, l2) in zip(dev.export_batches(7000), cpu.export_batches(7000), strict=True):
        _exact(k1, k2)
        _exact(l1, l2)


def test_device_full_store_snapshot_loads_into_memory_store_and_back(tmp_path):
    from one_embedding.cache.device import DeviceFullStore
    from one_embedding.store.memory import MemoryStore

    cp = _cp()
    rng = np.random.default_rng(2)
    keys = _keys(rng, 5000)
    lines = _normal_floats(rng, (keys.size, 24))
    dev = DeviceFullStore(24)
    dev.insert_or_assign(cp.asarray(keys), cp.asarray(lines))
    dev.save_snapshot(str(tmp_path))
    host = MemoryStore(24)
    host.load_snapshot(str(tmp_path))
    again = DeviceFullStore(24)
    again.load_snapshot(str(tmp_path))
    out = np.zeros_like(lines)
    assert host.find(keys, out, np.arange(keys.size)).size == 0
    _exact(out, lines)
    out_dev = cp.zeros((keys.size, 24), dtype=cp.float32)
    assert again.find(cp.asarray(keys), out_dev, cp.arange(keys.size)).size == 0
    _exact(out_dev, lines)


def _copy_lines(rng, shape):
    """_normal_floats with the bit patterns a copy must keep: NaN payloads and -0.0."""
    x = _normal_floats(rng, shape)
    flat = x.reshape(-1).view(np.uint32)
    at = rng.choice(flat.size, min(flat.size, 8), replace=False)
    flat[at] = np.resize(np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000], np.uint32),
                         at.size)
    return x


def _line_copy_round(line, n, offset=0):
    """One round of the six line-copying kernels, on a DeviceFullStore and a DeviceCache of
    lines of ``line`` floats and their CPU twins: a fixed-capacity put, a find into scattered
    rows, the fixed-capacity find, the fused dedup + find, cache inserts that evict and a cache
    find; ``offset``: the outputs start that many floats into a buffer (off the 16-byte boundary
    when not a multiple of 4). -> [(device result, twin's)]."""
    from one_embedding.cache.device import DeviceCache, DeviceFullStore
    from one_embedding.cache.set_associative import SetAssociativeCache
    from one_embedding.kernels import device_unique
    from one_embedding.store.memory import MemoryStore

    cp = _cp()
    rng = np.random.default_rng(line)

    def out_buffer(rows):
        flat = cp.full(rows * line + offset, 7.0, dtype=cp.float32)
        return flat[offset:].reshape(rows, line), np.full((rows, line), 7.0, np.float32)

    universe = rng.integers(0, 2**64, 2 * n, dtype=np.uint64, endpoint=False)
    dev, cpu = DeviceFullStore(line, capacity=2 * n), MemoryStore(line, capacity=2 * n)
    pairs = []
    ids = universe[rng.integers(0, n, n)]
    fixed = device_unique.unique_ids_fixed(cp.asarray(ids))
    u = int(_get(fixed.count)[0])
    lines = _copy_lines(rng, (n, line))
    dev.insert_or_assign(fixed.keys, cp.asarray(lines), fixed.count)      # hashindex_put_rows
    cpu.insert_or_assign(_get(fixed.keys)[:u], lines[:u])
    probe = universe[rng.permutation(universe.size)[:n]]                  # half held
    out_rows = rng.permutation(n + 3)[:n].astype(np.int64)
    out, want = out_buffer(n + 3)
    _exact(dev.find(cp.asarray(probe), out, cp.asarray(out_rows)),       # hashindex_find
           cpu.find(probe, want, out_rows))
    pairs.append((out, want))
    ids = universe[rng.integers(0, 2 * n, n)]
    fixed = device_unique.unique_ids_fixed(cp.asarray(ids))
    u = int(_get(fixed.count)[0])
    live, want = out_buffer(n)
    dev.find_found(fixed.keys, live, fixed.count)                         # hashindex_find_live
    cpu.find(_get(fixed.keys)[:u], want, np.arange(u))
    pairs.append((live, want))
    fused, _ = out_buffer(n)
    dev.dedup_find_found(device_unique.dedup_passes_fixed(cp.asarray(ids)), fused)
    pairs.append((fused, want))                                           # the fused find
    cache_rows = n // 32 * 8                                              # a quarter of n
    cache = DeviceCache(line, cache_rows, 8, "lru")
    twin = SetAssociativeCache(line, cache_rows, 8, "lru")
    for _ in range(2):                                                    # cache_insert
        keys = _keys(rng, n, universe)
        lines = _copy_lines(rng, (keys.size, line))
        ev_keys, ev_lines = cache.insert_or_assign(cp.asarray(keys), cp.asarray(lines))
        want_keys, want_lines = twin.insert_or_assign(keys, lines)
        _exact(ev_keys, want_keys)
        assert want_keys.size > 0                                         # it evicts
        pairs.append((ev_lines, want_lines))
    keys = _keys(rng, n, universe)
    out, want = out_buffer(keys.size)
    _exact(cache.find(cp.asarray(keys), out, cp.arange(keys.size)),       # cache_find
           twin.find(keys, want, np.arange(keys.size)))
    pairs.append((out, want))
    return pairs


@pytest.mark.parametrize("line", [4, 8, 12, 16, 256, 6, 130])
def test_line_copies_by_vector_equal_the_element_copies_and_the_twins(line, monkeypatch):
    """The hash index's and the cache's line copies at 16 bytes per lane (hashindex_find,
    find_live, dedup_output_find, put_rows, cache_find, cache_insert with ``vector`` = 1, chosen
    by device_ops.line_vector on CuPy's device pointers exactly where the line is a multiple of 4
    floats) against the same kernels with ``vector`` forced to 0 and the CPU twins, bit for bit;
    outputs one float off the boundary (an offset view) take the element copies, the twins'
    bits (a 16-byte access there would fault)."""
    dry = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"
    n = 200 if dry else 100_000
    from one_embedding.kernels import device_ops

    copies = helpers.LineCopies(monkeypatch, device_ops.cupy_launcher())
    vectorised = _line_copy_round(line, n)
    assert len(copies.kernels()) == 6
    assert copies.vectors() == {int(line % 4 == 0)}
    copies.force = 0
    scalar = _line_copy_round(line, n)
    for (got, want), (forced, _) in zip(vectorised, scalar, strict=True):
        _exact(got, want)
        _exact(forced, want)
    if line % 4 == 0:
        copies.force = None
        copies.seen.clear()
        for got, want in _line_copy_round(line, n, offset=1):
            _exact(got, want)
        assert {(kernel, vector) for kernel, _, vector in copies.seen if kernel in (
            "hashindex_find", "hashindex_find_live", "hashindex_dedup_output_find",
            "cache_find")} == {("hashindex_find", 0), ("hashindex_find_live", 0),
                               ("hashindex_dedup_output_find", 0), ("cache_find", 0)}


# ---------------------------------------------------------------- the set-associative cache


def _compare_caches(dev, cpu, rng, universe, steps, max_batch, line):
    cp = _cp()
    hits = evictions = 0
    for step in range(steps):
        size = int(rng.integers(0, max_batch + 1))
        draw = np.concatenate([np.minimum(rng.zipf(1.3, size=size // 2), universe.size) - 1,
                               rng.integers(0, universe.size, size - size // 2)])
        keys = np.unique(universe[draw])
        rng.shuffle(keys)
        if step % 3 == 1:
            out = cp.full((keys.size + 2, line), np.nan, dtype=cp.float32)
            want = np.full((keys.size + 2, line), np.nan, np.float32)
            out_rows = rng.permutation(keys.size + 2)[: keys.size].astype(np.int64)
            missing = dev.find(cp.asarray(keys), out, cp.asarray(out_rows))
            _exact(missing, cpu.find(keys, want, out_rows))
            _exact(out, want)
            hits += keys.size - int(missing.size)
        else:
            lines = _normal_floats(rng, (keys.size, line))
            ev_keys, ev_lines = dev.insert_or_assign(cp.asarray(keys), cp.asarray(lines))
            want_keys, want_lines = cpu.insert_or_assign(keys, lines)
            _exact(ev_keys, want_keys)
            _exact(ev_lines, want_lines)
            evictions += int(ev_keys.size)
        if step % 12 == 7:  # a snapshot's flush: dirty lines go down, turn clean (then evicted
            # clean, they leave without a copy: later evictions match only if both track it)
            for (k1, l1), (k2, l2) in zip(dev.flush_batches(1000), cpu.flush_batches(1000),
                                          strict=True):
                _exact(k1, k2)
                _exact(l1, l2)
        assert len(dev) == len(cpu)
    _exact(dev.keys(), cpu.keys())
    return hits, evictions


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("n_sets,ways,line,max_batch", [(1, 7, 3, 40), (8, 4, 3, 30), (3, 32, 37, 200),
                                                        (1000, 32, 64, 20_000), (4096, 16, 128, 50_000)])
def test_device_cache_matches_cpu_cache_on_random_trace(policy, n_sets, ways, line, max_batch):
    from one_embedding.cache.device import DeviceCache
    from one_embedding.cache.set_associative import SetAssociativeCache

    rng = np.random.default_rng(n_sets + ways)
    dev = DeviceCache(line, n_sets * ways, ways, policy)
    cpu = SetAssociativeCache(line, n_sets * ways, ways, policy)
    universe = rng.integers(0, 2**64, size=4 * n_sets * ways, dtype=np.uint64, endpoint=False)
    hits, evictions = _compare_caches(dev, cpu, rng, universe, 30, max_batch, line)
    assert hits > 0 and evictions > 0
    for (k1, l1), (k2, l2) in zip(dev.export_batches(10_000), cpu.export_batches(10_000), strict=True):
        _exact(k1, k2)
        _exact(l1, l2)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_device_cache_batch_bigger_than_cache_spills_like_the_cpu(policy):
    from one_embedding.cache.device import DeviceCache
    from one_embedding.cache.set_associative import SetAssociativeCache

    cp = _cp()
    dev = DeviceCache(2, 256, ways=32, policy=policy)
    cpu = SetAssociativeCache(2, 256, ways=32, policy=policy)
    keys = np.arange(10_000, 60_000, dtype=np.uint64)
    lines = np.stack([keys.astype(np.float32), -keys.astype(np.float32)], axis=1)
    for _ in range(2):
        ev_keys, ev_lines = dev.insert_or_assign(cp.asarray(keys), cp.asarray(lines))
        want_keys, want_lines = cpu.insert_or_assign(keys, lines)
        _exact(ev_keys, want_keys)
        _exact(ev_lines, want_lines)
        assert len(dev) == len(cpu) == 256
        lines = lines + 1


def test_device_cache_key_evicted_twice_in_one_batch_goes_down_once_with_its_new_line():
    from one_embedding.cache.device import DeviceCache

    cp = _cp()
    c = DeviceCache(1, 1, ways=1)
    c.insert_or_assign(cp.asarray(np.array([5], np.uint64)), cp.asarray(np.array([[1.0]], np.float32)))
    ev_keys, ev_lines = c.insert_or_assign(cp.asarray(np.array([8, 5, 9], np.uint64)),
                                           cp.asarray(np.array([[2.0], [3.0], [4.0]], np.float32)))
    assert _get(ev_keys).tolist() == [8, 5] and _get(ev_lines)[:, 0].tolist() == [2.0, 3.0]
    assert _get(c.keys()).tolist() == [9]


def test_device_cache_lru_and_lfu_pick_different_victims():
    from one_embedding.cache.device import DeviceCache

    cp = _cp()
    for policy, victim in (("lru", 1), ("lfu", 2)):
        c = DeviceCache(1, 2, 2, policy)
        one = cp.ones((1, 1), dtype=cp.float32)
        out = cp.empty((1, 1), dtype=cp.float32)
        key = lambda k: cp.asarray(np.array([k], np.uint64))   # noqa: E731
        c.insert_or_assign(key(1), one)
        c.find(key(1), out, cp.zeros(1, dtype=cp.int64))
        c.find(key(1), out, cp.zeros(1, dtype=cp.int64))
        c.insert_or_assign(key(2), one)
        ev, _ = c.insert_or_assign(key(3), one)
        assert _get(ev).tolist() == [victim], policy


def test_device_cache_clear_then_refill_matches_the_cpu():
    from one_embedding.cache.device import DeviceCache
    from one_embedding.cache.set_associative import SetAssociativeCache

    rng = np.random.default_rng(7)
    dev, cpu = DeviceCache(4, 640, 32), SetAssociativeCache(4, 640, 32)
    universe = rng.integers(0, 2**64, 3000, dtype=np.uint64, endpoint=False)
    _compare_caches(dev, cpu, rng, universe, 10, 800, 4)
    dev.clear()
    cpu.clear()
    assert len(dev) == 0
    _compare_caches(dev, cpu, rng, universe, 10, 800, 4)


@pytest.mark.skipif(bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN")),
                    reason="in a dry run the device's arrays are numpy's: no host array to refuse")
def test_device_cache_tier_verbs_refuse_host_arrays():
    from one_embedding.cache.device import DeviceCache

    cp = _cp()
    c = DeviceCache(4, 64)
    with pytest.raises(InputError, match="not a cupy array"):
        c.insert_or_assign(np.zeros(2, np.uint64), cp.zeros((2, 4), dtype=cp.float32))
    with pytest.raises(InputError):
        c.find(cp.zeros(2, dtype=cp.uint64), cp.zeros((2, 4), dtype=cp.float64), cp.arange(2))


def test_import_of_the_device_modules_does_not_pull_cupy():
    import subprocess
    import sys

    code = ("import sys, one_embedding.cache.device, one_embedding.kernels.device_ops; "
            "sys.exit('cupy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
