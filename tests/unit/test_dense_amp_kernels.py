"""The AMP path's fused dense kernels (kernels/cuda/dense.cu through kernels/dense_ops.py and
kernels/gemm.py) on the host emulator, default mode and stress seeds, against their float64
references: the cast against nn.amp.round_to and numpy's float16 bit for bit, bias + activation
+ cast, the one-kernel dot interaction both ways, and the loss fused with the last layer's
gradient, in fp32 and under each AMP precision."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import dense_ops, gemm
from one_embedding.nn import amp

PRECISIONS = ["off", "tf32", "fp16", "bf16"]
#: the relative spacing of each precision's values: a result rounded once, from a sum the
#: reference takes exactly, is within one unit of it
UNIT = {"off": 1e-5, "tf32": 2.0 ** -10, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


@pytest.fixture
def launch(amp_lib, emulation_seed):
    from cuda_emulation import EmulatedLauncher

    return EmulatedLauncher(amp_lib, cm.AMP_FAMILIES, seed=emulation_seed)


def _bits(x, precision):
    if precision == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return (amp.round_to(x, "bf16").view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
def test_cast_is_round_to_bit_for_bit(launch, precision):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3000) * np.exp2(rng.integers(-30, 20, 3000))).astype(np.float32)
    x[:8] = [65504, 65520, -1e6, 2.0 ** -25, 2.0 ** -24 * 1.5, np.inf, -np.inf, 3e38]
    bits, rounded = gemm.cast(x, precision, bits=True, rounded=True, launch=launch)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(rounded, amp.round_to(x, precision))
        if precision == "tf32":
            assert bits is None
        else:
            np.testing.assert_array_equal(bits, _bits(x, precision))
    nan_bits, nan_rounded = gemm.cast(np.full(5, np.nan, np.float32), precision, rounded=True,
                                      launch=launch)
    assert np.isnan(nan_rounded).all()


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["off", "fp16", "bf16"])
def test_bias_act_cast_is_one_pass_of_the_reference(launch, precision):
    from one_embedding.kernels import reference

    rng = np.random.default_rng(1)
    # 300 x 70: more mask words than four per warp of the grid (the words whose loads a warp
    # issues ahead, common.cuh's FORWARD_AHEAD), and a rest taken one word at a time
    for rows, cols, relu in [(1, 1, True), (37, 45, True), (129, 70, False), (300, 70, True)]:
        h = rng.standard_normal((rows, cols)).astype(np.float32)
        b = rng.standard_normal(cols).astype(np.float32)
        y_ref, mask_ref = reference.bias_act_forward(h.copy(), b, relu)
        y, mask, bits = dense_ops.bias_act_cast_forward(h.copy(), b, relu, precision, launch=launch)
        np.testing.assert_array_equal(y, y_ref)
        if relu:
            np.testing.assert_array_equal(mask, cm.pack_mask(mask_ref))
        else:
            assert mask is None
        if precision == "off":
            assert bits is None
            with pytest.raises(InputError, match="write_y=False.*fp16 / bf16"):
                dense_ops.bias_act_cast_forward(h.copy(), b, relu, precision, launch=launch,
                                                write_y=False)
            continue
        np.testing.assert_array_equal(bits, _bits(y_ref, precision))
        # y as its 16-bit copy alone: the same mask and bits, h left as the GEMM wrote it
        kept = h.copy()
        none, mask_only, bits_only = dense_ops.bias_act_cast_forward(
            kept, b, relu, precision, launch=launch, write_y=False)
        assert none is None
        np.testing.assert_array_equal(kept, h)
        np.testing.assert_array_equal(bits_only, bits)
        if relu:
            np.testing.assert_array_equal(mask_only, mask)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_bias_act_backward_cast_writes_the_pattern_of_dy_times_the_mask(launch, precision):
    """Linear's backward under fp16 / bf16 in one pass: dh = dy * mask only as its 16-bit
    pattern (the cast of numpy's dy * mask, bit for bit: NaN and inf pass as the multiply gives
    them) and db its column sums, with and without a ReLU mask; bad input refused."""
    from one_embedding.errors import InputError
    from one_embedding.kernels import reference

    rng = np.random.default_rng(7)
    for rows, cols, relu in [(1, 1, True), (300, 45, True), (129, 70, False), (64, 33, True)]:
        h = rng.standard_normal((rows, cols)).astype(np.float32)
        _, mask_ref = reference.bias_act_forward(h.copy(), np.zeros(cols, np.float32), relu)
        mask = cm.pack_mask(mask_ref) if relu else None
        dy = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-20, 8, (rows, cols))))
        dy = dy.astype(np.float32)
        dy.reshape(-1)[:3] = [np.nan, np.inf, -np.inf][:dy.size]
        bits, db = dense_ops.bias_act_backward_cast(dy, mask, precision, launch=launch)
        with np.errstate(invalid="ignore"):
            dh = dy * mask_ref if relu else dy
        np.testing.assert_array_equal(bits, _bits(dh, precision))
        finite = np.isfinite(dh).all(axis=0)
        _close(db[finite], dh[:, finite].astype(np.float64).sum(axis=0), "off", atol=1e-6 * rows)
        assert not np.isfinite(db[~finite]).any()          # a NaN or inf reaches its column's sum
    with pytest.raises(InputError, match="fp16 / bf16"):
        dense_ops.bias_act_backward_cast(dy, None, "tf32", launch=launch)
    with pytest.raises(InputError, match="mask has shape"):
        dense_ops.bias_act_backward_cast(dy, np.zeros(2, np.uint32), precision, launch=launch)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_bias_act_backward_cast_rounds_an_unrounded_input_as_it_reads_it(launch, precision):
    """round_input: dy the layer above left unrounded gives the bits and the bias gradient of
    the same pass over dy rounded first (the pass the layer above skipped)."""
    from one_embedding.kernels import reference

    rng = np.random.default_rng(8)
    rows, cols = 200, 37
    _, mask_ref = reference.bias_act_forward(rng.standard_normal((rows, cols)).astype(np.float32),
                                             np.zeros(cols, np.float32), True)
    mask = cm.pack_mask(mask_ref)
    dy = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-20, 8, (rows, cols))))
    dy = dy.astype(np.float32)
    dy.reshape(-1)[:2] = [np.inf, 65519.0]             # 65519 rounds to inf under fp16
    for m in (mask, None):
        got = dense_ops.bias_act_backward_cast(dy, m, precision, launch=launch, round_input=True)
        want = dense_ops.bias_act_backward_cast(amp.round_to(dy, precision), m, precision,
                                                launch=launch)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
        unrounded = dense_ops.bias_act_backward_cast(dy, m, precision, launch=launch)
        assert not np.array_equal(unrounded[1], want[1])   # the sums see the rounding


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_bias_act_kernels_load_ahead_with_the_same_bits(launch, monkeypatch, precision):
    """The bias + ReLU (+ cast) kernels with their loads ahead of their stores
    (``cuda_module.LOADS_AHEAD``, common.cuh's FORWARD_AHEAD / BACKWARD_AHEAD) and one element at
    a time: the same y, mask, 16-bit copy, dh patterns and bias-gradient partial sums, over
    sizes with batches of words / rows ahead and a rest (NaN, inf and -0.0 among the values)."""
    rng = np.random.default_rng(11)
    for rows, cols in [(300, 70), (5, 3)]:
        h = rng.standard_normal((rows, cols)).astype(np.float32)
        h.reshape(-1)[:4] = [np.nan, np.inf, -0.0, -np.inf][:h.size]
        b = rng.standard_normal(cols).astype(np.float32)
        dy = rng.standard_normal((rows, cols)).astype(np.float32)
        dy.reshape(-1)[-3:] = [np.nan, -0.0, np.inf]
        results = []
        for ahead in (True, False):
            monkeypatch.setattr(cm, "LOADS_AHEAD", ahead)
            y, mask, bits = dense_ops.bias_act_cast_forward(h.copy(), b, True, precision,
                                                            launch=launch)
            out = [y.view(np.uint32), mask] + ([bits] if bits is not None else [])
            if precision == "bf16":
                dh_bits, db = dense_ops.bias_act_backward_cast(dy, mask, precision, launch=launch)
                out += [dh_bits, db.view(np.uint32)]
            results.append(out)
        for got, want in zip(*results):
            np.testing.assert_array_equal(got, want)


def _close(got, want, precision, atol):
    want = np.asarray(want, np.float64)
    assert np.all(np.abs(got - want) <= UNIT[precision] * np.abs(want) + atol), \
        np.abs(got - want).max()


CASES = [  # (batch, F1, F2, D, self_interaction, with_concat, pad)
    (5, 1, 26, 16, False, True, 1),       # DLRM's layout: bottom output + 26 embeddings
    (3, 2, 3, 7, True, True, 3),
    (4, 1, 1, 5, False, False, 0),
    (2, 3, 2, 33, True, False, 2),
]


@pytest.mark.stress_seeds
@pytest.mark.parametrize("tile", ["blocked", True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES)
def test_interaction_forward_and_backward_match_float64(launch, monkeypatch, precision, case,
                                                         tile):
    """tile "blocked": the one-block-per-sample kernels with the register-blocked backward where
    the sample fits it (dim a multiple of 4: the first and last cases), True: the same without
    it (the _tile backward), False: one thread per output."""
    monkeypatch.setattr(dense_ops, "BLOCKED_INTERACTION", tile == "blocked")
    tile = bool(tile)
    batch, f1, f2, dim, self_interaction, with_concat, pad = case
    rng = np.random.default_rng(batch * 100 + dim)
    first = rng.standard_normal((batch, f1, dim)).astype(np.float32)
    rest = rng.standard_normal((batch, f2, dim)).astype(np.float32)
    concat = rng.standard_normal((batch, dim)).astype(np.float32) if with_concat else None
    out = dense_ops.interaction_forward(first, rest, concat, self_interaction, pad, precision,
                                        launch=launch, tile=tile)
    want = dense_ops.interaction_forward_reference(first, rest, concat, self_interaction, pad,
                                                   precision)
    assert out.shape == want.shape and out.dtype == np.float32
    n_concat = dim if with_concat else 0
    if with_concat:
        np.testing.assert_array_equal(out[:, :n_concat], concat)   # passes through unrounded
    np.testing.assert_array_equal(out[:, want.shape[1] - pad:], 0.0)
    _close(out, want, precision, atol=1e-5 * dim)
    if precision in amp.HALF_PRECISIONS:
        np.testing.assert_array_equal(amp.round_to(out[:, n_concat:], precision), out[:, n_concat:])

    dout = rng.standard_normal(out.shape).astype(np.float32)
    dfirst, drest, dconcat = dense_ops.interaction_backward(dout, first, rest, n_concat,
                                                            self_interaction, precision,
                                                            launch=launch, tile=tile)
    wf, wr, wc = dense_ops.interaction_backward_reference(dout, first, rest, n_concat,
                                                          self_interaction, precision)
    atol = 1e-5 * (f1 + f2) * 4
    _close(dfirst, wf, precision, atol)
    _close(drest, wr, precision, atol)
    if with_concat:
        np.testing.assert_array_equal(dconcat, dout[:, :n_concat])
    else:
        assert dconcat is None


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_two_interaction_kernels_agree_bit_for_bit(launch, precision):
    """One block per sample (shared memory) and one thread per output: the same sums in the same
    order, so the same bits; and the tile kernel's fit rule matches the capacity dense.cu's kernels declare."""
    import re

    rng = np.random.default_rng(5)
    first = rng.standard_normal((9, 1, 128)).astype(np.float32)   # DLRM: 27 features of 128
    rest = rng.standard_normal((9, 26, 128)).astype(np.float32)
    concat = np.ascontiguousarray(first[:, 0])
    outs = [dense_ops.interaction_forward(first, rest, concat, False, 1, precision, launch=launch,
                                          tile=tile) for tile in (True, False)]
    np.testing.assert_array_equal(outs[0], outs[1])
    dout = rng.standard_normal(outs[0].shape).astype(np.float32)
    grads = [dense_ops.interaction_backward(dout, first, rest, 128, False, precision,
                                            launch=launch, tile=tile) for tile in (True, False)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
    source = cm.source_path("dense").read_text()
    helpers = (cm.CUDA_DIR / "dense_interaction.cuh").read_text()
    assert int(re.search(r"BLOCK_ROWS = (\d+);", source)[1]) == dense_ops.BLOCK_ROWS
    assert int(re.search(r"TILE_ELEMENTS = (\d+);", helpers)[1]) == dense_ops.TILE_ELEMENTS
    assert int(re.search(r"TILE_PAIRS = (\d+);", helpers)[1]) == dense_ops.TILE_PAIRS
    assert dense_ops.fits_tile(27, 128, False) and not dense_ops.fits_tile(27, 256, False)
    assert not dense_ops.fits_tile(46, 64, True)          # 1081 pairs


BLOCKED_CASES = [  # (batch, F1, F2, D, self_interaction): DLRM's, and rows / groups that do not
    # fill a block: a last group of rows past F, a warp over several groups, D = one vector
    (3, 1, 26, 128, False), (4, 2, 3, 16, True), (5, 1, 4, 4, False), (2, 3, 6, 12, True),
]


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", BLOCKED_CASES)
def test_the_blocked_kernels_are_the_tile_kernels_bit_for_bit(launch, monkeypatch, precision,
                                                               case):
    """The forward's 16-byte-vector kernel adds each dot's products in the _tile kernel's order
    (d ascending), the register-blocked backward each input gradient's (other features
    ascending, the diagonal skipped without self-interaction): the same bits, NaN, infinities
    and signed zeros included; and the one-thread-per-output kernels'."""
    batch, f1, f2, dim, self_interaction = case
    assert dense_ops.fits_blocked(f1 + f2, dim)
    rng = np.random.default_rng(dim + f2)
    first = rng.standard_normal((batch, f1, dim)).astype(np.float32)
    rest = rng.standard_normal((batch, f2, dim)).astype(np.float32)
    n_pairs = dense_ops._n_pairs(f1 + f2, self_interaction)
    dout = rng.standard_normal((batch, dim + n_pairs + 3)).astype(np.float32)
    rest[0, 0, :3] = [np.inf, -0.0, np.nan]
    first[-1, 0, 1] = -np.inf
    dout[1, dim:dim + 4] = [0.0, -0.0, 1e30, np.nan]
    dout[-1, dim + n_pairs - 1] = 0.0                    # a zero gradient times inf: NaN
    concat = np.ascontiguousarray(first[:, 0])
    results = {}
    for name, blocked, tile in [("blocked", True, True), ("tile", False, True),
                                ("thread", False, False)]:
        monkeypatch.setattr(dense_ops, "BLOCKED_INTERACTION", blocked)
        out = dense_ops.interaction_forward(first, rest, concat, self_interaction, 3, precision,
                                            launch=launch, tile=tile)
        results[name] = (out, *dense_ops.interaction_backward(
            dout, first, rest, dim, self_interaction, precision, launch=launch, tile=tile))
    for name in ("tile", "thread"):
        for got, want in zip(results["blocked"], results[name]):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                          err_msg=f"blocked against {name}")
    out, _, drest, _ = results["blocked"]
    assert np.isnan(out).any() and np.isnan(drest).any() and np.isfinite(drest).any()


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_interaction_output_as_16_bit_patterns_alone_is_the_cast_of_the_float_output(
        launch, monkeypatch, precision):
    """``bits_only``: each forward kernel (vector, tile, one thread per output; split and packed
    inputs) writes the output row only as the 16-bit patterns ``gemm.cast`` gives of the float
    output, bit for bit (concat columns, NaN and infinities included); fp32 / tf32 refuse it."""

    rng = np.random.default_rng(8)
    first = rng.standard_normal((5, 1, 16)).astype(np.float32)
    rest = rng.standard_normal((5, 6, 16)).astype(np.float32)
    rest[0, 0, :2] = [np.inf, np.nan]
    concat = np.ascontiguousarray(first[:, 0] * 1e3)        # rounded by the patterns
    for blocked, tile in [(True, True), (False, True), (False, False)]:
        monkeypatch.setattr(dense_ops, "BLOCKED_INTERACTION", blocked)
        out = dense_ops.interaction_forward(first, rest, concat, False, 3, precision,
                                            launch=launch, tile=tile)
        bits = dense_ops.interaction_forward(first, rest, concat, False, 3, precision,
                                             launch=launch, tile=tile, bits_only=True)
        assert bits.dtype == np.uint16 and bits.shape == out.shape
        np.testing.assert_array_equal(bits, gemm.cast(out, precision, launch=launch)[0],
                                      err_msg=f"blocked={blocked} tile={tile}")
        packed = np.ascontiguousarray(np.concatenate([first, rest], axis=1))
        packed_bits = dense_ops.interaction_forward_packed(packed, 1, concat, False, 3, precision,
                                                           launch=launch, tile=tile,
                                                           bits_only=True)
        np.testing.assert_array_equal(packed_bits, bits)
    for precision in ("off", "tf32"):
        with pytest.raises(InputError, match="bits_only=True.*fp16 or bf16"):
            dense_ops.interaction_forward(first, rest, concat, False, 3, precision,
                                          launch=launch, bits_only=True)


