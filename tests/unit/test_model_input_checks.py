"""What a model and its loss do with inputs outside the happy path (found by a fault campaign):
a backward without a forward, an inf / NaN gradient (never applied to a weight or a row; skipped
under a loss scale), integer or empty logits, Python lists, and constructor arguments each named
in a ConfigError instead of numpy's or Python's own error."""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError, InputError
from one_embedding.models import DCN, DLRM, DeepFM
from one_embedding.nn import BCEWithLogits
from one_embedding.optim import LossScaler

B = 5


def make(cls, **kw):
    if cls is DLRM:
        return DLRM(num_tables=3, embedding_dim=4, dense_features=2, bottom_mlp=(8, 4),
                    top_mlp=(8, 1), **kw)
    return cls(num_tables=3, embedding_dim=4, dense_features=2, dnn=(8,), dropout=0.0, **kw)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((B, 2)).astype(np.float32), rng.integers(0, 10, (B, 3)),
            rng.integers(0, 2, B).astype(np.float32))


@pytest.mark.parametrize("cls", [DLRM, DCN, DeepFM])
def test_backward_without_a_forward_says_so(cls):
    with pytest.raises(InputError, match=rf"{cls.__name__}.backward\(\) without a forward"):
        make(cls).backward(np.ones(B, np.float32))


@pytest.mark.parametrize("cls", [DLRM, DCN, DeepFM])
def test_a_nan_gradient_never_reaches_a_weight_or_a_row(cls):
    """A NaN dlogits: the embedding's gradient check refuses it (the table unchanged), and the
    dense gradients it reached on the way are refused by the optimizer's step, which updates
    nothing (before, that step made every dense weight NaN without a word)."""
    model = make(cls)
    opt = oe.Optimizer(oe.optim.SGD(model.parameters(), lr=0.1), embeddings=[model.embedding])
    dense, ids, _ = batch()
    model(dense, ids)
    dlogits = np.ones(B, np.float32)
    dlogits[2] = np.nan
    with pytest.raises(InputError, match=r"grad_out holds a non-finite value .* the table is "
                                         r"unchanged"):
        model.backward(dlogits)
    before = [p.data.copy() for p in model.parameters()]
    with pytest.raises(InputError, match=r"has a non-finite gradient: nothing was updated"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


def test_an_fp16_overflow_under_a_loss_scale_skips_its_step():
    """NaN logits from an fp16 forward that overflowed are an overflow, not bad input, when a
    loss scale is in use: the step is skipped and the scale backs off, as PyTorch's GradScaler
    does (a check of dlogits, added and removed the same day, stopped such runs)."""
    from one_embedding.nn import amp

    model = make(DLRM)
    scaler = LossScaler()
    opt = oe.Optimizer(oe.optim.SGD(lr=0.05), embeddings=[model.embedding],
                       parameters=list(model.parameters()), loss_scale=scaler)
    _, ids, labels = batch()
    before = [p.data.copy() for p in model.parameters()]
    dense = np.full((B, 2), 1e9, np.float32)     # the bottom MLP overflows fp16
    with amp.autocast("fp16"), np.errstate(all="ignore"):
        embedded = model.embedding(ids)
        logits = model.forward_from_embeddings(dense, embedded)
        _, _, dembedded = model.loss_and_backward_to_embeddings(logits, labels,
                                                                loss_scale=scaler.scale)
    assert not np.isfinite(logits).all()
    scaler.backward(model.embedding, dembedded.astype(np.float32))
    opt.step()
    assert opt.skipped and scaler.skipped_steps == 1 and scaler.scale == 2.0 ** 15
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


def test_the_optimizer_never_applies_a_non_finite_dense_gradient():
    """Without a loss scale (which skips such a step) a NaN dense gradient is refused by name
    and nothing is updated, the rows included; with one, the step is skipped as before."""
    model = make(DLRM)
    opt = oe.Optimizer(oe.optim.SGD(model.parameters(), lr=0.1), embeddings=[model.embedding])
    dense, ids, labels = batch()
    loss_fn = BCEWithLogits()
    loss_fn(model(dense, ids), labels)
    model.backward(loss_fn.backward())
    before = [p.data.copy() for p in model.parameters()]
    rows = model.embedding.export()[1].copy()
    model.top_mlp.layers[0].weight.grad[0, 0] = np.inf
    with pytest.raises(InputError, match=r"parameter 'top_mlp.0.weight' has a non-finite "
                                         r"gradient: nothing was updated"):
        opt.step()
    assert opt.step_count == 0
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)
    np.testing.assert_array_equal(model.embedding.export()[1], rows)
    scaled = oe.Optimizer(oe.optim.SGD(model.parameters(), lr=0.1), embeddings=[model.embedding],
                          loss_scale=LossScaler(init_scale=8.0))
    scaled.step()
    assert scaled.skipped and scaled.step_count == 0


