"""Rows gathered straight into the dot interaction's input (issue 32 item 3): the gather kernel
``embedding_gather_into`` and the interaction kernels that read the buffer (``dense.cu``'s packed
layouts), on the host emulator (default mode and stress seeds), against the path they replace:
``gather_rows`` + concatenation + the cast to the AMP type, bit for bit; then DLRM's device path
with the fused gather on and off, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import dense_ops, device_ops, layout_ops
from one_embedding.nn import amp

PRECISIONS = ["off", "tf32", "fp16", "bf16"]


@pytest.fixture
def amp_launch(amp_lib, emulation_seed):
    from cuda_emulation import EmulatedLauncher

    return EmulatedLauncher(amp_lib, cm.AMP_FAMILIES, seed=emulation_seed)


def _cast_as_today(values, precision):
    """What today's interaction multiplies: the float32 values rounded to the precision (off and
    tf32 keep float32 in the buffer; the tf32 rounding happens in the interaction's kernel)."""
    return amp.round_to(values, precision) if precision in amp.HALF_PRECISIONS else values


def _rows(rng, n, dim):
    rows = (rng.standard_normal((n, dim)) * np.exp2(rng.integers(-30, 18, (n, dim)))
            ).astype(np.float32)
    rows[0, :6] = [65504, 65520, 2.0 ** -25, 2.0 ** -24 * 1.5, np.inf, -3e38]   # fp16's edges
    rows[1, :3] = [np.nan, -0.0, 1.0 + 2.0 ** -8]                            # a bf16 tie
    return rows


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gather_into_equals_gather_then_concat_then_cast(launch, precision):
    rng = np.random.default_rng(3)
    batch, n_features, dim, n_rows = 7, 5, 33, 20
    rows = _rows(rng, n_rows, dim)
    z = rng.standard_normal((batch, dim)).astype(np.float32)
    index = rng.integers(0, n_rows, (batch, n_features)).astype(np.int64)
    index[2, 1] = index[5, 4] = -1                                      # padding: zero rows
    # today: the gather kernel, the concatenation with z, then the interaction's cast
    gathered = device_ops.gather_rows(rows, index, launch, check_index=False)
    stacked = np.concatenate([z[:, None], gathered], axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = _cast_as_today(stacked, precision)
    # fused: one gather straight into the buffer, z into slot 0 by its own launch
    target = layout_ops.empty_input(launch.xp, batch, n_features + 1, dim, precision, 1, launch)
    layout_ops.gather_into(rows, index, target, 1, launch)
    layout_ops.write_slot(z, target, 0, launch)
    assert target.data.dtype == layout_ops.storage_dtype(precision)
    assert target.data.dtype == (np.uint16 if precision in amp.HALF_PRECISIONS else np.float32)
    got = target.values()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # bits, NaN too
    # the numpy twin writes the same bits
    twin = layout_ops.empty_input(np, batch, n_features + 1, dim, precision, 1)
    layout_ops.gather_into(rows, index, twin, 1)
    layout_ops.write_slot(z, twin, 0)
    np.testing.assert_array_equal(twin.data, target.data)


@pytest.mark.stress_seeds
def test_gather_into_writes_only_its_slots(launch):
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((9, 8)).astype(np.float32)
    index = rng.integers(0, 9, (4, 3)).astype(np.int64)
    target = layout_ops.InteractionInput(np.full((4, 6, 8), 7.0, np.float32), "off", 2, launch)
    layout_ops.gather_into(rows, index, target, 2, launch)
    np.testing.assert_array_equal(target.data[:, :2], 7.0)
    np.testing.assert_array_equal(target.data[:, 5:], 7.0)
    np.testing.assert_array_equal(target.data[:, 2:5], rows[index])


def test_gather_into_refuses_a_target_it_does_not_fit(launch):
    rows = np.zeros((4, 8), np.float32)
    index = np.zeros((2, 3), np.int64)
    small = layout_ops.empty_input(np, 2, 3, 8, "off", 1, launch)
    with pytest.raises(InputError, match="do not fit"):
        layout_ops.gather_into(rows, index, small, 1, launch)
    wrong = layout_ops.InteractionInput(np.zeros((2, 4, 8), np.float32), "bf16", 1, launch)
    with pytest.raises(InputError, match="uint16"):
        layout_ops.gather_into(rows, index, wrong, 1, launch)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_interaction_on_the_buffer_equals_the_split_interaction(amp_launch, precision, tile):
    """dense.cu's interaction reading the packed buffer (float32, or fp16 / bf16 patterns) gives
    the bits of today's call on the two parts [z, embeddings], forward and backward."""
    rng = np.random.default_rng(5)
    batch, n_features, dim = 6, 5, 16
    z = rng.standard_normal((batch, 1, dim)).astype(np.float32)
    emb = rng.standard_normal((batch, n_features, dim)).astype(np.float32)
    concat = np.ascontiguousarray(z[:, 0])
    want = dense_ops.interaction_forward(z, emb, concat, False, 1, precision, launch=amp_launch,
                                         tile=tile)
    packed = layout_ops.encode(np.concatenate([z, emb], axis=1), precision)
    got = dense_ops.interaction_forward_packed(packed, 1, concat, False, 1, precision,
                                               launch=amp_launch, tile=tile)
    np.testing.assert_array_equal(got, want)
    dout = rng.standard_normal(want.shape).astype(np.float32)
    want_grads = dense_ops.interaction_backward(dout, z, emb, dim, False, precision,
                                                launch=amp_launch, tile=tile)
    got_grads = dense_ops.interaction_backward_packed(dout, packed, 1, dim, False, precision,
                                                      launch=amp_launch, tile=tile)
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


def test_packed_interaction_refuses_bits_without_a_half_precision(amp_launch):
    bits = np.zeros((2, 3, 4), np.uint16)
    with pytest.raises(InputError, match="16-bit features"):
        dense_ops.interaction_forward_packed(bits, 1, None, False, 0, "tf32", launch=amp_launch)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_layer_on_the_buffer_equals_the_layer_on_parts(amp_launch, monkeypatch, precision):
    """DotInteraction.forward_packed against forward([z, emb], z): on numpy (the CPU reference
    and the dry run's model) the same bits; its CuPy AMP branch, run on the emulator, equals the
    layer's CuPy path on the two parts bit for bit."""
    from one_embedding.nn import DotInteraction

    monkeypatch.setattr(dense_ops, "resolve", lambda _: amp_launch)
    rng = np.random.default_rng(6)
    z = rng.standard_normal((5, 8)).astype(np.float32)
    emb = rng.standard_normal((5, 4, 8)).astype(np.float32)
    dout = rng.standard_normal((5, 8 + 10 + 2)).astype(np.float32)
    target = layout_ops.empty_input(np, 5, 5, 8, precision, 1)
    layout_ops.gather_into(emb.reshape(-1, 8), np.arange(20).reshape(5, 4), target, 1)
    layout_ops.write_slot(z, target, 0)
    with amp.autocast(precision):
        parts_layer, packed_layer = DotInteraction(output_padding=2), DotInteraction(output_padding=2)
        want = parts_layer.forward([z, emb], z)
        got = packed_layer.forward_packed(target, z)
        np.testing.assert_array_equal(got, want)
        (want_dz, want_de), want_dc = parts_layer.backward(dout)
        (got_dz, got_de), got_dc = packed_layer.backward(dout)
        for g, w in [(got_dz, want_dz), (got_de, want_de), (got_dc, want_dc)]:
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w)
    if precision == "off":
        return              # CuPy fp32 takes forward's own (batched GEMM) path on the buffer
    with pytest.raises(InputError, match="cast for amp"):
        DotInteraction().forward_packed(target, z)        # cast for precision, run under off
    with amp.autocast(precision):
        split = [(1, True), (4, False)]
        fused_parts, fused_packed = DotInteraction(output_padding=2), DotInteraction(output_padding=2)
        want = fused_parts._forward_fused([z, emb], z)
        got = fused_packed._forward_packed_fused(target, z, split)
        np.testing.assert_array_equal(got, want)
        (want_dz, want_de), _ = fused_parts.backward(dout)
        (got_dz, got_de), _ = fused_packed.backward(dout)
        np.testing.assert_array_equal(got_dz, want_dz)
        np.testing.assert_array_equal(got_de, want_de)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("precision", ["off", "bf16", "fp16"])