def test_the_blocked_kernels_take_the_samples_they_fit():
    """A 16-byte vector of columns (4 float32, 2 float64), the features (rows of dim + one
    vector) and the pair gradients (rows rounded up to BLOCK_ROWS) in the tile kernels' shared
    memory; else the _tile kernels."""
    assert dense_ops.fits_blocked(27, 128) and dense_ops.fits_blocked(27, 128, np.float64)
    assert not dense_ops.fits_blocked(27, 130)                       # not a vector multiple
    assert dense_ops.fits_blocked(27, 130, np.float64)               # 2 doubles a vector
    assert not dense_ops.fits_blocked(27, 164)                       # 4428 > 4352 elements
    assert dense_ops.fits_blocked(32, 128) and not dense_ops.fits_blocked(33, 64)  # 33 x 36 pairs


def test_interaction_forward_in_fp32_equals_the_existing_reference(launch):
    """kind 0 is the model's fp32 interaction: the reference kernel's output, list of parts."""
    from one_embedding.kernels import reference

    rng = np.random.default_rng(7)
    first = rng.standard_normal((6, 1, 8)).astype(np.float32)
    rest = rng.standard_normal((6, 4, 8)).astype(np.float32)
    want = reference.dot_interaction_forward(np.concatenate([first, rest], 1), first[:, 0], False, 2)
    got = dense_ops.interaction_forward(first, rest, np.ascontiguousarray(first[:, 0]), False, 2,
                                        "off", launch=launch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("rows, k_cols", [(1, 1), (37, 45), (700, 33)])
def test_loss_fused_with_the_last_layer_matches_float64(launch, precision, rows, k_cols):
    rng = np.random.default_rng(rows + k_cols)
    x = rng.standard_normal((rows, k_cols)).astype(np.float32)
    w = rng.standard_normal(k_cols).astype(np.float32)
    logits = (rng.standard_normal(rows) * 4).astype(np.float32)
    labels = (rng.random(rows) < 0.3).astype(np.float32)
    scale = 1.0 if precision != "fp16" else 2.0 ** 16
    loss, dz, dx, dw, db = dense_ops.bce_last_layer(logits, labels, x, w, scale, precision,
                                                    launch=launch)
    w_loss, w_dz, w_dx, w_dw, w_db = dense_ops.bce_last_layer_reference(logits, labels, x, w,
                                                                        scale, precision)
    assert abs(float(loss) - w_loss) <= 1e-6 * w_loss + 1e-7
    np.testing.assert_allclose(dz, w_dz, rtol=1e-5, atol=1e-7 * scale)
    _close(dx, w_dx, precision, atol=1e-7 * scale)
    if precision in amp.HALF_PRECISIONS:  # the input gradient leaves half-typed, as dh w does
        np.testing.assert_array_equal(amp.round_to(dx, precision), dx)
    # fp32 sums over rows of rounded products: within fp32's rounding of the sum's terms
    bound = 1e-5 * (np.abs(dense_ops._r(dz, precision)) @ np.abs(dense_ops._r(x, precision))) + 1e-9
    assert np.all(np.abs(dw - w_dw) <= bound)
    assert abs(float(db) - w_db) <= 1e-5 * np.abs(w_dz).sum() + 1e-9


def test_loss_fused_with_the_last_layer_is_the_layers_own_backward(launch):
    """Against the unfused path: BCEWithLogits' gradient into Linear(K, 1).backward."""
    from one_embedding.nn import BCEWithLogits, Linear

    rng = np.random.default_rng(9)
    layer = Linear(24, 1, seed=2)
    x = rng.standard_normal((64, 24)).astype(np.float32)
    labels = (rng.random(64) < 0.5).astype(np.float32)
    logits = layer(x).reshape(-1)
    loss_fn = BCEWithLogits()
    want_loss = float(loss_fn(logits, labels))
    want_dx = layer.backward(loss_fn.backward().reshape(-1, 1))
    loss, dz, dx, dw, db = dense_ops.bce_last_layer(logits, labels, x, layer.weight.data[0], 1.0,
                                                    "off", launch=launch)
    assert abs(float(loss) - want_loss) < 1e-6
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dw, layer.weight.grad[0], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(db, layer.bias.grad[0], rtol=1e-4, atol=1e-7)


def test_bad_inputs_name_the_value(launch):
    from one_embedding.errors import ConfigError, InputError

    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(InputError, match="rest has shape"):
        dense_ops.interaction_forward(x, np.zeros((2, 3, 5), np.float32), None, False, 0, "off",
                                      launch=launch)
    with pytest.raises(ConfigError, match="amp='fp8'"):
        dense_ops.interaction_forward(x, x, None, False, 0, "fp8", launch=launch)
    big = np.zeros((1, 40, 128), np.float32)
    with pytest.raises(InputError, match="tile=True.*does not fit"):
        dense_ops.interaction_forward(big, big, None, False, 0, "off", launch=launch, tile=True)
    with pytest.raises(InputError, match="empty batch"):
        z = np.zeros(0, np.float32)
        dense_ops.bce_last_layer(z, z, np.zeros((0, 3), np.float32), np.zeros(3, np.float32), 1.0,
                                 "off", launch=launch)


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["dlrm", "one_array", "three_parts"])
def test_interaction_layer_fused_path_equals_its_numpy_path(launch, monkeypatch, precision, layout):
    """DotInteraction's CuPy AMP path (one kernel each way) run on the emulator: the layer's glue
    (parts read in place, concat, padding, gradients handed back per part) against the numpy
    path's rounding passes, under each precision."""
    from one_embedding.nn import DotInteraction

    monkeypatch.setattr(dense_ops, "resolve", lambda _: launch)
    rng = np.random.default_rng(11)
    bottom = rng.standard_normal((6, 8)).astype(np.float32)
    emb = rng.standard_normal((6, 5, 8)).astype(np.float32)
    if layout == "dlrm":
        features, concat = [bottom, emb], bottom
    elif layout == "one_array":
        features, concat = np.concatenate([bottom[:, None], emb], 1), None
    else:
        features, concat = [bottom, emb[:, :2], emb[:, 2:]], bottom
    numpy_layer = DotInteraction(output_padding=3)
    fused_layer = DotInteraction(output_padding=3)
    with amp.autocast(precision):
        want = numpy_layer(features, concat)
        got = fused_layer._forward_fused(features, concat)
        dout = rng.standard_normal(want.shape).astype(np.float32)
        want_grads, want_dc = numpy_layer.backward(dout)
        got_grads, got_dc = fused_layer.backward(dout)
    _close(got, want, precision, atol=1e-5)
    if isinstance(want_grads, list):
        assert [g.shape for g in got_grads] == [g.shape for g in want_grads]
        for g, w in zip(got_grads, want_grads):
            _close(g, w, precision, atol=1e-5)
    else:
        assert got_grads.shape == want_grads.shape
        _close(got_grads, want_grads, precision, atol=1e-5)
    if concat is None:
        assert got_dc is None and want_dc is None
    else:
        np.testing.assert_array_equal(got_dc, want_dc)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
