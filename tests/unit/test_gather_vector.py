"""The embedding gathers at 16 bytes per thread (issue 32 item 3): ``embedding_gather_vector`` and
``embedding_gather_into_vector`` (``cuda/embedding.cu``) on the host emulator (default mode and
stress seeds), against the one-element-per-thread kernels they stand in for and the numpy
references, bit for bit; which kernel runs (the vectorised one on an aligned layout, the scalar
one on any other: odd widths and strides, arrays at addresses off a 16-byte boundary), and the
emulator's own check that a vector is never read or written off its alignment."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.kernels import device_ops, layout_ops, reference

DIMS = [4, 8, 12, 128, 129]


def _at(shape, dtype, offset: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous array whose first element lies ``offset`` bytes past a
    16-byte boundary (numpy's own allocations are 16-byte aligned on common platforms, but
    nothing here relies on it)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 32 + offset, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    a = raw[start:start + nbytes].view(dtype).reshape(shape)
    assert device_ops.array_address(a) % 16 == offset % 16
    return a


def _values(rng, shape, dtype, offset: int = 0) -> np.ndarray:
    """Random values over a wide range, with the bit patterns a copy must keep: NaN payloads,
    -0.0, infinities, subnormals."""
    a = _at(shape, dtype, offset)
    a[...] = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 18, shape))
    flat = a.reshape(-1)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf, np.finfo(dtype).tiny / 4, 65520.0],
                        dtype)
    at = rng.choice(flat.size, min(flat.size, 4 * specials.size), replace=False)
    flat[at] = np.resize(specials, at.size)
    flat.view(np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint64)[at[:1]] |= 1  # NaN payload
    return a


def _index(rng, n_rows, shape):
    index = rng.integers(0, max(n_rows, 1), shape).astype(np.int64) if n_rows else \
        np.full(shape, -1, np.int64)
    index.reshape(-1)[::7] = -1                                         # padding: zero rows
    return index


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else
                  np.uint64 if a.dtype.itemsize == 8 else np.uint16)


def _gather(launch, src, index, columns, vector):
    launch.launched.clear()
    out = device_ops.gather_rows(src, index, launch, columns=columns, vector=vector)
    return out, set(launch.launched)


# ---------------------------------------------------------------- gather_rows


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", DIMS)
def test_vector_gather_equals_the_scalar_gather_and_the_reference(launch, dim, dtype):
    """Rows of dim columns gathered from rows of exactly dim and from whole lines (stride > dim,
    read in place), with padding, by the vectorised kernel where the layout allows it (dim a
    multiple of the lanes) and the scalar one: the reference's bits."""
    rng = np.random.default_rng(dim)
    lanes = 16 // np.dtype(dtype).itemsize
    for stride in (dim, dim + 4):
        src = _values(rng, (40, stride), dtype)
        # (40, 26) ids of 128 columns: more 16-byte groups than a grid's threads take in one
        # step of gather::AHEAD (emulated: 2048 threads x 4), and a short last step
        for index in [_index(rng, 40, (5, 26)), _index(rng, 40, (40, 26)),
                      np.array([39, -1, 0], np.int64), np.empty(0, np.int64)]:
            columns = None if stride == dim else dim
            want = reference.gather_rows(np.ascontiguousarray(src[:, :dim]), index)
            got, kernels = _gather(launch, src, index, columns, True)
            scalar, scalar_kernels = _gather(launch, src, index, columns, False)
            assert got.shape == scalar.shape == np.shape(index) + (dim,)
            np.testing.assert_array_equal(_bits(got), _bits(want))
            np.testing.assert_array_equal(_bits(scalar), _bits(want))
            if index.size:
                vector = dim % lanes == 0 and stride % lanes == 0
                assert kernels == {"embedding_gather_vector" if vector else "embedding_gather"}
                assert scalar_kernels == {"embedding_gather"}


@pytest.mark.stress_seeds
def test_vector_gather_of_an_empty_table_writes_zero_rows(launch):
    src = _at((0, 8), np.float32)
    got, kernels = _gather(launch, src, np.array([-1, -1, -1]), None, True)
    assert kernels == {"embedding_gather_vector"}
    np.testing.assert_array_equal(_bits(got), np.zeros((3, 8), np.uint32))   # +0.0, not -0.0


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_layout_off_the_vector_boundary_falls_back_to_the_scalar_gather(launch, dtype):
    """Rows at an address one element or 8 bytes past a 16-byte boundary (an offset view into a
    buffer), and rows whose length is no multiple of the lanes (every row after the first off
    the boundary, their first 16 columns gathered in place): the scalar kernel runs and gives
    the reference's bits. A column slice (not contiguous) is gathered from a contiguous copy."""
    rng = np.random.default_rng(12)
    itemsize = np.dtype(dtype).itemsize
    index = _index(rng, 30, (6, 9))
    cases = [(_values(rng, (30, 16), dtype, offset=itemsize), None),
             (_values(rng, (30, 16), dtype, offset=8), None),
             (_values(rng, (30, 18 if itemsize == 4 else 17), dtype), 16)]
    for src, columns in cases:
        want = reference.gather_rows(np.ascontiguousarray(src[:, :columns]), index)
        got, kernels = _gather(launch, src, index, columns, True)
        assert kernels == {"embedding_gather"}, (src.shape, device_ops.array_address(src) % 16)
        np.testing.assert_array_equal(_bits(got), _bits(want))
    sliced = _values(rng, (30, 17), dtype)[:, 1:]              # column 1 on
    got, _ = _gather(launch, sliced, index, None, True)
    want = reference.gather_rows(np.ascontiguousarray(sliced), index)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_the_emulator_refuses_a_misaligned_vector_access(emulation_lib):
    """The vectorised kernel launched by hand on rows 4 bytes off the boundary fails the launch,
    as the GPU faults ("misaligned address"): the host-side check above is what keeps it away.
    In the default mode, where kernels see the arrays' own addresses (the stress mode's guarded
    copies keep the element alignment only)."""
    from cuda_emulation import EmulatedLauncher

    from one_embedding.kernels import cuda_module as cm

    launch = EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES, seed=None)
    src = _values(np.random.default_rng(13), (8, 8), np.float32, offset=4)
    out = _at((2, 8), np.float32)
    index = np.array([1, 2], np.int64)
    with pytest.raises(AssertionError, match="misaligned vector access"):
        device_ops.launch_threads(launch, "embedding", "gather_vector", np.float32, 2 * 2,
                                  (src, np.int32(2), np.int32(2), index, np.int64(2), out))


