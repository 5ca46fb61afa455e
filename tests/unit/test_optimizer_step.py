"""Optimizer.step(closure), dense parameters given to the row optimizer (OneFlow's form), and loss
scaling: unscaled inside the update (bit-identical to an unscaled run for power-of-two scales),
non-finite steps skipped with nothing changed, the dynamic scale's back-off and growth."""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError
from one_embedding.nn.module import Parameter
from one_embedding.optim import LossScaler

E = 4


def make_embedding(name, size_factor=2):
    store = oe.make_device_mem_store_options(None, capacity=1000, size_factor=size_factor)
    return oe.MultiTableEmbedding(name, E, np.float32, np.int64, None, store, seed=5)


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 40, size=(16, 3))
        grad = rng.normal(0.0, 1.0, (16, 3, E)).astype(np.float32)
        dense_grad = rng.normal(0.0, 1.0, (3, 5)).astype(np.float32)
        yield ids, grad, dense_grad


def state_of(emb, param):
    keys, lines = emb.export()
    order = np.argsort(keys)
    return keys[order], lines[order], param.data.copy()


def test_step_calls_the_closure_first_and_returns_its_value():
    emb = make_embedding("c", size_factor=1)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    calls = []

    def closure():
        out = emb(np.array([1, 2]))
        emb.backward(np.ones_like(out))
        calls.append(out.copy())
        return 0.25

    assert opt.step(closure) == 0.25
    assert opt.step_count == 1 and len(calls) == 1
    np.testing.assert_array_equal(emb(np.array([1, 2])), calls[0] - 0.5)
    assert opt.step() is None  # no closure, no gradient: nothing happens
    assert opt.step_count == 1


def test_dense_parameters_given_to_the_row_optimizer_as_in_oneflow():
    p = Parameter(np.ones((3, 5), np.float32), name="w")
    q = Parameter(np.ones((3, 5), np.float32), name="w")
    emb = make_embedding("p", size_factor=2)
    ours = oe.Optimizer(oe.optim.SGD([p], lr=0.1, momentum=0.9), embeddings=[emb])
    theirs = oe.Optimizer(oe.optim.SGD(lr=0.1, momentum=0.9), parameters=[q])
    assert ours.parameters == [p]
    for _ in range(3):
        p.grad[...] = q.grad[...] = 0.5
        ours.step()
        theirs.step()
    np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ConfigError, match=r"given twice"):
        oe.Optimizer(oe.optim.SGD([p], lr=0.1), parameters=[q])


def run(scaler, steps=8, overflow_at=()):
    """Train an embedding and a dense parameter; with a scaler, every gradient carries the scale
    of its step (as a scaled loss's backward gives them). Returns (state, optimizer)."""
    emb = make_embedding("run", size_factor=3)
    param = Parameter(np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5), name="w")
    opt = oe.Optimizer(oe.optim.Adam(lr=0.01, weight_decay=0.01), embeddings=[emb],
                       parameters=[param], loss_scale=scaler)
    for step, (ids, grad, dense_grad) in enumerate(batches(steps)):
        scale = np.float32(opt.loss_scaler.scale if opt.loss_scaler else 1.0)
        out = emb(ids)
        assert out.shape == grad.shape
        if step in overflow_at:
            grad = grad.copy()
            grad[0, 0, 0] = np.inf
        if opt.loss_scaler:
            opt.loss_scaler.backward(emb, grad * scale)
        else:
            emb.backward(grad)
        param.grad[...] = dense_grad * scale
        opt.step()
        opt.zero_grad()
    return state_of(emb, param), opt


@pytest.mark.parametrize("make", [lambda: 1024.0, lambda: LossScaler(2.0 ** 8, growth_interval=2)],
                         ids=["static", "dynamic"])
def test_power_of_two_loss_scale_trains_bit_identically(make):
    (keys0, lines0, w0), _ = run(None)
    (keys1, lines1, w1), opt = run(make())
    np.testing.assert_array_equal(keys0, keys1)
    np.testing.assert_array_equal(lines0, lines1)
    np.testing.assert_array_equal(w0, w1)
    assert opt.step_count == 8 and not opt.skipped
    assert opt.optimizer.grad_scale == 1.0  # restored after each step
    if opt.loss_scaler.dynamic:
        assert opt.loss_scaler.scale == 2.0 ** 12  # doubled every 2 clean steps


