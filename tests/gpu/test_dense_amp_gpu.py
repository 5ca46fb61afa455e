"""The AMP path's kernels on a GPU against their CPU twins: dense.cu's cast, bias + ReLU + cast,
one-kernel interaction and loss + last layer (kernels/dense_ops.py) against the float64
references the emulator tests use, and the tensor-core products of kernels/gemm.py (tf32, fp16,
bf16; transposed operands read in place; batched) against nn.amp's numpy emulation."""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.kernels import cuda_module as cm
from one_embedding.nn import amp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

UNIT = {"off": 1e-5, "tf32": 2.0 ** -10, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


def _close(got, want, precision, atol, units=2):
    want = np.asarray(want, np.float64)
    assert np.all(np.abs(got - want) <= units * UNIT[precision] * np.abs(want) + atol), \
        np.abs(got - want).max()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
def test_cast_on_the_device_is_round_to(precision):
    import cupy

    from one_embedding.kernels import gemm

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_000) * np.exp2(rng.integers(-30, 20, 100_000))).astype(np.float32)
    bits, rounded = gemm.cast(cupy.asarray(x), precision, rounded=True)
    with np.errstate(over="ignore"):
        want = amp.round_to(x, precision)
    np.testing.assert_array_equal(cupy.asnumpy(rounded), want)
    if precision == "fp16":
        np.testing.assert_array_equal(cupy.asnumpy(bits), x.astype(np.float16).view(np.uint16))
    elif precision == "bf16":
        np.testing.assert_array_equal(cupy.asnumpy(bits), (want.view(np.uint32) >> 16).astype(np.uint16))


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
@pytest.mark.parametrize("fp32_result", [False, True])
def test_tensor_core_products_equal_the_emulation(precision, fp32_result):
    """Linear's three products (x Wᵀ, dhᵀ x, dh W), with the transposed operands as views, and
    the interaction's batched X Xᵀ."""
    import cupy

    rng = np.random.default_rng(1)
    x = rng.standard_normal((384, 640)).astype(np.float32)
    w = rng.standard_normal((256, 640)).astype(np.float32)
    dh = rng.standard_normal((384, 256)).astype(np.float32)
    xb = rng.standard_normal((16, 27, 64)).astype(np.float32)
    xd, wd, dhd, xbd = (cupy.asarray(v) for v in (x, w, dh, xb))
    with amp.autocast(precision):
        for (left, right), (left_d, right_d) in [((x, w.T), (xd, wd.T)),
                                                 ((dh.T, x), (dhd.T, xd)),
                                                 ((dh, w), (dhd, wd)),
                                                 ((xb, xb.transpose(0, 2, 1)),
                                                  (xbd, xbd.transpose(0, 2, 1)))]:
            want = amp.matmul(left, right, fp32_result=fp32_result)
            got = cupy.asnumpy(amp.matmul(left_d, right_d, fp32_result=fp32_result))
            assert got.dtype == np.float32 and got.shape == want.shape
            _close(got, want, precision, atol=1e-3 * np.sqrt(left.shape[-1]))
            if precision != "tf32" and not fp32_result:
                np.testing.assert_array_equal(amp.round_to(got, precision), got)


