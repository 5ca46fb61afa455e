"""Every dense parameter of a group updated by one launch (``kernels.dense_update``,
``optim_dense_<rule>`` in cuda/optim.cu), on the host emulator: the same bits as the numpy update
of each parameter (the compiled CPU kernels) for every row optimizer setting, on the 16-byte and
the one-element path; a parameter whose gradient is all zero (or only -0.0) keeps its weight and
states, one with a NaN is updated; the Optimizer's device path lays the group out once, launches
one update per step, re-lays it where a caller rebound an array, zeroes the gradients with one
fill, reads the host once where the step's count depends on the dense gradients alone, and checks
a fp16 loss scale's overflow over the flat gradient."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_emulation import EmulatedLauncher

import one_embedding as oe
from one_embedding import host_sync
from one_embedding.backend import embedding_device
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import dense_update, device_ops
from one_embedding.nn.module import Parameter

import helpers

#: a model's parameters in miniature: matrices, a bias of one, sizes off the multiple of 4
SHAPES = [(7, 5), (1,), (13,), (4, 4), (3,), (2, 9)]
#: the parameters whose gradient is all zero (index 3: -0.0 only) and the one holding a NaN
ZERO, NEGATIVE_ZERO, WITH_NAN = 1, 3, 4


def _problem(rng, opt):
    """Parameters (numpy float32, specials among the weights), their states (the optimizer's
    initial values, perturbed, accumulators kept non-negative) and two steps of gradients."""
    params, states = [], []
    for i, shape in enumerate(SHAPES):
        w = rng.standard_normal(shape).astype(np.float32)
        if i == 0:
            w.reshape(-1)[:3] = [np.inf, -0.0, 1e-40]
        params.append(Parameter(w, f"p{i}"))
        states.append([np.full(shape, v, np.float32) + np.abs(rng.standard_normal(shape))
                       .astype(np.float32) for v in opt.initial_state()])
    grads = []
    for _ in range(2):
        step = [(rng.standard_normal(s) * np.exp2(rng.integers(-12, 6, s))).astype(np.float32)
                for s in SHAPES]
        step[ZERO][...] = 0.0
        step[NEGATIVE_ZERO][...] = -0.0
        step[WITH_NAN].reshape(-1)[1] = np.nan
        grads.append(step)
    return params, states, grads


def _same_bits(got, want, what):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32),
                                  err_msg=what)


def _flat_against_numpy(launch, opt_factory, seed: int = 0):
    """Two steps through ``FlatDense`` and through ``opt.update`` of each parameter whose
    gradient holds a non-zero element: every weight and state, bit for bit."""
    opt = opt_factory()
    params, states, grads = _problem(np.random.default_rng(seed), opt)
    ref_w = [p.data.copy() for p in params]
    ref_states = [[s.copy() for s in own] for own in states]
    flat = dense_update.FlatDense(params, states, opt.n_states, launch)
    for t, step in enumerate(grads, start=1):
        for p, g in zip(params, step):
            p.grad[...] = g
        flat.find_nonzero()
        flat.update(opt, t)
        for w, own, g in zip(ref_w, ref_states, step):
            if g.any():
                opt.update(w, own, g, t)
    for i, p in enumerate(params):
        _same_bits(p.data, ref_w[i], f"weight {i}")
        for k, s in enumerate(states[i]):
            _same_bits(s, ref_states[i][k], f"state {k} of parameter {i}")
    return flat


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "element"])
@pytest.mark.parametrize("case", sorted(helpers.row_optimizer_cases()))
def test_flat_update_gives_the_numpy_bits(launch, monkeypatch, case, vector):
    monkeypatch.setattr(device_ops, "VECTOR_ROW_UPDATES", vector)
    seen = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda family, name, *a: (seen.append(name), run(family, name, *a))[1])
    flat = _flat_against_numpy(launch, helpers.row_optimizer_cases()[case])
    rule = device_ops.optimizer_kernel(helpers.row_optimizer_cases()[case](), 0.1, 1)[0]
    assert seen == ["dense_nonzero", f"dense_{rule}"] * 2          # one update launch per step
    assert [int(x) for x in flat.nonzero] == [1, 0, 1, 0, 1, 1]    # -0.0 is zero, NaN is not
    assert bool(device_ops.row_update_vector(flat.total, flat.lines.shape[1],
                                             (flat.lines, flat.grads))) == vector


@pytest.mark.stress_seeds
@pytest.mark.parametrize("case", ["momentum_dampening_l2", "adam_amsgrad_l2", "ftrl_l1_l2_beta"])
def test_flat_update_under_the_stress_schedules(launch, case):
    _flat_against_numpy(launch, helpers.row_optimizer_cases()[case], seed=3)


def test_the_layout_keeps_values_aligns_each_parameter_and_refuses_what_it_cannot_hold(launch):
    rng = np.random.default_rng(1)
    params = [Parameter(rng.standard_normal(s).astype(np.float32), f"p{i}")
              for i, s in enumerate(SHAPES)]
    before = [(p.data.copy(), p.grad) for p in params]
    states = [[np.full(p.data.shape, 0.5, np.float32)] for p in params]
    flat = dense_update.FlatDense(params, states, 1, launch)
    for p, (data, _), own in zip(params, before, states):
        _same_bits(p.data, data, p.name)
        assert np.shares_memory(p.data, flat.lines) and np.shares_memory(p.grad, flat.grads)
        assert np.shares_memory(own[0], flat.lines) and (own[0] == 0.5).all()
        assert device_ops.array_address(p.data) % 256 == device_ops.array_address(flat.lines) % 256
    assert flat.intact()
    states[2][0] = states[2][0].copy()                          # a caller rebinds a state
    assert not flat.intact()
    params[0].grad[...] = 3.0
    flat.zero_grad()
    assert not flat.grads.any()
    assert dense_update.eligible(launch, params, 1)
    assert not dense_update.eligible(launch, params + [Parameter(np.zeros(3), "f64")], 1)
    tied = Parameter(np.zeros(3, np.float32), "tied")
    tied.data = params[2].data[:3]                              # shares a weight's memory
    assert not dense_update.eligible(launch, params + [tied], 1)
    assert not dense_update.supported(oe.optim.SmartDecayAdam(lr=0.01))
    assert dense_update.supported(oe.optim.Ftrl(lr=0.1, convention="oneflow"))


def _device_dlrm(launch, make):
    from one_embedding.models import DLRM

    with embedding_device(launch):
        model = DLRM(num_tables=3, embedding_dim=8, dense_features=4, bottom_mlp=[16, 8],
                     top_mlp=[16, 1], seed=1, store_options=oe.make_device_mem_store_options(
                         persistent_path=None, capacity=None,
                         size_factor=make().required_size_factor()))
    return model


def _batch(rng):
    ids = rng.integers(0, 60, (32, 3))
    return ids, rng.standard_normal((32, 4)).astype(np.float32), \
        (rng.random(32) < 0.3).astype(np.float32)


def _train(model, opt, batches, rebind_at=None):
    from one_embedding.nn.loss import BCEWithLogits

    loss_fn, losses = BCEWithLogits(), []
    for step, (ids, dense, labels) in enumerate(batches):
        if step == rebind_at:            # a caller rebinds a weight: the layout is made again
            layer = model.top_mlp.layers[0]
            layer.weight.data = layer.weight.data.copy()
        losses.append(float(loss_fn(model(dense, ids), labels)))
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return losses


def test_the_optimizer_lays_the_group_out_once_and_trains_as_on_the_cpu(launch, monkeypatch):
    """A DLRM on a device embedding against the same model on the CPU, Adam with weight decay:
    the same losses, weights and dense states, bit for bit; one ``optim_dense_adam`` and one
    fill of the gradients per step, the layout made once, and again after a rebound weight
    (which the flat update then takes, as the CPU run does)."""
    make = lambda: oe.optim.Adam(lr=0.01, weight_decay=0.01)  # noqa: E731
    rng = np.random.default_rng(2)
    batches = [_batch(rng) for _ in range(5)]
    runs = {}
    for device in ("cpu", EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES)):
        model = _device_dlrm(device, make)
        opt = oe.Optimizer(make(), embeddings=[model.embedding], parameters=list(model.parameters()))
        names, layouts = [], []
        if device != "cpu":
            run = device.run
            monkeypatch.setattr(device, "run", lambda f, n, *a, run=run: (names.append(n), run(f, n, *a))[1])
            made = dense_update.FlatDense.__init__
            monkeypatch.setattr(dense_update.FlatDense, "__init__",
                                lambda self, *a, made=made: (layouts.append(1), made(self, *a))[1])
        losses = _train(model, opt, batches, rebind_at=3)
        runs[device == "cpu"] = (losses, [p.data.copy() for p in model.parameters()],
                                 [s.copy() for own in opt._dense_states for s in own])
        if device != "cpu":
            assert names.count("dense_adam") == 5 and names.count("dense_nonzero") == 5
            assert len(layouts) == 2                            # the first step, the rebound weight
            assert len(opt._flats) == 1 and opt._flats[0].intact()
            assert not opt._flats[0].grads.any()                # zero_grad: the one fill
        model.embedding.close()
    (cpu_losses, cpu_w, cpu_states), (dev_losses, dev_w, dev_states) = runs[True], runs[False]
    assert dev_losses == cpu_losses
    for i, (a, b) in enumerate(zip(dev_w, cpu_w)):
        _same_bits(a, b, f"parameter {i}")
    for i, (a, b) in enumerate(zip(dev_states, cpu_states)):
        _same_bits(a, b, f"state {i}")


def test_a_step_without_embedding_gradients_reads_the_flags_once(launch):
    """The step counts only when some dense gradient is not all zero (no embedding received
    one): one host read of the group's flags, where the per-parameter path read each gradient;
    a step whose dense gradients are all zero too changes nothing and is not counted."""
    model = _device_dlrm(EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES),
                         lambda: oe.optim.SGD(lr=0.1))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[model.embedding],
                       parameters=list(model.parameters()))
    _train(model, opt, [_batch(np.random.default_rng(0))])
    params = list(model.parameters())
    params[0].grad[...] = 1.0
    before = [p.data.copy() for p in params]
    with host_sync.counting() as reads:
        opt.step()
    assert opt.step_count == 2 and dict(reads.by_reason) == {"optimizer: dense grad nonzero": 1}
    assert not np.array_equal(params[0].data, before[0])
    _same_bits(params[1].data, before[1], "a parameter without gradient")
    opt.zero_grad()
    with host_sync.counting() as reads:
        opt.step()
    assert opt.step_count == 2 and dict(reads.by_reason) == {"optimizer: dense grad nonzero": 1}
    model.embedding.close()


def test_a_fp16_overflow_is_found_in_the_flat_gradient_and_skips_the_step(launch):
    model = _device_dlrm(EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES),
                         lambda: oe.optim.SGD(lr=0.1))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[model.embedding],
                       parameters=list(model.parameters()), loss_scale=oe.optim.LossScaler())
    rng = np.random.default_rng(0)
    _train(model, opt, [_batch(rng)])
    scale = opt.loss_scaler.scale
    ids, dense, labels = _batch(rng)
    model(dense, ids)
    model.backward(np.ones(32, np.float32))
    params = list(model.parameters())
    params[4].grad.reshape(-1)[0] = np.inf
    before = [p.data.copy() for p in params]
    with host_sync.counting() as reads:
        opt.step()
    assert opt.skipped and opt.loss_scaler.scale == scale / 2 and opt.step_count == 1
    assert reads.by_reason.get("loss scale: overflow check") == 1   # one flat gradient
    for p, w in zip(params, before):
        _same_bits(p.data, w, p.name)
    assert not opt._flats[0].grads.any()
    model.embedding.close()
