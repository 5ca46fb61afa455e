"""OneFlow's own expectations for the optimizers (issue 23), ported as facts, not code.

Sources (Oneflow-Inc/oneflow at 25c8978c): the numpy references of
python/oneflow/test/modules/test_optim_{sgd,adam,adagrad,ftrl}.py (``flow.optim.*``: weight_decay
is an L2 term, ``grad + weight_decay * x``), test_one_embedding_{sgd,adam,adagrad,ftrl}.py (the
embedding update kernels, whose ``weight_decay`` attribute is the decoupled ``lr * wd * w``), and
the functors of oneflow/user/kernels/model_update_kernel_util.h. Every case runs through the
numba kernels, the vectorized numpy path, and (for embedding lines) the emulated CUDA kernels.
"""
import warnings

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError, ConventionWarning
from one_embedding.optim import SGD, Adagrad, Adam, Ftrl

PATHS = [True, False]


def run(opt, w0, grads, compiled=True):
    """Dense updates of float32 ``w0`` with ``grads`` (a list); returns the final weight."""
    opt.use_compiled = compiled
    w = np.array(w0, np.float32)
    states = opt.new_states(w)
    for t, g in enumerate(grads, start=1):
        opt.update(w, states, np.asarray(g, np.float32), t)
    return w


# ---------------------------------------------------------------- the issue's numbers
@pytest.mark.parametrize("compiled", PATHS, ids=["numba", "vectorized"])
def test_weight_decay_is_oneflows_l2_term_by_default(compiled):
    # SGD(momentum=0.9, weight_decay=0.1), lr 0.1, two steps from 1.0 with gradient 0.5
    grads = [[0.5], [0.5]]
    sgd = run(SGD(lr=0.1, momentum=0.9, weight_decay=0.1), [1.0], grads, compiled)
    assert sgd[0] == pytest.approx(0.8266, abs=5e-7)
    decoupled = SGD(lr=0.1, momentum=0.9, weight_decay=0.1, weight_decay_mode="decoupled")
    assert run(decoupled, [1.0], grads, compiled)[0] == pytest.approx(0.8356, abs=5e-7)
    # Adam, one step: the bias-corrected step is lr exactly, plus lr*wd*w when decoupled
    assert run(Adam(lr=0.1, weight_decay=0.1), [1.0], grads[:1], compiled)[0] == \
        pytest.approx(0.9, abs=5e-7)
    adamw = Adam(lr=0.1, weight_decay=0.1, weight_decay_mode="decoupled")
    assert run(adamw, [1.0], grads[:1], compiled)[0] == pytest.approx(0.89, abs=5e-7)


@pytest.mark.parametrize("compiled", PATHS, ids=["numba", "vectorized"])
def test_ftrl_is_oneflows_formula_by_default(compiled):
    # one step from w = 0.5 with g = 0.3, lr = 0.1, initial accumulator 0.1
    with pytest.warns(ConventionWarning, match=r"convention='tensorflow'"):
        oneflow = Ftrl(lr=0.1, initial_accumulator_value=0.1)
    assert oneflow.convention == "oneflow"
    assert run(oneflow, [0.5], [[0.3]], compiled)[0] == pytest.approx(-0.202279, abs=5e-7)
    tf = Ftrl(lr=0.1, initial_accumulator_value=0.1, convention="tensorflow")
    assert run(tf, [0.5], [[0.3]], compiled)[0] == pytest.approx(0.068437, abs=5e-7)


def test_ftrl_warns_only_where_the_conventions_differ():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Ftrl(lr=0.1, convention="oneflow")
        Ftrl(lr=0.1, convention="tensorflow")
        Ftrl(lr=0.1, lr_power=0.5)          # OneFlow's n ** 0.5 is FTRL-Proximal's
        Ftrl(lr=0.1, lr_power=0.0)
    with pytest.warns(ConventionWarning, match=r"lambda2=0\.3 added as given, .* 2 \* lambda2"):
        Ftrl(lr=0.1, lr_power=0.5, lambda2=0.3)
    with pytest.warns(ConventionWarning, match=r"accumulator \*\* -0\.5, so the step grows .* "
                                               r"accumulator \*\* 0\.5"):
        oe.Ftrl(lr=0.1)


@pytest.mark.parametrize("compiled", PATHS, ids=["numba", "vectorized"])
def test_oneflow_lr_power_half_and_half_lambda2_are_tensorflows_ftrl(compiled):
    rng = np.random.default_rng(3)
    w0 = rng.uniform(-1, 1, (6, 5))
    grads = list(rng.normal(0, 1, (8, 6, 5)))
    a = Ftrl(lr=0.2, lr_power=0.5, lambda1=0.01, lambda2=0.1, beta=0.5, convention="oneflow")
    b = Ftrl(lr=0.2, lr_power=-0.5, lambda1=0.01, lambda2=0.05, beta=0.5,
             convention="tensorflow")
    np.testing.assert_array_equal(run(a, w0, grads, compiled), run(b, w0, grads, compiled))