def test_an_overflowing_embedding_gradient_skips_the_step():
    scaler = LossScaler(2.0 ** 8, growth_interval=100)
    (keys, lines, w), opt = run(scaler, steps=3, overflow_at=(1,))
    # the same as training on batches 0 and 2 only
    (keys2, lines2, w2), _ = run_subset(scaler_scale=2.0 ** 8, keep=(0, 2))
    assert opt.step_count == 2 and scaler.skipped_steps == 1
    assert scaler.scale == 2.0 ** 7  # backed off once
    np.testing.assert_array_equal(lines, lines2)
    np.testing.assert_array_equal(w, w2)


def run_subset(scaler_scale, keep):
    """The unscaled run on only the batches in ``keep`` (ids of skipped batches are still looked
    up, as in the overflowing run, so the same keys exist)."""
    emb = make_embedding("run", size_factor=3)
    param = Parameter(np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5), name="w")
    opt = oe.Optimizer(oe.optim.Adam(lr=0.01, weight_decay=0.01), embeddings=[emb],
                       parameters=[param])
    for step, (ids, grad, dense_grad) in enumerate(batches(max(keep) + 1)):
        out = emb(ids)
        if step in keep:
            emb.backward(grad)
            param.grad[...] = dense_grad
            opt.step()
        opt.zero_grad()
        del out
    return state_of(emb, param), opt


def test_an_overflowing_dense_gradient_skips_the_step_and_changes_nothing():
    emb = make_embedding("d", size_factor=2)
    param = Parameter(np.ones((3, 5), np.float32), name="w")
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb], parameters=[param],
                       loss_scale=LossScaler(4096.0))
    out = emb(np.array([[1, 2, 3]]))
    before = emb.export()
    assert opt.loss_scaler.backward(emb, np.ones_like(out))
    param.grad[...] = 1.0
    param.grad[1, 2] = np.nan
    opt.step()
    assert opt.skipped and opt.step_count == 0
    assert opt.loss_scaler.scale == 2048.0 and opt.loss_scaler.skipped_steps == 1
    np.testing.assert_array_equal(param.data, 1.0)
    np.testing.assert_array_equal(emb.export()[1], before[1])
    assert not emb.has_gradients and not param.grad.any()  # discarded with the step
    # the next clean step goes through, unscaled by the new scale
    out = emb(np.array([[1, 2, 3]]))
    opt.loss_scaler.backward(emb, np.full_like(out, 2048.0))
    param.grad[...] = 2048.0
    opt.step()
    assert not opt.skipped and opt.step_count == 1
    expected = 1.0 - 0.1 * 1.0 / (np.sqrt(1.0) + 1e-10)
    np.testing.assert_allclose(param.data, expected, rtol=1e-6)


def test_static_scale_never_changes_but_still_skips():
    emb = make_embedding("s", size_factor=1)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb], loss_scale=512)
    assert opt.loss_scaler.scale == 512.0 and not opt.loss_scaler.dynamic
    out = emb(np.array([1]))
    assert not opt.loss_scaler.backward(emb, np.full_like(out, np.inf))
    opt.step()
    assert opt.skipped and opt.loss_scaler.scale == 512.0


def test_dynamic_scale_rule():
    s = LossScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    for found_inf, want in [(False, 8.0), (False, 8.0), (False, 16.0), (True, 4.0),
                            (False, 4.0), (False, 4.0), (False, 8.0)]:
        s.update(found_inf)
        assert s.scale == want
    assert s.skipped_steps == 1
    assert s.scale_loss(3.0) == 24.0
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.scale == 8.0 and restored.skipped_steps == 1
    tiny = LossScaler(init_scale=1e-38, backoff_factor=0.5)
    tiny.update(True)
    assert tiny.scale > 0


def test_optimizer_state_dict_carries_the_loss_scale():
    emb = make_embedding("sd", size_factor=1)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb], loss_scale=LossScaler(64.0))
    opt.loss_scaler.update(True)
    state = opt.state_dict()
    other = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb], loss_scale=LossScaler(64.0))
    other.load_state_dict(state)
    assert other.loss_scaler.scale == 32.0
    assert "loss_scaler" not in oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb]).state_dict()