def test_the_loss_refuses_integer_and_empty_logits_and_takes_lists():
    loss_fn = BCEWithLogits()
    with pytest.raises(InputError, match=r"logits.dtype=int64: the loss takes floating-point"):
        loss_fn(np.array([2, -1, 3]), [0.5, 0.7, 0.2])
    with pytest.raises(InputError, match="logits is empty: the mean loss of an empty batch"):
        loss_fn(np.zeros(0, np.float32), np.zeros(0, np.float32))
    z = np.array([2.0, -1.0, 3.0], np.float32)
    y = [0.5, 0.7, 0.2]
    want = np.mean(np.maximum(z, 0) - z * np.array(y) + np.log1p(np.exp(-np.abs(z))))
    assert loss_fn(z, y) == pytest.approx(want, rel=1e-6)
    assert loss_fn(z.tolist(), np.array(y, np.float32)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("cls", [DLRM, DCN, DeepFM])
def test_lists_are_taken_as_the_arrays_they_spell(cls):
    model = make(cls)
    dense, ids, _ = batch()
    want = model(dense, ids)
    np.testing.assert_array_equal(model(dense.tolist(), ids.tolist()), want)
    embedded = model.embedding(ids)
    np.testing.assert_array_equal(
        model.forward_from_embeddings(dense.tolist(), embedded.tolist()), want)
    with pytest.raises(InputError, match=r"ids=.* is not a rectangular array"):
        model(dense, [[1, 2, 3]] * (B - 1) + [[1, 2]])


@pytest.mark.parametrize("cls, kwargs, message", [
    (DLRM, {"table_sizes": [10, float("nan"), 5]}, r"table size nan must be a positive integer"),
    (DLRM, {"table_sizes": [10, True, 5]}, r"table size True must be a positive integer"),
    (DLRM, {"table_sizes": [10, None, 5]}, r"table_sizes\[1\] is None"),
    (DLRM, {"seed": -1}, r"seed=-1 must be an integer >= 0"),
    (DCN, {"seed": 1.5}, r"seed=1.5 must be an integer >= 0"),
    (DLRM, {"num_tables": None}, r"num_tables=None must be a positive integer"),
    (DLRM, {"pad_to_multiple": 2.5}, r"pad_to_multiple=2.5 must be a positive integer"),
    (DLRM, {"pad_to_multiple": 0}, r"pad_to_multiple=0 must be a positive integer"),
    (DLRM, {"self_interaction": "no"}, r"self_interaction='no' must be True or False"),
    (DLRM, {"bottom_mlp": 4}, r"bottom_mlp=4 must be a sequence of layer sizes"),
    (DCN, {"cross_layers": 0}, r"cross_layers=0 must be a positive integer"),
    (DCN, {"dnn": 512}, r"dnn=512 must be a sequence of layer sizes"),
    (DeepFM, {"dropout": "0.2"}, r"dropout='0.2' must be a number in \[0, 1\)"),
    (DeepFM, {"dense_features": 1.5}, r"dense_features=1.5 must be an integer >= 0"),
])
def test_constructor_arguments_are_named(cls, kwargs, message):
    base = {"num_tables": 3, "embedding_dim": 4}
    if cls is DLRM:
        base.update(bottom_mlp=(8, 4), top_mlp=(8, 1), dense_features=2)
    else:
        base.update(dnn=(8,))
    with pytest.raises(ConfigError, match=message):
        cls(**{**base, **kwargs})


def test_the_dynamic_scale_stops_growing_below_float32s_limit():
    """The model multiplies by float32(scale): a scale grown to 2**128 (finite as a Python
    float) is inf there, and every other step would overflow and be skipped."""
    scaler = LossScaler(init_scale=2.0 ** 126, growth_interval=1)
    for _ in range(4):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0 ** 127 and np.isfinite(np.float32(scaler.scale))
    with pytest.raises(ConfigError, match=r"init_scale=1e\+39 is outside the valid range"):
        LossScaler(init_scale=1e39)