@pytest.mark.parametrize("precision", ["off", "tf32", "fp16", "bf16"])
def test_interaction_and_loss_kernels_on_the_device_match_float64(monkeypatch, precision):
    import cupy

    from one_embedding.kernels import dense_ops

    rng = np.random.default_rng(2)
    first = rng.standard_normal((512, 1, 64)).astype(np.float32)
    rest = rng.standard_normal((512, 26, 64)).astype(np.float32)
    concat = np.ascontiguousarray(first[:, 0])
    d = [cupy.asarray(v) for v in (first, rest, concat)]
    out = cupy.asnumpy(dense_ops.interaction_forward(*d, False, 1, precision))
    assert dense_ops.fits_tile(27, 64, False)   # the shared-memory kernel ran; the other agrees
    np.testing.assert_array_equal(
        out, cupy.asnumpy(dense_ops.interaction_forward(*d, False, 1, precision, tile=False)))
    _close(out, dense_ops.interaction_forward_reference(first, rest, concat, False, 1, precision),
           precision, atol=1e-4 * 8)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    got = dense_ops.interaction_backward(cupy.asarray(dout), d[0], d[1], 64, False, precision)
    other = dense_ops.interaction_backward(cupy.asarray(dout), d[0], d[1], 64, False, precision,
                                           tile=False)
    monkeypatch.setattr(dense_ops, "BLOCKED_INTERACTION", False)     # the _tile kernels
    tiled_out = cupy.asnumpy(dense_ops.interaction_forward(*d, False, 1, precision))
    tiled = dense_ops.interaction_backward(cupy.asarray(dout), d[0], d[1], 64, False, precision)
    monkeypatch.undo()
    assert dense_ops.fits_blocked(27, 64)    # the default ran the _vector / _blocked kernels
    np.testing.assert_array_equal(out, tiled_out)
    for g, o, t in zip(got, other, tiled):
        np.testing.assert_array_equal(cupy.asnumpy(g), cupy.asnumpy(o))
        np.testing.assert_array_equal(cupy.asnumpy(g), cupy.asnumpy(t))
    want = dense_ops.interaction_backward_reference(dout, first, rest, 64, False, precision)
    for g, w in zip(got, want):
        _close(cupy.asnumpy(g), w, precision, atol=1e-4 * 27 * 4)

    x = rng.standard_normal((8192, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    logits = (rng.standard_normal(8192) * 3).astype(np.float32)
    labels = (rng.random(8192) < 0.25).astype(np.float32)
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    got = dense_ops.bce_last_layer(*(cupy.asarray(v) for v in (logits, labels, x, w)), scale, precision)
    loss, dz, dx, dw, db = (cupy.asnumpy(v) for v in got)
    w_loss, w_dz, w_dx, w_dw, w_db = dense_ops.bce_last_layer_reference(logits, labels, x, w, scale,
                                                                        precision)
    assert abs(float(loss) - w_loss) <= 1e-6 * w_loss
    np.testing.assert_allclose(dz, w_dz, rtol=1e-5, atol=1e-7 * scale)
    _close(dx, w_dx, precision, atol=1e-7 * scale)
    np.testing.assert_allclose(dw, w_dw, rtol=1e-3, atol=1e-4 * scale)
    assert abs(float(db) - w_db) <= 1e-4 * np.abs(w_dz).sum()


@pytest.mark.parametrize("precision", ["off", "fp16", "bf16"])
def test_bias_act_cast_on_the_device(precision):
    import cupy

    from one_embedding.kernels import dense_ops, reference

    rng = np.random.default_rng(3)
    h = rng.standard_normal((1027, 257)).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    y_ref, mask_ref = reference.bias_act_forward(h.copy(), b, True)
    y, mask, bits = dense_ops.bias_act_cast_forward(cupy.asarray(h), cupy.asarray(b), True, precision)
    np.testing.assert_array_equal(cupy.asnumpy(y), y_ref)
    np.testing.assert_array_equal(cupy.asnumpy(mask), cm.pack_mask(mask_ref))
    if precision == "fp16":
        np.testing.assert_array_equal(cupy.asnumpy(bits), y_ref.astype(np.float16).view(np.uint16))
    elif precision == "bf16":
        want = (amp.round_to(y_ref, "bf16").view(np.uint32) >> 16).astype(np.uint16)
        np.testing.assert_array_equal(cupy.asnumpy(bits), want)


@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_bias_act_kernels_with_loads_ahead_give_the_bits_of_one_at_a_time(monkeypatch,
                                                                           precision):
    """On the GPU (real concurrency, nvcc's scheduling): bias + ReLU (+ cast) forward and, under
    bf16, its backward with the loads ahead of the stores (``cuda_module.LOADS_AHEAD``) and one
    at a time: the same y, mask, patterns, dh and bias-gradient partial sums."""
    import cupy

    from one_embedding.kernels import dense_ops

    rng = np.random.default_rng(4)
    rows = 2048 if os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") else 65_536  # the emulator's pace
    h = rng.standard_normal((rows, 257)).astype(np.float32)
    h.reshape(-1)[:3] = [np.nan, -0.0, np.inf]
    b = rng.standard_normal(257).astype(np.float32)
    dy = rng.standard_normal(h.shape).astype(np.float32)
    results = []
    for ahead in (True, False):
        monkeypatch.setattr(cm, "LOADS_AHEAD", ahead)
        y, mask, bits = dense_ops.bias_act_cast_forward(cupy.array(h), cupy.asarray(b), True,
                                                        precision)      # y overwrites h's copy
        out = [y.view(cupy.uint32), mask] + ([bits] if bits is not None else [])
        if precision == "bf16":
            dh_bits, db = dense_ops.bias_act_backward_cast(cupy.asarray(dy), mask, precision)
            out += [dh_bits, db.view(cupy.uint32)]
        results.append([cupy.asnumpy(a) for a in out])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_linear_backward_with_the_fused_cast_gives_the_bits_of_the_path_before(precision, relu,
                                                                               monkeypatch):
    """Linear's backward under fp16 / bf16 with dh written only as its 16-bit pattern
    (``dense_ops.bias_act_backward_cast``, both products reading it: ``gemm.matmul`` of a uint16
    operand and of its transposed view) against the path before (dh in fp32 from
    ``bias_act_backward``, cast by each product): dx and the weight and bias gradients bit for
    bit, and the kernel's bits and bias gradient against the unfused pair's. (The dry run's
    arrays are numpy: both runs take the numpy path there.)"""
    import cupy

    from one_embedding.kernels import dense_ops, gemm, ops_for
    from one_embedding.nn import Linear, linear

    rng = np.random.default_rng(11)
    batch, n_in, n_out = 2048, 96, 160
    x = (rng.standard_normal((batch, n_in)) * 0.5).astype(np.float32)
    dy = (rng.standard_normal((batch, n_out)) * 1e-2).astype(np.float32)
    xp = cupy if not isinstance(cupy.asarray(x), np.ndarray) else np
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(linear, "FUSED_BACKWARD_CAST", fused)
        layer = Linear(n_in, n_out, relu=relu, seed=5).to(xp)
        with amp.autocast(precision):
            layer.forward(xp.asarray(x))
            dx = layer.backward(xp.asarray(dy))
        results[fused] = [np.asarray(cupy.asnumpy(a)) for a in
                          (dx, layer.weight.grad, layer.bias.grad)]
    for got, want in zip(results[True], results[False]):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if xp is np:
        return
    mask = None
    if relu:
        _, mask = ops_for(cupy).bias_act_forward(cupy.asarray(x[:, :1].repeat(n_out, 1)),
                                                 cupy.zeros(n_out, cupy.float32), True)
    bits, db = dense_ops.bias_act_backward_cast(cupy.asarray(dy), mask, precision)
    dh, db_before = ops_for(cupy).bias_act_backward(cupy.asarray(dy), mask)
    np.testing.assert_array_equal(cupy.asnumpy(bits), cupy.asnumpy(gemm.cast(dh, precision)[0]))
    np.testing.assert_array_equal(cupy.asnumpy(db).view(np.uint32),
                                  cupy.asnumpy(db_before).view(np.uint32))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mlp_backward_handing_unrounded_gradients_down_gives_the_bits_of_the_path_before(
        precision, dropout, monkeypatch):
    """An MLP's backward under fp16 / bf16 where each layer leaves its input gradient unrounded
    for the layer below, which rounds it as it reads it (no dropout between them), against the
    path before (every gradient rounded by its own pass, dh cast by each product), the loss fused
    with the last layer or not: the input gradient and every parameter gradient bit for bit.
    (The dry run's arrays are numpy: both runs take the numpy path there.)"""
    import cupy

    from one_embedding.nn import MLP, linear

    rng = np.random.default_rng(12)
    batch = 1024
    dense = (rng.standard_normal((batch, 48)) * 0.5).astype(np.float32)
    labels = (rng.random(batch) < 0.3).astype(np.float32)
    xp = cupy if not isinstance(cupy.asarray(dense), np.ndarray) else np
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(linear, "FUSED_BACKWARD_CAST", fused)
        out = []
        for with_loss in (True, False):
            mlp = MLP(48, [96, 64, 32, 1], last_relu=False, dropout=dropout, seed=4).to(xp)
            with amp.autocast(precision):
                logits = mlp.forward(xp.asarray(dense)).reshape(-1)
                if with_loss:
                    dx = mlp.loss_and_backward(logits, xp.asarray(labels), 1.0)[2]
                else:
                    dx = mlp.backward(xp.asarray(np.full((batch, 1), 1e-3, np.float32)))
            out += [dx] + [p.grad for p in mlp.parameters()]
        results[fused] = [np.asarray(cupy.asnumpy(a)) for a in out]
    for i, (got, want) in enumerate(zip(results[True], results[False])):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(i))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mlp_hidden_outputs_as_16_bit_copies_alone_give_the_bits_of_the_fp32_path(
        precision, monkeypatch):
    """An MLP under fp16 / bf16 with its hidden outputs written only as the 16-bit copies the
    next layer's products read, against the path that also writes them in fp32
    (``linear.HIDDEN_OUTPUTS_AS_BITS`` off): output, input gradient and parameter gradients bit
    for bit, and no fp32 hidden activation kept for the backward. (The dry run's arrays are
    numpy: both runs take the numpy path there.)"""
    import cupy

    from one_embedding.nn import MLP, linear

    rng = np.random.default_rng(13)
    batch = 1024
    dense = (rng.standard_normal((batch, 48)) * 0.5).astype(np.float32)
    labels = (rng.random(batch) < 0.3).astype(np.float32)
    xp = cupy if not isinstance(cupy.asarray(dense), np.ndarray) else np
    results, kept = {}, {}
    for as_bits in (True, False):
        monkeypatch.setattr(linear, "HIDDEN_OUTPUTS_AS_BITS", as_bits)
        mlp = MLP(48, [96, 64, 32, 1], last_relu=False, seed=4).to(xp)
        with amp.autocast(precision):
            logits = mlp.forward(xp.asarray(dense)).reshape(-1)
            kept[as_bits] = [layer._x is not None for layer in mlp.layers]
            dx = mlp.loss_and_backward(logits, xp.asarray(labels), 1.0)[2]
        results[as_bits] = [np.asarray(cupy.asnumpy(a)) for a in
                            [logits, dx] + [p.grad for p in mlp.parameters()]]
    for i, (got, want) in enumerate(zip(results[True], results[False])):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(i))
    if xp is not np:
        assert kept == {True: [True, False, False, True], False: [True] * 4}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_interaction_hands_the_top_mlp_16_bit_patterns_alone_with_the_same_bits(
        precision, monkeypatch):
    """DLRM's interaction -> top MLP with the interaction's output written only as the 16-bit
    patterns the first product reads, against writing it in fp32 (``HIDDEN_OUTPUTS_AS_BITS``
    off): logits, input gradients and parameter gradients bit for bit. (The dry run's arrays
    are numpy: both runs take the numpy path there.)"""
    import cupy

    from one_embedding.nn import MLP, DotInteraction, linear

    rng = np.random.default_rng(17)
    batch, tables, dim = 512, 26, 128
    bottom = (rng.standard_normal((batch, dim)) * 0.5).astype(np.float32)
    emb = (rng.standard_normal((batch, tables, dim)) * 0.5).astype(np.float32)
    labels = (rng.random(batch) < 0.3).astype(np.float32)
    xp = cupy if not isinstance(cupy.asarray(bottom), np.ndarray) else np
    width = dim + tables * (tables + 1) // 2 + 1
    results, returned = {}, {}
    for as_bits in (True, False):
        monkeypatch.setattr(linear, "HIDDEN_OUTPUTS_AS_BITS", as_bits)
        inter = DotInteraction(output_padding=1)
        top = MLP(width, [256, 64, 1], last_relu=False, seed=2).to(xp)
        b_d, e_d = xp.asarray(bottom), xp.asarray(emb)
        with amp.autocast(precision):
            out = inter.forward([b_d, e_d], b_d, fp32_output=not top.takes_input_bits())
            returned[as_bits] = out is not None
            logits = top.forward(out, inter.out_bits).reshape(-1)
            dinter = top.loss_and_backward(logits, xp.asarray(labels), 1.0)[2]
            (gb, ge), gc = inter.backward(dinter)
        results[as_bits] = [np.asarray(cupy.asnumpy(a)) for a in
                            [logits, dinter, gb, ge, gc] + [p.grad for p in top.parameters()]]
    for i, (got, want) in enumerate(zip(results[True], results[False])):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(i))
    if xp is not np:
        assert returned == {True: False, False: True}


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
def test_interaction_layer_on_the_device_equals_numpy(precision):
    """DotInteraction on CuPy under AMP runs dense.cu's one-kernel path: same numerics as the
    numpy path (DLRM's [bottom, embeddings] layout, concat, padding)."""
    import cupy

    from one_embedding.nn import DotInteraction

    rng = np.random.default_rng(4)
    bottom = rng.standard_normal((512, 128)).astype(np.float32)
    emb = rng.standard_normal((512, 26, 128)).astype(np.float32)
    host, device = DotInteraction(output_padding=1), DotInteraction(output_padding=1)
    with amp.autocast(precision):
        want = host([bottom, emb], bottom)
        b_d, e_d = cupy.asarray(bottom), cupy.asarray(emb)
        got = device([b_d, e_d], b_d)
        # the one-kernel path on a GPU; a dry run's arrays are numpy, which take the numpy one
        assert (device._fused is not None) == (not isinstance(b_d, np.ndarray))
        dout = rng.standard_normal(want.shape).astype(np.float32)
        (wb, we), wc = host.backward(dout)
        (gb, ge), gc = device.backward(cupy.asarray(dout))
    _close(cupy.asnumpy(got), want, precision, atol=1e-3)
    _close(cupy.asnumpy(gb), wb, precision, atol=1e-3)
    _close(cupy.asnumpy(ge), we, precision, atol=1e-3)
    np.testing.assert_array_equal(cupy.asnumpy(gc), wc)


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
def test_one_output_layer_backward_on_the_device_equals_numpy(precision):
    """Linear(K, 1) on CuPy under AMP: the forward's GEMM + epilogue and the one-kernel backward
    (dense_ops.last_layer_backward) against the numpy layer."""
    import cupy

    from one_embedding.nn import Linear

    rng = np.random.default_rng(5)
    x = rng.standard_normal((4096, 256)).astype(np.float32)
    dy = (rng.standard_normal((4096, 1)) * 64).astype(np.float32)
    host, device = Linear(256, 1, seed=1), Linear(256, 1, seed=1)
    device.to(cupy)
    with amp.autocast(precision):
        y = host(x)
        y_d = cupy.asnumpy(device(cupy.asarray(x)))
        dx = host.backward(dy)
        dx_d = cupy.asnumpy(device.backward(cupy.asarray(dy)))
    _close(y_d, y, precision, atol=1e-3)
    np.testing.assert_array_equal(dx_d, dx)
    np.testing.assert_allclose(cupy.asnumpy(device.weight.grad), host.weight.grad, rtol=1e-4,
                               atol=1e-2)
    np.testing.assert_allclose(cupy.asnumpy(device.bias.grad), host.bias.grad, rtol=1e-4, atol=1e-3)
