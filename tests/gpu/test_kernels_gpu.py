"""The CUDA kernels (kernels.cuda_ops) against the numpy reference (kernels.reference).

Every test needs CuPy and a CUDA device and is skipped cleanly without them. Three kinds of check:
- exact: purely elementwise results (bias + ReLU, masks, dropout) must equal the float32
  reference bit for bit (the kernels are compiled with --fmad=false, as numpy rounds);
- float32 close: results with sums inside are compared with the reference run in float64 on the
  same values, rtol = 1e-5 and an absolute floor of 1e-5 x the largest magnitude;
- float64 tight: the float64 instantiation against the float64 reference, 1e-12.
Shapes include sizes that are not multiples of 32 (mask tail words) and sizes larger than one
wave of the grid (grid-stride loops, several row chunks in the column reductions).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.errors import InputError

from helpers import close_at_dtype

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
    # kernels.cuda_ops loads its kernels through CuPy's RawModule, which a dry run's stand-in
    # cupy has not (its CUDA sources run on the emulator in tests/unit/test_cuda_sources.py)
    pytest.mark.skipif(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1",
                       reason="cuda_ops needs CuPy's RawModule: a GPU only"),
]


def _mods():
    import cupy

    from one_embedding.kernels import cuda_module, cuda_ops, reference

    return cupy, cuda_ops, reference, cuda_module


def _close(actual, expected, dtype):
    """GPU ``actual`` vs numpy float64 ``expected`` at the tolerance of ``dtype``."""
    import cupy

    got = cupy.asnumpy(actual)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == np.shape(expected)
    close_at_dtype(got, expected, dtype)


def _exact(actual, expected):
    import cupy

    got = cupy.asnumpy(actual)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


DTYPES = [np.float32, np.float64]
MLP_SHAPES = [(1, 1), (3, 5), (33, 31), (64, 1), (2, 96), (257, 100), (4097, 3), (1000, 1024)]


# ---------------------------------------------------------------- bias + activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("shape", MLP_SHAPES)
def test_bias_act_forward_is_bit_identical(shape, relu, dtype):
    cp, ops, ref, cm = _mods()
    rng = np.random.default_rng(sum(shape))
    h = _rand(rng, shape, dtype)
    b = _rand(rng, shape[1:], dtype)
    y_ref, mask_ref = ref.bias_act_forward(h.copy(), b, relu)
    h_gpu = cp.asarray(h)
    y, mask = ops.bias_act_forward(h_gpu, cp.asarray(b), relu)
    _exact(y, y_ref)
    if relu:
        assert mask.dtype == cp.uint32 and mask.shape == (cm.mask_words(h.size),)
        np.testing.assert_array_equal(cp.asnumpy(mask), cm.pack_mask(mask_ref))
    else:
        assert mask is None


def test_relu_mask_round_trip():
    cp, ops, _, cm = _mods()
    rng = np.random.default_rng(5)
    h = _rand(rng, (37, 45), np.float32)          # 1665 elements: the last word is partial
    y, mask = ops.bias_act_forward(cp.asarray(h), cp.zeros(45, dtype=cp.float32), True)
    positive = h > 0
    np.testing.assert_array_equal(cp.asnumpy(ops.unpack_mask(mask, h.shape)), positive)
    np.testing.assert_array_equal(cm.unpack_mask(cp.asnumpy(mask), h.shape), positive)
    words = cp.asnumpy(mask)
    assert words[-1] >> (h.size % 32) == 0            # padding bits stay clear
    assert sum(bin(int(w)).count("1") for w in words) == positive.sum()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("shape", MLP_SHAPES)
def test_bias_act_backward_matches_reference(shape, relu, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(100 + sum(shape))
    h = _rand(rng, shape, dtype)
    b = _rand(rng, shape[1:], dtype)
    dy = _rand(rng, shape, dtype)
    _, mask_ref = ref.bias_act_forward(h.copy(), b, relu)
    _, mask = ops.bias_act_forward(cp.asarray(h), cp.asarray(b), relu)
    dh_ref, _ = ref.bias_act_backward(dy, mask_ref)
    _, db_true = ref.bias_act_backward(dy.astype(np.float64), mask_ref)
    dh, db = ops.bias_act_backward(cp.asarray(dy), mask)
    _exact(dh, dh_ref)
    _close(db, db_true, dtype)
    # no atomics: the same call gives the same bits
    _, db_again = ops.bias_act_backward(cp.asarray(dy), mask)
    _exact(db_again, cp.asnumpy(db))


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rate,seed,step",
    [((1, 1), 0.5, 0, 0), ((7, 9), 0.2, 1, 3), ((33, 31), 0.5, 2**63 + 5, 2**40),
     ((512, 1000), 0.2, 12345, 17), ((100, 100), 0.0, 7, 1), ((64, 33), 0.999, 3, 2)],
)
def test_dropout_masks_and_values_are_bit_identical(shape, rate, seed, step, dtype):
    cp, ops, ref, cm = _mods()
    x = _rand(np.random.default_rng(seed % 1000), shape, dtype)
    y_ref, keep_ref = ref.dropout_forward(x, rate, seed, step)
    y, keep = ops.dropout_forward(cp.asarray(x), rate, seed, step)
    np.testing.assert_array_equal(cp.asnumpy(keep), cm.pack_mask(keep_ref))
    _exact(y, y_ref)
    dy = _rand(np.random.default_rng(1), shape, dtype)
    _exact(ops.dropout_backward(cp.asarray(dy), keep, rate), ref.dropout_backward(dy, keep_ref, rate))


def test_dropout_steps_and_seeds_give_different_masks():
    cp, ops, _, _ = _mods()
    x = cp.ones((64, 64), dtype=cp.float32)
    masks = [cp.asnumpy(ops.dropout_forward(x, 0.5, seed, step)[1]) for seed, step in
             [(1, 0), (1, 1), (2, 0)]]
    assert not np.array_equal(masks[0], masks[1])
    assert not np.array_equal(masks[0], masks[2])
    kept = sum(bin(int(w)).count("1") for w in masks[0]) / x.size
    assert 0.4 < kept < 0.6


# ---------------------------------------------------------------- dot interaction


INTERACTION_CASES = [
    # B, F, D, C, self_interaction, pad
    (1, 1, 1, 0, False, 0),
    (1, 2, 3, 0, True, 1),
    (5, 4, 8, 3, False, 0),
    (3, 27, 128, 128, False, 1),       # DLRM: 128 + 351 pairs -> 479, padded to 480
    (2048, 27, 16, 16, False, 1),      # more outputs than one grid wave
    (9, 39, 16, 0, True, 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,f,d,c,self_interaction,pad", INTERACTION_CASES)
def test_dot_interaction_forward_matches_reference(b, f, d, c, self_interaction, pad, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(b * 1000 + f)
    x = _rand(rng, (b, f, d), dtype)
    concat = _rand(rng, (b, c), dtype) if c else None
    expected = ref.dot_interaction_forward(
        x.astype(np.float64), None if concat is None else concat.astype(np.float64),
        self_interaction, pad)
    out = ops.dot_interaction_forward(
        cp.asarray(x), None if concat is None else cp.asarray(concat), self_interaction, pad)
    _close(out, expected, dtype)
    got = cp.asnumpy(out)
    if c:
        np.testing.assert_array_equal(got[:, :c], concat)      # copied, not recomputed
    assert not got[:, got.shape[1] - pad:].any()                   # padding is exactly zero


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,f,d,c,self_interaction,pad", INTERACTION_CASES)
def test_dot_interaction_backward_matches_reference(b, f, d, c, self_interaction, pad, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(7 + b * 1000 + f)
    x = _rand(rng, (b, f, d), dtype)
    p = f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2
    dout = _rand(rng, (b, c + p + pad), dtype)
    dx_true, dconcat_true = ref.dot_interaction_backward(
        dout.astype(np.float64), x.astype(np.float64), c, self_interaction)
    dx, dconcat = ops.dot_interaction_backward(cp.asarray(dout), cp.asarray(x), c, self_interaction)
    _close(dx, dx_true, dtype)
    if c:
        np.testing.assert_array_equal(cp.asnumpy(dconcat), dout[:, :c])
    else:
        assert dconcat is None and dconcat_true is None


def test_dot_interaction_gradient_by_finite_differences_on_gpu():
    # an independent check of the float64 kernels: <dout, out(x + e v)> - <dout, out(x - e v)>
    cp, ops, _, _ = _mods()
    rng = np.random.default_rng(11)
    x = cp.asarray(rng.standard_normal((3, 5, 4)))
    v = cp.asarray(rng.standard_normal((3, 5, 4)))
    dout = cp.asarray(rng.standard_normal((3, 2 + 15 + 1)))
    concat = cp.asarray(rng.standard_normal((3, 2)))
    eps = 1e-6

    def objective(xx):
        return float((dout * ops.dot_interaction_forward(xx, concat, True, 1)).sum())

    numeric = (objective(x + eps * v) - objective(x - eps * v)) / (2 * eps)
    dx, _ = ops.dot_interaction_backward(dout, x, 2, True)
    assert abs(float((dx * v).sum()) - numeric) < 1e-6 * max(1.0, abs(numeric))


# ---------------------------------------------------------------- DCN cross layers


CROSS_SHAPES = [(1, 1), (3, 16), (33, 31), (100, 40), (10000, 16), (257, 129)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CROSS_SHAPES)
def test_cross_vector_matches_reference(shape, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(shape[0] + 3 * shape[1])
    x0, xl, dnext = (_rand(rng, shape, dtype) for _ in range(3))
    w, b = _rand(rng, shape[1:], dtype), _rand(rng, shape[1:], dtype)
    f64 = [a.astype(np.float64) for a in (x0, xl, w, b, dnext)]
    g = [cp.asarray(a) for a in (x0, xl, w, b, dnext)]
    _close(ops.cross_vector_forward(g[0], g[1], g[2], g[3]),
           ref.cross_vector_forward(f64[0], f64[1], f64[2], f64[3]), dtype)
    got = ops.cross_vector_backward(g[4], g[0], g[1], g[2])
    want = ref.cross_vector_backward(f64[4], f64[0], f64[1], f64[2])
    for actual, expected in zip(got, want):
        _close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CROSS_SHAPES)
def test_cross_matrix_matches_reference(shape, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(shape[0] + 5 * shape[1])
    rows, dim = shape
    x0, xl, dnext = (_rand(rng, shape, dtype) for _ in range(3))
    W = _rand(rng, (dim, dim), dtype, scale=dim ** -0.5)
    b = _rand(rng, (dim,), dtype)
    f64 = [a.astype(np.float64) for a in (x0, xl, W, b, dnext)]
    g = [cp.asarray(a) for a in (x0, xl, W, b, dnext)]
    _close(ops.cross_matrix_forward(g[0], g[1], g[2], g[3]),
           ref.cross_matrix_forward(f64[0], f64[1], f64[2], f64[3]), dtype)
    got = ops.cross_matrix_backward(g[4], g[0], g[1], g[2], g[3])
    want = ref.cross_matrix_backward(f64[4], f64[0], f64[1], f64[2], f64[3])
    for actual, expected in zip(got, want):
        _close(actual, expected, dtype)


# ---------------------------------------------------------------- factorization machine


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 2, 3), (7, 39, 16), (20000, 39, 16), (5, 3, 100)])
def test_fm_matches_reference(shape, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(sum(shape))
    x = _rand(rng, shape, dtype)
    dout = _rand(rng, shape[:1], dtype)
    _close(ops.fm_forward(cp.asarray(x)), ref.fm_forward(x.astype(np.float64)), dtype)
    _close(ops.fm_backward(cp.asarray(dout), cp.asarray(x)),
           ref.fm_backward(dout.astype(np.float64), x.astype(np.float64)), dtype)


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 1000, 300000])
def test_bce_with_logits_matches_reference(n, dtype):
    cp, ops, ref, _ = _mods()
    rng = np.random.default_rng(n)
    logits = _rand(rng, (n,), dtype, scale=4.0)
    logits[: min(n, 4)] = np.array([80.0, -80.0, 0.0, -0.0], dtype=dtype)[: min(n, 4)]
    labels = (rng.random(n) < 0.3).astype(dtype)
    loss = ops.bce_with_logits_forward(cp.asarray(logits), cp.asarray(labels))
    loss_true = ref.bce_with_logits_forward(logits.astype(np.float64), labels.astype(np.float64))
    assert loss.shape == () and isinstance(loss, cp.ndarray)   # left on the device
    loss = float(loss)
    tol = 1e-6 if np.dtype(dtype) == np.float32 else 1e-12
    assert abs(loss - loss_true) <= tol * max(1.0, abs(loss_true))
    _close(ops.bce_with_logits_backward(cp.asarray(logits), cp.asarray(labels)),
           ref.bce_with_logits_backward(logits.astype(np.float64), labels.astype(np.float64)), dtype)


# ---------------------------------------------------------------- validation and loading


def test_inputs_are_validated():
    cp, ops, _, _ = _mods()
    h = cp.zeros((4, 5), dtype=cp.float32)
    with pytest.raises(InputError, match="not a cupy array"):
        ops.bias_act_forward(np.zeros((4, 5), np.float32), cp.zeros(5, cp.float32), True)
    with pytest.raises(InputError, match=r"b has shape \(4,\)"):
        ops.bias_act_forward(h, cp.zeros(4, cp.float32), True)
    with pytest.raises(InputError, match="float64 differs from float32"):
        ops.bias_act_forward(h, cp.zeros(5, cp.float64), True)
    with pytest.raises(InputError, match="bit-packed CUDA mask"):
        ops.bias_act_backward(h, np.ones((4, 5), dtype=bool))
    with pytest.raises(InputError, match="rate=1.0"):
        ops.dropout_forward(h, 1.0, 0, 0)
    with pytest.raises(InputError, match="int32"):
        ops.fm_forward(cp.zeros((2, 3, 4), dtype=cp.int32))
    with pytest.raises(InputError, match="check n_concat"):
        ops.dot_interaction_backward(cp.zeros((2, 3), cp.float32), cp.zeros((2, 4, 2), cp.float32),
                                     0, False)
    with pytest.raises(InputError, match="empty"):
        ops.bce_with_logits_forward(cp.zeros(0, cp.float32), cp.zeros(0, cp.float32))


def test_modules_are_memoised_and_kernels_named_by_family():
    cp, _, _, cm = _mods()
    for family in cm.FAMILIES:
        module = cm.get_module(family)
        assert cm.get_module(family) is module
        for name in cm.kernel_names(family):
            assert name.startswith(family + "_")
            module.get_function(f"{name}<float>")
            module.get_function(f"{name}<double>")


def test_ops_for_cupy_is_cuda_ops():
    cp, ops, _, _ = _mods()
    from one_embedding.kernels import OPS, ops_for

    assert ops_for(cp) is ops
    for name in OPS:
        assert callable(getattr(ops, name))
