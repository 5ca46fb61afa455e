"""The layers' CuPy fp16 / bf16 glue (nn.linear, nn.interaction) run on the CPU: the arrays stay
numpy while the layers take them for a device's (their namespace patched), the kernels run on the
host emulator (``dense_ops.resolve``) and the products are nn.amp's numpy emulation of the tensor
cores' operands. What the GPU tests check on a device, checked here on every run: which path a
layer takes, what it keeps for the backward, and that the 16-bit hand-offs give the bits of the
paths before them."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import dense_ops
from one_embedding.nn import amp


@pytest.fixture
def launch(amp_lib, emulation_seed):
    from cuda_emulation import EmulatedLauncher

    return EmulatedLauncher(amp_lib, cm.AMP_FAMILIES, seed=emulation_seed)


class _DeviceNumpy:
    """numpy under another name: the namespace Linear takes for a device's (its CuPy path) while
    the arrays stay numpy, the kernels run on the emulator (``dense_ops.resolve``) and the
    products are nn.amp's numpy emulation."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("sizes, last_relu", [([96, 64, 32, 1], False), ([96, 64, 32], True)])
def test_mlp_hidden_outputs_as_16_bit_copies_alone_give_the_bits_of_the_fp32_path(
        launch, monkeypatch, precision, sizes, last_relu):
    """An MLP's CuPy fp16 / bf16 path through the layers' own glue, on the emulator: with the
    hidden outputs that only the next layer's products read written as their 16-bit copies
    alone (no fp32 array written or kept), against the path that also writes them in fp32
    (``linear.HIDDEN_OUTPUTS_AS_BITS`` off): the output, the input gradient and every parameter
    gradient bit for bit, the loss fused with the last layer or not."""
    from one_embedding.nn import MLP, linear

    device = _DeviceNumpy()
    monkeypatch.setattr(dense_ops, "resolve", lambda _: launch)
    monkeypatch.setattr(linear, "array_namespace", lambda *arrays: device)
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((70, 48)) * 0.5).astype(np.float32)
    labels = (rng.random(70) < 0.3).astype(np.float32)
    results, kept = {}, {}
    for as_bits in (True, False):
        monkeypatch.setattr(linear, "HIDDEN_OUTPUTS_AS_BITS", as_bits)
        out = []
        for with_loss in (True, False) if not last_relu else (False,):
            mlp = MLP(48, sizes, last_relu=last_relu, seed=4)
            with amp.autocast(precision):
                y = mlp.forward(x)
                kept[as_bits] = [layer._x is not None for layer in mlp.layers]
                if with_loss:
                    dx = mlp.loss_and_backward(y.reshape(-1), labels, 1.0)[2]
                else:
                    dx = mlp.backward(np.full(y.shape, 1e-3, np.float32))
            out += [y, dx] + [p.grad for p in mlp.parameters()]
        results[as_bits] = out
    for i, (got, want) in enumerate(zip(results[True], results[False], strict=True)):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(i))
    assert kept[False] == [True] * len(sizes)
    # layer 0 reads the MLP's input; a logit layer's input stays fp32 for its one-pass backward
    want_kept = [True] + [False] * (len(sizes) - 1)
    if not last_relu:
        want_kept[-1] = True
    assert kept[True] == want_kept


def test_a_linear_layer_without_its_input_bits_names_the_path_that_takes_them():
    from one_embedding.nn import Linear

    with pytest.raises(InputError, match="x=None.*x_bits.*fp16 / bf16 on CuPy"):
        Linear(4, 3)(None)
    with amp.autocast("bf16"), pytest.raises(InputError, match=r"x=None\) needs x_bits.*amp .bf16., x_bits \(2, 4\) uint16"):
        Linear(4, 3).forward(None, x_bits=np.zeros((2, 4), np.uint16))   # numpy: no such path


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_interaction_hands_the_top_mlp_its_output_as_16_bit_patterns_alone(
        launch, monkeypatch, precision, packed):
    """DLRM's interaction -> top MLP on the CuPy fp16 / bf16 glue: the interaction writes its
    output only as the 16-bit patterns the top MLP's first product reads (``fp32_output=False``,
    ``MLP.forward(None, x_bits)``), against the path that writes it in fp32 and casts it for each
    of that layer's products: logits, the interaction's input gradients and every parameter
    gradient bit for bit, and nothing returned in fp32 where the patterns stand alone."""
    from one_embedding.kernels import layout_ops
    from one_embedding.nn import MLP, DotInteraction, interaction, linear

    device = _DeviceNumpy()
    monkeypatch.setattr(dense_ops, "resolve", lambda _: launch)
    monkeypatch.setattr(linear, "array_namespace", lambda *arrays: device)
    monkeypatch.setattr(interaction, "array_namespace", lambda *arrays: device)
    rng = np.random.default_rng(31)
    batch, tables, dim = 40, 5, 8
    bottom = (rng.standard_normal((batch, dim)) * 0.5).astype(np.float32)
    emb = (rng.standard_normal((batch, tables, dim)) * 0.5).astype(np.float32)
    labels = (rng.random(batch) < 0.3).astype(np.float32)
    width = dim + tables * (tables + 1) // 2 + 1
    results, returned = {}, {}
    for as_bits in (True, False):
        monkeypatch.setattr(linear, "HIDDEN_OUTPUTS_AS_BITS", as_bits)
        inter = DotInteraction(output_padding=1)
        top = MLP(width, [24, 16, 1], last_relu=False, seed=2)
        with amp.autocast(precision):
            fp32_output = not top.takes_input_bits()
            if packed:
                # the buffer DLRM's gather fills: z at slot 0, the rows after, 16-bit patterns
                target = layout_ops.InteractionInput(layout_ops.encode(
                    np.concatenate([bottom[:, None], emb], axis=1), precision), precision, 1)
                out = inter.forward_packed(target, bottom, fp32_output=fp32_output)
            else:
                out = inter.forward([bottom, emb], bottom, fp32_output=fp32_output)
            returned[as_bits] = out is not None
            logits = top.forward(out, inter.out_bits).reshape(-1)
            dinter = top.loss_and_backward(logits, labels, 1.0)[2]
            (d_bottom, d_emb), d_concat = inter.backward(dinter)
        results[as_bits] = [logits, dinter, d_bottom, d_emb, d_concat] + \
            [p.grad for p in top.parameters()]
    for i, (got, want) in enumerate(zip(results[True], results[False], strict=True)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(want).view(np.uint32), err_msg=str(i))
    assert returned == {True: False, False: True}