# ---------------------------------------------------------------- gather_into


def _gather_into(launch, rows, index, precision, columns, vector, offset=0):
    batch, n_features = index.shape
    dim = rows.shape[1] if columns is None else columns
    storage = layout_ops.storage_dtype(precision)
    data = _at((batch, n_features + 2, dim), storage, offset)
    data[...] = 7                                       # the slots the gather must not touch
    target = layout_ops.InteractionInput(data, precision, 1, launch)
    launch.launched.clear()
    layout_ops.gather_into(rows, index, target, 1, launch, columns, vector=vector)
    return data, set(launch.launched)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["off", "fp16", "bf16"])
@pytest.mark.parametrize("dim", DIMS)
def test_vector_gather_into_equals_the_scalar_one_and_the_twin(launch, dim, precision):
    """Rows into the interaction's input (float32, or 4 fp16 / bf16 patterns per store) from
    rows of exactly dim and from whole lines, with padding: the vectorised kernel where the
    layout allows it, the scalar one, and the numpy twin write the same bits, and only their
    slots."""
    rng = np.random.default_rng(100 + dim)
    for stride, batch in ((dim, 6), (dim + 4, 6), (dim, 300)):   # 300 x 5 rows: several steps
        rows = _values(rng, (20, stride), np.float32)            # of gather::AHEAD items
        index = _index(rng, 20, (batch, 5))
        columns = None if stride == dim else dim
        storage = layout_ops.storage_dtype(precision)
        twin = layout_ops.InteractionInput(np.full((batch, 7, dim), 7, storage), precision, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            layout_ops.gather_into(rows, index, twin, 1, None, columns)
        got, kernels = _gather_into(launch, rows, index, precision, columns, True)
        scalar, scalar_kernels = _gather_into(launch, rows, index, precision, columns, False)
        np.testing.assert_array_equal(_bits(got), _bits(twin.data))
        np.testing.assert_array_equal(_bits(scalar), _bits(twin.data))
        vector = dim % 4 == 0 and stride % 4 == 0
        assert kernels == {"embedding_gather_into_vector" if vector else "embedding_gather_into"}
        assert scalar_kernels == {"embedding_gather_into"}


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_gather_into_off_the_vector_boundary_falls_back(launch, precision):
    """The buffer 4 bytes (float32) or 2 bytes (patterns) off its vector boundary, or the rows 4
    bytes off theirs: the scalar kernel runs and writes the twin's bits. The patterns' buffer
    needs 8 bytes only: 8 bytes past a 16-byte boundary still runs vectorised."""
    rng = np.random.default_rng(14)
    index = _index(rng, 20, (4, 3))
    values = _values(rng, (20, 8), np.float32)
    storage = layout_ops.storage_dtype(precision)
    twin = layout_ops.InteractionInput(np.full((4, 5, 8), 7, storage), precision, 1)
    layout_ops.gather_into(values, index, twin, 1)
    item = np.dtype(storage).itemsize
    scalar, vector = "embedding_gather_into", "embedding_gather_into_vector"
    for rows_offset, data_offset, kernel in [(0, item, scalar), (4, 0, scalar),
                                             (0, 8, scalar if item == 4 else vector),
                                             (0, 0, vector)]:
        rows = _at(values.shape, np.float32, rows_offset)
        rows[...] = values
        got, kernels = _gather_into(launch, rows, index, precision, None, True, data_offset)
        assert kernels == {kernel}, (rows_offset, data_offset)
        np.testing.assert_array_equal(_bits(got), _bits(twin.data))


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["off", "fp16"])
def test_vector_write_slot_and_an_empty_batch(launch, precision):
    """write_slot (the bottom MLP's output into slot 0, no index) runs vectorised and equals its
    twin; a batch of no samples launches nothing and writes nothing."""
    rng = np.random.default_rng(15)
    z = _values(rng, (5, 12), np.float32)
    data = _at((5, 3, 12), layout_ops.storage_dtype(precision))
    data[...] = 7
    twin = layout_ops.InteractionInput(data.copy(), precision, 1)
    layout_ops.write_slot(z, twin, 0)
    target = layout_ops.InteractionInput(data, precision, 1, launch)
    launch.launched.clear()
    layout_ops.write_slot(z, target, 0, launch)
    assert launch.launched == {"embedding_gather_into_vector"}
    np.testing.assert_array_equal(_bits(target.data), _bits(twin.data))
    empty = layout_ops.InteractionInput(_at((0, 3, 12), np.float32), "off", 1, launch)
    launch.launched.clear()
    layout_ops.gather_into(z, np.empty((0, 2), np.int64), empty, 1, launch)
    assert launch.launched == set()