# ---------------------------------------------------------------- flow.optim.* (dense)
def oneflow_dense_reference(kind, hp, x, grads):
    """test_optim_{sgd,adam,adagrad,ftrl}.py's numpy references (float64)."""
    x = np.array(x, np.float64)
    wd, lr = hp["weight_decay"], hp["lr"]
    vt, st = np.zeros_like(x), np.zeros_like(x)
    if kind == "adagrad" or kind == "ftrl":
        st = np.full_like(x, hp["initial_accumulator_value"])
    for step, grad in enumerate(grads, start=1):
        grad = np.asarray(grad, np.float64) + wd * x
        if kind == "sgd":
            vt = hp["momentum"] * vt + (1 - hp["dampening"]) * grad
            d = grad + hp["momentum"] * vt if hp["nesterov"] else vt
            x = x - lr * (d if hp["momentum"] > 0 else grad)
        elif kind == "adam":
            b1, b2 = hp["betas"]
            vt = b1 * vt + (1 - b1) * grad
            st = b2 * st + (1 - b2) * grad * grad
            denom = np.sqrt(st) / np.sqrt(1 - b2 ** step) + hp["eps"]
            x = x - lr / (1 - b1 ** step) * vt / denom
        elif kind == "adagrad":
            clr = lr / (1 + (step - 1) * hp["lr_decay"])
            st = st + grad * grad
            x = x - clr / (np.sqrt(st) + hp["eps"]) * grad
        else:  # ftrl
            p, l1, l2, beta = hp["lr_power"], hp["lambda1"], hp["lambda2"], hp["beta"]
            new = st + grad * grad
            vt = vt + grad - (new ** p - st ** p) / lr * x
            st = new
            update = (np.sign(vt) * l1 - vt) / ((beta + new ** p) / lr + l2)
            x = np.where(np.abs(vt) < l1, 0.0, update)
    return x


DENSE = {
    "sgd": (lambda hp: SGD(lr=hp["lr"], weight_decay=hp["weight_decay"]),
            {"lr": 1.0, "weight_decay": 0.9, "momentum": 0.0, "dampening": 0.0,
             "nesterov": False}),
    "momentum": (lambda hp: SGD(lr=hp["lr"], momentum=hp["momentum"],
                                dampening=hp["dampening"], weight_decay=hp["weight_decay"]),
                 {"lr": 0.1, "weight_decay": 0.9, "momentum": 0.9, "dampening": 0.9,
                  "nesterov": False}),
    "nesterov": (lambda hp: SGD(lr=hp["lr"], momentum=hp["momentum"], nesterov=True,
                                weight_decay=hp["weight_decay"]),
                 {"lr": 0.1, "weight_decay": 0.9, "momentum": 0.9, "dampening": 0.0,
                  "nesterov": True}),
    "adam": (lambda hp: Adam(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                             weight_decay=hp["weight_decay"]),
             {"lr": 1.0, "weight_decay": 0.9, "betas": (0.9, 0.999), "eps": 1e-8}),
    "adagrad": (lambda hp: Adagrad(lr=hp["lr"], lr_decay=hp["lr_decay"], eps=hp["eps"],
                                   weight_decay=hp["weight_decay"],
                                   initial_accumulator_value=hp["initial_accumulator_value"]),
                {"lr": 1.0, "weight_decay": 0.9, "lr_decay": 0.9, "eps": 1e-8,
                 "initial_accumulator_value": 2.0}),
    "ftrl": (lambda hp: Ftrl(lr=hp["lr"], weight_decay=hp["weight_decay"],
                             lr_power=hp["lr_power"], lambda1=hp["lambda1"],
                             lambda2=hp["lambda2"], beta=hp["beta"],
                             initial_accumulator_value=hp["initial_accumulator_value"],
                             convention="oneflow"),
             {"lr": 1.0, "weight_decay": 0.9, "lr_power": -0.5, "lambda1": 0.01,
              "lambda2": 0.01, "beta": 1.0, "initial_accumulator_value": 0.1}),
    "ftrl_half": (lambda hp: Ftrl(lr=hp["lr"], weight_decay=hp["weight_decay"],
                                  lr_power=hp["lr_power"], lambda1=hp["lambda1"],
                                  lambda2=hp["lambda2"], beta=hp["beta"],
                                  initial_accumulator_value=hp["initial_accumulator_value"],
                                  convention="oneflow"),
                  {"lr": 1e-3, "weight_decay": 0.0, "lr_power": 0.5, "lambda1": 0.01,
                   "lambda2": 0.0, "beta": 1.0, "initial_accumulator_value": 0.05}),
}


