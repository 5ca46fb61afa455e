"""``kernels.cuda_ops`` (the CuPy glue of the dense CUDA kernels) run without a GPU: numpy stands
in for CuPy, ``cuda_module.get_kernel`` hands out launches on the host emulator
(tests/cuda_emulation.py) and the GEMMs are numpy's, so every public op of cuda_ops is compared
here with its twin in ``kernels.reference`` at a few odd shapes (rows and columns around warp,
word and block edges, and empty ones), float32 and float64.

What this checks that test_cuda_sources.py (the kernels launched by hand) does not: the glue's
own arguments, grids, output buffers and post-processing (partial sums, mask packing, the
``_no_mask`` stand-in). The launch arguments reach the emulator unchanged, and the emulator
checks each one against the kernel's parameter list (an array of the declared element type,
C-contiguous; a scalar of the declared numpy type), so a launch that a GPU would take with a
wrong pointer type fails here.

Bit for bit where the reference is (bias + activation outputs and masks, dropout, the dot
interaction's concat gradient); elsewhere (reductions, GEMMs, FM, cross layers) within
``helpers.close_at_dtype`` (float32 1e-5, float64 1e-12, relative to max(1, max |expected|));
the BCE loss within 1e-6 of max(1, |loss|), as in test_cuda_sources.py. CuPy's own functions and
NVRTC are left to tests/gpu (the emulator is not the device).

Every patch goes through ``monkeypatch`` (the stand-in ``cupy`` in ``sys.modules`` included), and
cuda_module's pair-table memo is swapped for an empty one, so nothing leaks to other tests. Skips
where g++ is missing (the ``emulation_folder`` fixture).
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import OPS
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import reference as ref

from helpers import close_at_dtype

DTYPES = [np.float32, np.float64]


@pytest.fixture(scope="module")
def dense_lib(emulation_folder):
    """The dense families (``cuda_module.DENSE_FAMILIES``) compiled for the host, once per module
    (reused from the pytest cache where test_cuda_sources.py built them)."""
    from cuda_emulation import build

    return build(cm.DENSE_FAMILIES, emulation_folder)


class _OnDevice(np.ndarray):
    """A numpy view that answers ``.device.id`` as a CuPy array does (numpy 2's ``.device`` is
    the string "cpu"), so that cuda_ops' own ``_float_array`` runs unchanged."""

    device = types.SimpleNamespace(id=0)


@pytest.fixture
def ops(monkeypatch, dense_lib, emulation_seed):
    """``cuda_ops`` with the emulator as the GPU: returns the module; ``ops.launches`` lists the
    kernels launched, in order."""
    import gpu_dry_run
    from cuda_emulation import EmulatedLauncher

    from one_embedding.kernels import cuda_ops

    # the dry run's stand-in cupy (numpy underneath), without install()'s global side effects
    cupy, cuda, _ = gpu_dry_run._fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(cuda_ops, "_cupy", lambda: cupy)

    launcher = EmulatedLauncher(dense_lib, cm.DENSE_FAMILIES, seed=emulation_seed)
    launches = []

    def get_kernel(family, name, dtype):
        assert np.dtype(dtype) in cm.CTYPES, f"{family}_{name} asked for dtype {np.dtype(dtype)}"

        def kernel(grid, block, args):
            # CuPy's RawKernel call: (grid, block, args tuple); the arguments go to the
            # emulator exactly as the glue passes them (it checks them against the signature)
            assert isinstance(args, tuple), f"{family}_{name}: args is a {type(args).__name__}"
            launches.append(f"{family}_{name}")
            launcher.run(family, name, dtype, grid, block, args)

        return kernel

    monkeypatch.setattr(cm, "get_kernel", get_kernel)
    monkeypatch.setattr(cm, "sm_count", lambda: 1)       # small grids: grid-stride loops go round
    monkeypatch.setattr(cm, "_pair_tables", {})          # the memo would keep numpy "device" tables

    matmul = cuda_ops._matmul

    def numpy_matmul(a, b):
        # float32 goes to gemm.matmul (cuBLAS) on a GPU: numpy's product here; float64 takes
        # the glue's own path (cupy.matmul, numpy's under the stand-in)
        if a.dtype == np.float32:
            return np.matmul(a, b)
        return matmul(a, b)

    monkeypatch.setattr(cuda_ops, "_matmul", numpy_matmul)

    float_array = cuda_ops._float_array

    def on_device(name, a, ndim, like=None):
        return float_array(name, a.view(_OnDevice) if type(a) is np.ndarray else a, ndim, like)

    monkeypatch.setattr(cuda_ops, "_float_array", on_device)
    monkeypatch.setattr(cuda_ops, "launches", launches, raising=False)
    return cuda_ops