def test_dlrm_device_step_with_the_fused_gather_equals_the_plain_one(tmp_path, launch, precision,
                                                                      padding):
    """A DLRM on a device embedding (the emulator) trained for three steps with the rows gathered
    into the interaction's input and with the plain gather: the same logits, embedding gradient
    and rows, bit for bit; the fused kernel ran and the (B, F, E) gather did not (either kernel
    in its scalar or its 16-byte variant)."""
    import one_embedding as oe
    from one_embedding.models import DLRM
    from one_embedding.nn import BCEWithLogits

    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((16, 3)).astype(np.float32),
                rng.integers(0, 30, (16, 4)).astype(np.int64),
                rng.integers(0, 2, 16).astype(np.float32)) for _ in range(3)]
    if padding:
        for _, ids, _ in batches:
            ids[::5, 1] = 0

    def run(fused, sub):
        emb = oe.MultiTableEmbedding("t", 8, np.float32, np.int64, None,
                                     oe.make_device_mem_store_options(str(tmp_path / sub), 1000),
                                     padding_idx=0 if padding else None, device=launch)
        model = DLRM(num_tables=4, embedding_dim=8, dense_features=3, bottom_mlp=(8,),
                     top_mlp=(8, 1), embedding=emb, seed=1)
        model.gather_into_interaction = fused
        opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb],
                           parameters=list(model.parameters()))
        loss_fn, seen = BCEWithLogits(), []
        launch.launched.clear()
        for dense, ids, labels in batches:
            with amp.autocast(precision):
                embedded = model.embed(emb.prepare(ids, background=False), precision)
                assert isinstance(embedded, layout_ops.InteractionInput) == fused
                logits = model.forward_from_embeddings(dense, embedded)
                loss_fn(logits, labels)
                _, dembedded = model.backward_to_embeddings(loss_fn.backward())
            emb.backward(dembedded)
            opt.step()
            opt.zero_grad()
            seen.append((logits.copy(), np.array(dembedded)))
        kernels = set(launch.launched)
        keys, lines = emb.export()
        emb.close()
        return seen, keys, lines, kernels

    plain, fused = run(False, "plain"), run(True, "fused")
    for (lp, gp), (lf, gf) in zip(plain[0], fused[0]):
        np.testing.assert_array_equal(lf, lp)
        np.testing.assert_array_equal(gf, gp)
    np.testing.assert_array_equal(fused[1], plain[1])
    np.testing.assert_array_equal(fused[2], plain[2])
    # each gather at 4 or 16 bytes per thread, as the lines' layout allows (issue 32 item 3)
    gather, into = {"embedding_gather", "embedding_gather_vector"}, \
        {"embedding_gather_into", "embedding_gather_into_vector"}
    assert into & fused[3] and not gather & fused[3], fused[3]
    assert gather & plain[3] and not into & plain[3], plain[3]


@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_embed_into_holds_what_embed_returns(tmp_path, launch, precision):
    """embed_into's slots hold embed's rows cast to the buffer's storage, padding (a zero row)
    included, also for a batch of padding only; on the device and the CPU path."""
    import one_embedding as oe

    ids = np.array([[3, 0, 5], [0, 0, 0], [7, 3, 0]], np.int64)
    for device in (launch, "cpu"):
        emb = oe.MultiTableEmbedding("t", 8, np.float32, np.int64, None,
                                     oe.make_device_mem_store_options(str(tmp_path / str(device)),
                                                                      100),
                                     padding_idx=0, device=device)
        for batch in (ids, np.zeros((2, 3), np.int64)):
            want = emb.embed(emb.prepare(batch, background=False))
            xp = np if device == "cpu" else launch.xp
            target = layout_ops.empty_input(xp, batch.shape[0], 4, 8, precision, 1)
            emb.embed_into(emb.prepare(batch, background=False), target, 1)
            want = amp.round_to(want, precision) if precision == "bf16" else want
            np.testing.assert_array_equal(target.values()[:, 1:], want)
            np.testing.assert_array_equal(target.values()[:, 1:][batch == 0], 0.0)
        emb.close()