def test_last_layer_backward_in_one_pass_equals_linear_backward(launch, monkeypatch, precision):
    """Linear(K, 1)'s CuPy AMP backward (one kernel: dx = dz ⊗ w, dw, db) run on the emulator
    through the layer's own glue, against the numpy layer's three products and reduction."""
    from one_embedding.nn import Linear

    monkeypatch.setattr(dense_ops, "resolve", lambda _: launch)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((300, 40)).astype(np.float32)
    dy = (rng.standard_normal((300, 1)) * 64).astype(np.float32)       # a scaled logit gradient
    numpy_layer, fused_layer = Linear(40, 1, seed=3), Linear(40, 1, seed=3)
    with amp.autocast(precision):
        numpy_layer(x)
        fused_layer(x)
        want_dx = numpy_layer.backward(dy)
        got_dx = fused_layer._backward_last_fused(dy)
    assert got_dx.shape == want_dx.shape == (300, 40)
    np.testing.assert_array_equal(got_dx, want_dx)        # one product each: the same bits
    np.testing.assert_allclose(fused_layer.weight.grad, numpy_layer.weight.grad, rtol=1e-5)
    np.testing.assert_allclose(fused_layer.bias.grad, numpy_layer.bias.grad, rtol=1e-5)
    assert fused_layer._x is None