@pytest.mark.parametrize("compiled", PATHS, ids=["numba", "vectorized"])
@pytest.mark.parametrize("case", sorted(DENSE))
def test_flow_optim_references_with_weight_decay(case, compiled):
    make, hp = DENSE[case]
    rng = np.random.default_rng(len(case))
    # OneFlow's tests: x uniform [0, 1) of shape (10,), 10 steps of uniform [0, 1) gradients
    x = rng.uniform(size=(10,)).astype(np.float32)
    grads = list(rng.uniform(size=(10, 10)).astype(np.float32))
    kind = {"momentum": "sgd", "nesterov": "sgd", "ftrl_half": "ftrl"}.get(case, case)
    want = oneflow_dense_reference(kind, hp, x, grads)
    np.testing.assert_allclose(run(make(hp), x, grads, compiled), want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- one_embedding update kernels
def oneflow_embedding_reference(kind, hp, lines, grads, steps):
    """test_one_embedding_{sgd,adam,adagrad,ftrl}.py's numpy references on whole lines: the
    gradient times scale, the kernels' weight_decay the decoupled lr * wd * w."""
    e = grads[0].shape[1]
    lines = lines.astype(np.float64)
    x = lines[:, :e]
    s1, s2 = lines[:, e:2 * e], lines[:, 2 * e:3 * e]
    lr, wd = hp["lr"], hp["weight_decay"]
    for t, g in zip(steps, grads):
        g = g.astype(np.float64) * hp["scale"]
        if kind == "sgd":
            s1[:] = hp["momentum"] * s1 + g
            x[:] = x - lr * s1 - lr * wd * x
        elif kind == "adam":
            b1, b2 = hp["betas"]
            s1[:] = b1 * s1 + (1 - b1) * g
            s2[:] = b2 * s2 + (1 - b2) * g * g
            denom = np.sqrt(s2) / np.sqrt(1 - b2 ** t) + hp["eps"]
            x[:] = x - (lr / (1 - b1 ** t)) * s1 / denom - lr * wd * x
        elif kind == "adagrad":
            clr = lr / (1 + (t - 1) * hp["lr_decay"])
            s1[:] = s1 + g * g
            x[:] = x - clr / (np.sqrt(s1) + hp["eps"]) * g - clr * wd * x
        else:
            p, l1, l2, beta = hp["lr_power"], hp["lambda1"], hp["lambda2"], hp["beta"]
            new = s1 + g * g
            sigma = (new ** p - s1 ** p) / lr
            s2[:] = s2 + g - sigma * x
            update = (np.sign(s2) * l1 - s2) / ((beta + new ** p) / lr + l2) - lr * wd * x
            x[:] = np.where(np.abs(s2) < l1, 0.0, update)
            s1[:] = new
    return lines


EMBEDDING = {
    "sgd": (lambda hp: SGD(lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"],
                           weight_decay_mode="decoupled"),
            {"lr": 0.9, "momentum": 0.9, "weight_decay": 0.1, "scale": 0.1}),
    "adam": (lambda hp: Adam(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                             weight_decay=hp["weight_decay"], weight_decay_mode="decoupled"),
             {"lr": 0.9, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
              "scale": 0.1}),
    "adagrad": (lambda hp: Adagrad(lr=hp["lr"], lr_decay=hp["lr_decay"], eps=hp["eps"],
                                   weight_decay=hp["weight_decay"], weight_decay_mode="decoupled"),
                {"lr": 0.9, "lr_decay": 0.1, "eps": 1e-8, "weight_decay": 0.1, "scale": 0.1}),
    "ftrl": (lambda hp: Ftrl(lr=hp["lr"], weight_decay=hp["weight_decay"], lr_power=hp["lr_power"],
                             lambda1=hp["lambda1"], lambda2=hp["lambda2"], beta=hp["beta"],
                             weight_decay_mode="decoupled", convention="oneflow"),
             {"lr": 0.9, "weight_decay": 0.1, "lr_power": -0.5, "lambda1": 0.1, "lambda2": 0.1,
              "beta": 1.0, "scale": 0.1}),
}


@pytest.mark.parametrize("path", ["numba", "vectorized", "cuda"])
@pytest.mark.parametrize("case", sorted(EMBEDDING))
def test_one_embedding_update_kernel_references(case, path, request):
    make, hp = EMBEDDING[case]
    opt = make(hp)
    opt.grad_scale = hp["scale"]
    opt.use_compiled = path == "numba"
    rng = np.random.default_rng(7)
    n, e = 50, 16
    # OneFlow's tests: lines uniform [0, 1) (states included), gradients uniform [0, 1), a prefix
    # of the rows updated each step
    lines = rng.uniform(size=(n, 3 * e)).astype(np.float32)
    want = lines.astype(np.float64)
    for t in range(1, 6):
        valid = int(rng.integers(1, n))
        g = rng.uniform(size=(valid, e)).astype(np.float32)
        rows = lines[:valid]
        if path == "cuda":
            from one_embedding.kernels import device_ops
            device_ops.update_lines(opt, rows, g, t, launch=request.getfixturevalue("launch"))
        else:
            w, states = rows[:, :e], [rows[:, (k + 1) * e:(k + 2) * e] for k in range(opt.n_states)]
            opt.update(w, states, g, t)
        want[:valid] = oneflow_embedding_reference(case, hp, want[:valid], [g], [t])
    k = 1 + opt.n_states
    np.testing.assert_allclose(lines[:, :k * e], want[:, :k * e], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- checkpoints keep their rule
def _dense_run(opt, p, steps, seed=11):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        p.grad[...] = rng.normal(size=p.data.shape).astype(np.float32)
        opt.step()


def test_a_state_saved_before_issue_23_resumes_with_decoupled_weight_decay():
    from one_embedding.nn.module import Parameter

    def build(**kw):
        p = Parameter(np.ones((3, 4), np.float32), name="w")
        return oe.Optimizer(SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1, **kw)), p

    old, p_old = build(weight_decay_mode="decoupled")
    _dense_run(old, p_old, 3)
    state = old.state_dict()
    assert state["modes"] == {"weight_decay_mode": "decoupled"}
    del state["modes"]                            # as written before the modes were recorded
    resumed, p_new = build()
    p_new.data[...] = p_old.data
    with pytest.warns(ConventionWarning, match=r"weight_decay_mode='decoupled' \(the default "
                                               r"before issue 23\)"):
        resumed.load_state_dict(state)
    assert resumed.optimizer.weight_decay_mode == "decoupled"
    _dense_run(old, p_old, 2, seed=12)
    _dense_run(resumed, p_new, 2, seed=12)
    np.testing.assert_array_equal(p_new.data, p_old.data)
    explicit, _ = build(weight_decay_mode="l2")
    with pytest.raises(ConfigError, match=r"written with weight_decay_mode='decoupled', this "
                                          r"optimizer has weight_decay_mode='l2'"):
        explicit.load_state_dict(state)
    fresh, _ = build()
    fresh.load_state_dict({**state, "modes": {"weight_decay_mode": "l2"}})
    assert fresh.optimizer.weight_decay_mode == "l2"


def test_a_state_saved_before_issue_23_resumes_with_tensorflows_ftrl():
    from one_embedding.nn.module import Parameter

    p = Parameter(np.ones(3, np.float32), name="w")
    with pytest.warns(ConventionWarning):
        opt = oe.Optimizer(Ftrl([p], lr=0.1))
    state = opt.state_dict()
    assert state["modes"] == {"weight_decay_mode": "l2", "convention": "oneflow"}
    del state["modes"]
    with pytest.warns(ConventionWarning, match=r"convention='tensorflow' \(the default before"):
        opt.load_state_dict(state)
    assert opt.optimizer.convention == "tensorflow"
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # no weight decay: the rule changes nothing
        opt.load_state_dict(state)


def test_checkpoints_record_the_modes(tmp_path):
    from one_embedding.checkpoint import load_checkpoint, save_checkpoint

    store = oe.make_device_mem_store_options(str(tmp_path), capacity=100, size_factor=3)
    emb = oe.MultiTableEmbedding("m", 4, np.float32, np.int64, None, store)
    opt = oe.Optimizer(Adam(lr=0.01, weight_decay=0.1, weight_decay_mode="decoupled"),
                       embeddings=[emb])
    emb(np.array([1, 2]))
    emb.backward(np.ones((2, 4), np.float32))
    opt.step()
    save_checkpoint("c", emb, optimizer=opt, state={"step": 1})
    again = oe.Optimizer(Adam(lr=0.01, weight_decay=0.1), embeddings=[emb])
    with pytest.warns(ConventionWarning, match=r"optimizer state's weight_decay_mode="):
        load_checkpoint("c", emb, optimizer=again)
    assert again.optimizer.weight_decay_mode == "decoupled"
    emb.close()