@pytest.mark.parametrize("make,pattern", [
    (lambda emb: oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb], loss_scale="big"),
     r"loss_scale='big': pass a number"),
    (lambda emb: oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb], loss_scale=-1.0),
     r"init_scale=-1\.0"),
    (lambda emb: LossScaler(growth_interval=0), r"growth_interval=0 must be an integer >= 1"),
    (lambda emb: LossScaler(backoff_factor=1.5), r"backoff_factor=1\.5"),
    (lambda emb: LossScaler(growth_factor=0.5), r"growth_factor=0\.5"),
    (lambda emb: LossScaler(dynamic="no"), r"dynamic='no' must be True or False"),
])
def test_bad_loss_scale_arguments_are_named(make, pattern):
    emb = make_embedding("bad", size_factor=1)
    with pytest.raises(ConfigError, match=pattern):
        make(emb)


def test_a_row_optimizer_steps_its_own_params_as_oneflow_ftrl_does():
    p = Parameter(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), name="w")
    q = Parameter(p.data.copy(), name="w")
    ftrl = oe.Ftrl([p], lr=0.1, lambda1=0.01, convention="oneflow")
    wrapper = oe.Optimizer(oe.Ftrl(lr=0.1, lambda1=0.01, convention="oneflow"), parameters=[q])
    rng = np.random.default_rng(1)
    for _ in range(4):
        p.grad[...] = q.grad[...] = rng.normal(size=(2, 3)).astype(np.float32)
        assert ftrl.step(lambda: "loss") == "loss"
        wrapper.step()
    np.testing.assert_array_equal(p.data, q.data)
    ftrl.zero_grad()
    assert not p.grad.any()
    before = p.data.copy()
    ftrl.step()  # no gradient: nothing changes, the step is not counted
    np.testing.assert_array_equal(p.data, before)
    with pytest.raises(ConfigError, match=r"driven by a one_embedding.Optimizer"):
        wrapper.optimizer.step()


def test_param_groups_as_torch_and_oneflow_code_walks_them():
    p = Parameter(np.ones((2, 2), np.float32), name="w")
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1, momentum=0.9), parameters=[p])
    (group,) = opt.param_groups
    assert group["params"] == [p] and group["lr"] == 0.1 and group["momentum"] == 0.9
    for g in opt.param_groups:
        g["lr"] = 0.05
        g.setdefault("initial_lr", g["lr"])
    assert opt.optimizer.lr == 0.05 and opt.param_groups[0]["initial_lr"] == 0.05
    with pytest.raises(ConfigError, match=r"'momentum' is fixed .* per group: lr, weight_decay, "
                                          r"clip_grad_max_norm, clip_grad_norm_type"):
        group["momentum"] = 0.5
    group["clip_grad_max_norm"] = 1.0           # taken, and used by the next step
    assert opt.param_groups[0].clips
    with pytest.raises(ConfigError, match=r"no setting 'clip_grad_max_nrom'"):
        group["clip_grad_max_nrom"] = 1.0


def test_an_empty_batch_does_not_count_as_a_step():
    """A backward over no id (an empty batch) reaches no row: Adam's step count, on which its
    bias correction depends, stays where it was, and the next real step updates as if the empty
    one had not happened."""
    def final_rows(with_empty):
        emb = make_embedding("empty", size_factor=3)
        opt = oe.Optimizer(oe.optim.Adam(lr=0.1), embeddings=[emb])
        ids = np.array([[1, 2], [3, 1]])
        for step in range(3):
            if with_empty and step == 1:
                out = emb(np.zeros((0, 2), np.int64))
                emb.backward(np.ones_like(out))
                opt.step()                      # no zero_grad: the step let the empty one go
                assert opt.step_count == 1 and not emb._pending
            out = emb(ids)
            emb.backward(np.full_like(out, 0.5))
            opt.step()
            opt.zero_grad()
        assert opt.step_count == 3
        return emb.export()

    np.testing.assert_array_equal(final_rows(True)[1], final_rows(False)[1])