def _exact(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ---------------------------------------------------------------- coverage of the module


def test_every_public_op_of_cuda_ops_is_covered_here():
    from one_embedding.kernels import cuda_ops

    public = {name for name, value in vars(cuda_ops).items()
              if callable(value) and not name.startswith("_") and not isinstance(value, type)
              and getattr(value, "__module__", None) == cuda_ops.__name__}
    # the reference's twins (kernels.OPS) and unpack_mask (checked against cuda_module.unpack_mask)
    assert public == set(OPS) | {"unpack_mask"}, "a new cuda_ops function: add its test here"


# ---------------------------------------------------------------- bias + activation, dropout

MLP_SHAPES = [(1, 1), (3, 33), (7, 127), (65, 5), (300, 1), (0, 4), (4, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_matches_the_reference_bit_for_bit(ops, dtype):
    rng = np.random.default_rng(1)
    for rows, cols in MLP_SHAPES:
        h = rng.standard_normal((rows, cols)).astype(dtype)
        b = rng.standard_normal(cols).astype(dtype)
        dy = rng.standard_normal((rows, cols)).astype(dtype)
        for relu in (True, False):
            where = f"{rows}x{cols} relu={relu}"
            ops.launches.clear()
            y, mask = ops.bias_act_forward(h.copy(), b, relu)
            y_ref, mask_ref = ref.bias_act_forward(h.copy(), b, relu)
            _exact(y, y_ref)
            assert ops.launches == (["mlp_bias_act_forward"] if rows * cols else []), where
            if relu:
                assert mask.dtype == np.uint32 and mask.shape == (cm.mask_words(rows * cols),), where
                _exact(mask, cm.pack_mask(mask_ref))          # unused high bits 0
                _exact(ops.unpack_mask(mask, (rows, cols)), mask_ref)
            else:
                assert mask is None and mask_ref is None, where
            dh, db = ops.bias_act_backward(dy, mask)
            dh_ref, db_ref = ref.bias_act_backward(dy, mask_ref)
            _exact(dh, dh_ref)
            assert db.shape == (cols,) and db.dtype == dtype, where
            close_at_dtype(db, db_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_forward_writes_in_place_and_reads_a_strided_input(ops, dtype):
    rng = np.random.default_rng(2)
    h = rng.standard_normal((33, 40)).astype(dtype)
    b = rng.standard_normal(40).astype(dtype)
    y, _ = ops.bias_act_forward(h, b, True)
    assert np.shares_memory(y, h)                            # the reference's contract: h consumed
    strided = rng.standard_normal((40, 33)).astype(dtype).T  # not C-contiguous: the glue copies it
    y, mask = ops.bias_act_forward(strided, b, False)
    assert mask is None
    _exact(y, ref.bias_act_forward(strided.copy(), b, False)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_matches_the_reference_bit_for_bit(ops, dtype):
    rng = np.random.default_rng(3)
    for (rows, cols), rate, seed, step in [((1, 1), 0.5, 1, 0), ((3, 33), 0.0, 2**63 + 5, 7),
                                           ((7, 127), 0.5, -3, 2), ((65, 5), 0.9, 12345, 2**40),
                                           ((300, 1), 0.3, 2**64 - 1, 1), ((0, 4), 0.5, 1, 1),
                                           ((4, 0), 0.5, 1, 1)]:
        x = rng.standard_normal((rows, cols)).astype(dtype)
        dy = rng.standard_normal((rows, cols)).astype(dtype)
        y, keep = ops.dropout_forward(x, rate, seed, step)
        y_ref, keep_ref = ref.dropout_forward(x, rate, seed, step)
        _exact(y, y_ref)
        _exact(keep, cm.pack_mask(keep_ref))
        _exact(ops.unpack_mask(keep, (rows, cols)), keep_ref)
        _exact(ops.dropout_backward(dy, keep, rate), ref.dropout_backward(dy, keep_ref, rate))


# ---------------------------------------------------------------- dot interaction


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_interaction_matches_the_reference(ops, dtype):
    rng = np.random.default_rng(4)
    # (batch, features, dim, self_interaction, pad, concat columns)
    for batch, f, d, si, pad, nc in [(1, 1, 1, True, 0, 0), (3, 5, 33, False, 1, 3),
                                     (7, 27, 5, True, 3, 5), (2, 3, 129, False, 0, 129),
                                     (1, 40, 2, False, 2, 0), (0, 3, 4, True, 1, 2),
                                     (3, 3, 0, False, 1, 0)]:
        where = f"{batch},{f},{d} si={si} pad={pad} nc={nc}"
        x = rng.standard_normal((batch, f, d)).astype(dtype)
        concat = rng.standard_normal((batch, nc)).astype(dtype) if nc else None
        out = ops.dot_interaction_forward(x, concat, si, pad)
        out_ref = ref.dot_interaction_forward(x, concat, si, pad)
        assert out.shape == out_ref.shape and out.dtype == dtype, where
        close_at_dtype(out, out_ref, dtype)
        dout = rng.standard_normal(out_ref.shape).astype(dtype)
        dx, dconcat = ops.dot_interaction_backward(dout, x, nc, si)
        dx_ref, dconcat_ref = ref.dot_interaction_backward(dout, x, nc, si)
        assert dx.shape == x.shape and dx.dtype == dtype, where
        close_at_dtype(dx, dx_ref, dtype)
        assert (dconcat is None) == (dconcat_ref is None), where
        if dconcat is not None:
            _exact(dconcat, dconcat_ref)


# ---------------------------------------------------------------- DCN cross layers

CROSS_SHAPES = [(1, 1), (3, 33), (70, 16), (33, 129), (300, 3), (0, 4), (4, 0)]


def _cross_inputs(rng, rows, dim, dtype):
    x0, xl, dnext = (rng.standard_normal((rows, dim)).astype(dtype) for _ in range(3))
    w, b = rng.standard_normal(dim).astype(dtype), rng.standard_normal(dim).astype(dtype)
    W = (rng.standard_normal((dim, dim)) * max(dim, 1) ** -0.5).astype(dtype)
    return x0, xl, dnext, w, b, W


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, seed", [("vector", 5), ("matrix", 6)])
def test_cross_matches_the_reference(ops, dtype, kind, seed):
    rng = np.random.default_rng(seed)
    for rows, dim in CROSS_SHAPES:
        x0, xl, dnext, w, b, W = _cross_inputs(rng, rows, dim, dtype)
        weights = (w,) if kind == "vector" else (W,)
        out = getattr(ops, f"cross_{kind}_forward")(x0, xl, *weights, b)
        assert out.shape == (rows, dim) and out.dtype == dtype
        close_at_dtype(out, getattr(ref, f"cross_{kind}_forward")(x0, xl, *weights, b), dtype)
        extra = () if kind == "vector" else (b,)   # the matrix kind's backward takes b too
        got = getattr(ops, f"cross_{kind}_backward")(dnext, x0, xl, *weights, *extra)
        want = getattr(ref, f"cross_{kind}_backward")(dnext, x0, xl, *weights, *extra)
        assert len(got) == len(want) == 4
        for i, (g, r) in enumerate(zip(got, want)):
            assert g.shape == r.shape and g.dtype == dtype, (rows, dim, i)
            close_at_dtype(g, r, dtype)


# ---------------------------------------------------------------- factorization machine, loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_fm_matches_the_reference(ops, dtype):
    rng = np.random.default_rng(7)
    for batch, f, d in [(1, 1, 1), (3, 5, 33), (7, 27, 5), (2, 3, 129), (1, 40, 2), (0, 3, 4),
                        (3, 3, 0)]:
        x = rng.standard_normal((batch, f, d)).astype(dtype)
        dout = rng.standard_normal(batch).astype(dtype)
        out = ops.fm_forward(x)
        assert out.shape == (batch,) and out.dtype == dtype
        close_at_dtype(out, ref.fm_forward(x), dtype)
        dx = ops.fm_backward(dout, x)
        assert dx.shape == x.shape and dx.dtype == dtype
        close_at_dtype(dx, ref.fm_backward(dout, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bce_with_logits_matches_the_reference(ops, dtype):
    rng = np.random.default_rng(8)
    for n in [1, 3, 257, 1000]:
        logits = (rng.standard_normal(n) * 30).astype(dtype)
        logits[0] = 100.0                                     # log1p(exp(-|z|)) far out
        labels = (rng.random(n) < 0.4).astype(dtype)
        want = ref.bce_with_logits_forward(logits, labels)
        for given in (labels, labels.astype(np.int64)):      # labels cast to the logits' dtype
            loss = ops.bce_with_logits_forward(logits, given)
            assert loss.shape == () and loss.dtype == np.float64
            assert abs(float(loss) - want) <= 1e-6 * max(1.0, abs(want)), (n, given.dtype)
            grad = ops.bce_with_logits_backward(logits, given)
            assert grad.shape == (n,) and grad.dtype == dtype
            close_at_dtype(grad, ref.bce_with_logits_backward(logits, labels), dtype)


# ---------------------------------------------------------------- the glue's refusals


def test_the_glue_refuses_what_a_kernel_cannot_take(ops):
    x = np.ones((4, 8), np.float32)
    with pytest.raises(InputError, match="not a cupy array"):
        ops.bias_act_forward(x.tolist(), np.ones(8, np.float32), True)
    with pytest.raises(InputError, match="float32"):
        ops.dropout_forward(x.astype(np.int32), 0.5, 1, 1)
    with pytest.raises(InputError, match="differs from float32"):
        ops.bias_act_forward(x, np.ones(8, np.float64), True)
    with pytest.raises(InputError, match="bit-packed CUDA mask"):
        ops.bias_act_backward(x, np.ones((4, 8), bool))       # the reference's mask is not one
    with pytest.raises(InputError, match="rate"):
        ops.dropout_forward(x, 1.0, 1, 1)
    with pytest.raises(InputError, match="empty"):
        ops.bce_with_logits_forward(np.ones(0, np.float32), np.ones(0, np.float32))
    assert ops.launches == []
