"""Parameter groups (OneFlow's list of dicts): per-group lr, weight_decay and gradient clipping,
for dense parameters and embedding rows; unknown keys refused.

The clipping references port OneFlow's python/oneflow/test/modules/test_optim_{sgd,adam,adagrad,
ftrl}.py ``compare_with_numpy_*_clip_grad`` and optimizer_test_util.py ``clip_grad_norm_np``
(Oneflow-Inc/oneflow at 25c8978c): clip the raw gradients of the group by their global norm
(coefficient max_norm / (total + 1e-6), applied when below 1), then add weight_decay * x.
"""
import math

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError
from one_embedding.nn.module import Parameter
from one_embedding.optim import SGD, Adagrad, Adam, Ftrl, LinearWarmup
from one_embedding.optim.groups import clip_coefficient

E = 4


def clip_grad_norm_np(grads, max_norm, norm_type):
    """OneFlow's optimizer_test_util.clip_grad_norm_np: (total_norm, clipped grads)."""
    grads = [np.array(g, np.float64) for g in grads]
    if norm_type == math.inf:
        total = max(np.abs(g).max() for g in grads)
    elif norm_type == -math.inf:
        total = min(np.abs(g).min() for g in grads)
    else:
        total = np.linalg.norm([np.linalg.norm(g.ravel(), norm_type) for g in grads], norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        grads = [g * coef for g in grads]
    return total, grads


def numpy_step(kind, hp, x, state, g, t):
    """One update of OneFlow's numpy references (g already clipped; weight decay as L2)."""
    g = g + hp["weight_decay"] * x
    if kind == "sgd":
        state[0] = 0.9 * state[0] + g              # SGD(momentum=0.9)
        return x - hp["lr"] * state[0]
    if kind == "adam":
        b1, b2 = 0.9, 0.999
        state[0] = b1 * state[0] + (1 - b1) * g
        state[1] = b2 * state[1] + (1 - b2) * g * g
        denom = np.sqrt(state[1]) / np.sqrt(1 - b2 ** t) + 1e-8
        return x - hp["lr"] / (1 - b1 ** t) * state[0] / denom
    if kind == "adagrad":
        state[0] = state[0] + g * g
        return x - hp["lr"] / (np.sqrt(state[0]) + 1e-10) * g
    p = -0.5                                   # ftrl, OneFlow's formula
    new = state[0] + g * g
    state[1] = state[1] + g - (new ** p - state[0] ** p) / hp["lr"] * x
    state[0] = new
    update = (np.sign(state[1]) * 0.01 - state[1]) / ((1.0 + new ** p) / hp["lr"])
    return np.where(np.abs(state[1]) < 0.01, 0.0, update)


def make(kind, group):
    if kind == "sgd":
        return SGD([group], momentum=0.9)
    if kind == "adam":
        return Adam([group])
    if kind == "adagrad":
        return Adagrad([group])
    return Ftrl([group], lambda1=0.01, beta=1.0, initial_accumulator_value=0.1,
                convention="oneflow")


def initial_state(kind, x):
    z = np.zeros_like(x, np.float64)
    return {"sgd": [z], "adam": [z, z.copy()], "adagrad": [z],
            "ftrl": [np.full_like(x, 0.1, np.float64), z]}[kind]


@pytest.mark.parametrize("kind", ["sgd", "adam", "adagrad", "ftrl"])
@pytest.mark.parametrize("norm_type", [math.inf, -math.inf, 1.0, 2.0, 3.5, "inf"])
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1.0])
def test_clip_grad_references_of_oneflow(kind, norm_type, max_norm):
    rng = np.random.default_rng(1)
    xs = [rng.uniform(size=(10,)).astype(np.float32) for _ in range(2)]   # tensor_num = 2
    grads = [[rng.uniform(size=(10,)).astype(np.float32) for _ in range(2)] for _ in range(6)]
    params = [Parameter(x.copy(), name=f"x{i}") for i, x in enumerate(xs)]
    hp = {"lr": 0.1 if kind != "sgd" else 1.0, "weight_decay": 0.9 if kind != "ftrl" else 0.0}
    opt = make(kind, {"params": params, **hp, "clip_grad_max_norm": max_norm,
                      "clip_grad_norm_type": norm_type})
    ref = [x.astype(np.float64) for x in xs]
    states = [initial_state(kind, x) for x in xs]
    nt = float(norm_type)
    for t, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads):
            p.grad[...] = g
        opt.step()
        _, clipped = clip_grad_norm_np(step_grads, max_norm, nt)
        ref = [numpy_step(kind, hp, x, st, g, t) for x, st, g in zip(ref, states, clipped)]
    for p, want in zip(params, ref):
        np.testing.assert_allclose(p.data, want, rtol=1e-4, atol=1e-4)


def test_oneflow_sgd_group_dict_with_repeated_arguments():
    # test_optim_sgd.py builds SGD([{"params": x, "lr": lr, "weight_decay": wd}], momentum=...)
    # and its clip variant repeats dampening / nesterov / maximize in the group
    rng = np.random.default_rng(2)
    x = rng.uniform(size=(10,)).astype(np.float32)
    p = Parameter(x.copy(), name="x")
    opt = SGD([{"params": [p], "lr": 0.1, "weight_decay": 0.9, "dampening": 0.9,
                "nesterov": False, "maximize": False}], momentum=0.9, dampening=0.9)
    ref, vt = x.astype(np.float64), np.zeros(10)
    for _ in range(10):
        g = rng.uniform(size=(10,)).astype(np.float32)
        p.grad[...] = g
        opt.step()
        grad = g + 0.9 * ref
        vt = 0.9 * vt + (1 - 0.9) * grad
        ref = ref - 0.1 * vt
    np.testing.assert_allclose(p.data, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- groups with embeddings
def embedding(name, size_factor=2, seed=3):
    store = oe.make_device_mem_store_options(None, capacity=1000, size_factor=size_factor)
    return oe.MultiTableEmbedding(name, E, np.float32, np.int64, None, store, seed=seed)


def rows_of(emb):
    keys, lines = emb.export()
    order = np.argsort(keys)
    return keys[order], lines[order]


def test_each_group_updates_with_its_lr_and_weight_decay():
    """An embedding group and a dense group equal two optimizers of their own settings."""
    a, b = embedding("a"), embedding("b")
    p, q = (Parameter(np.ones((3, 5), np.float32), name=n) for n in "pq")
    grouped = oe.Optimizer(SGD([{"params": [a], "lr": 0.3, "weight_decay": 0.1},
                                {"params": [p]}], lr=0.05, momentum=0.9))
    assert grouped.embeddings == [a] and grouped.parameters == [p]
    rows_opt = oe.Optimizer(SGD(lr=0.3, momentum=0.9, weight_decay=0.1), embeddings=[b])
    dense_opt = oe.Optimizer(SGD([q], lr=0.05, momentum=0.9))
    rng = np.random.default_rng(4)
    for _ in range(4):
        ids = rng.integers(0, 30, (8, 2))
        g = rng.normal(size=(8, 2, E)).astype(np.float32)
        dg = rng.normal(size=(3, 5)).astype(np.float32)
        a(ids), b(ids)
        a.backward(g), b.backward(g)
        p.grad[...] = q.grad[...] = dg
        grouped.step(), rows_opt.step(), dense_opt.step()
    for x, y in zip(rows_of(a), rows_of(b)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(p.data, q.data)


def test_clipping_counts_the_embedding_rows_of_the_step():
    """A group holding an embedding and a dense parameter clips them by their joint norm: the
    norm of the dense gradient and of the step's per-key summed row gradients."""
    emb, ref_emb = embedding("c", size_factor=1), embedding("d", size_factor=1)
    p = Parameter(np.zeros((2, 3), np.float32), name="p")
    opt = oe.Optimizer(SGD([{"params": [emb, p], "clip_grad_max_norm": 1.5,
                             "clip_grad_norm_type": 2.0}], lr=0.5))
    plain = oe.Optimizer(SGD(lr=0.5), embeddings=[ref_emb])
    ids = np.array([[1, 2], [2, 5]])
    g = np.arange(1, 9, dtype=np.float32).reshape(2, 2, 2).repeat(2, axis=2) / 8
    dg = np.full((2, 3), 0.5, np.float32)
    emb(ids), ref_emb(ids)
    emb.backward(g)
    p.grad[...] = dg
    rows = {1: g[0, 0], 2: g[0, 1] + g[1, 0], 5: g[1, 1]}      # per key, summed
    total = math.sqrt(sum(float((r.astype(np.float64) ** 2).sum()) for r in rows.values())
                      + float((dg.astype(np.float64) ** 2).sum()))
    coef = 1.5 / (total + 1e-6)
    assert coef < 1
    ref_emb.backward(g * np.float32(coef))
    opt.step(), plain.step()
    np.testing.assert_allclose(rows_of(emb)[1], rows_of(ref_emb)[1], rtol=1e-6)
    np.testing.assert_allclose(p.data, -0.5 * dg * coef, rtol=1e-6)


def test_clipping_sees_unscaled_gradients_under_a_loss_scale():
    results = []
    for scale in (None, 1024.0):
        emb = embedding("s", size_factor=3)
        opt = oe.Optimizer(Adam([{"params": [emb], "clip_grad_max_norm": 0.1}], lr=0.01),
                           loss_scale=scale)
        rng = np.random.default_rng(5)
        for _ in range(3):
            out = emb(rng.integers(0, 20, (6, 2)))
            g = rng.normal(size=out.shape).astype(np.float32)
            emb.backward(g * np.float32(scale or 1.0))
            opt.step()
        results.append(rows_of(emb))
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)


def test_clip_coefficient_combines_the_ranks_row_norms():
    class TwoRanks:            # the other rank holds the same partial
        world = 2

        def allreduce_sum(self, a):
            return a * 2

        def allgather(self, a):
            return np.stack([a, a / 2])

    rows, dense = [np.full((2, 2), 3.0, np.float32)], [np.full(4, 1.0, np.float32)]
    # 2-norm: rows 8 * 9 over two ranks, dense 4 * 1
    want = 1.0 / (math.sqrt(2 * 36 + 4) + 1e-6)
    assert clip_coefficient(1.0, 2.0, dense, rows, 1.0, TwoRanks()) == pytest.approx(want)
    assert clip_coefficient(1.0, math.inf, dense, rows, 0.5, TwoRanks()) == \
        pytest.approx(1.0 / (1.5 + 1e-6))
    assert clip_coefficient(1.0, -math.inf, dense, rows, 1.0, TwoRanks()) == \
        pytest.approx(1.0 / (1.0 + 1e-6))
    assert clip_coefficient(100.0, 2.0, [], [], 1.0) == 1.0


# ---------------------------------------------------------------- lr of several groups
def test_a_schedule_moves_every_group_in_proportion():
    p, q = (Parameter(np.zeros(2, np.float32), name=n) for n in "pq")
    opt = SGD([{"params": [p]}, {"params": [q], "lr": 0.01}], lr=0.1)
    sched = LinearWarmup(opt, 0.1, warmup_steps=4)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    sched.step(), sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[1]["lr"] == pytest.approx(0.005)
    opt.param_groups[1]["lr"] = 0.2               # set directly: that group only
    assert opt.lr == 0.05 and opt.param_groups[1]["lr"] == 0.2


def test_group_state_round_trips_through_state_dict():
    p, q = (Parameter(np.ones(2, np.float32), name=n) for n in "pq")
    opt = oe.Optimizer(SGD([{"params": [p]}, {"params": [q], "lr": 0.01}], lr=0.1))
    opt.param_groups[1]["lr"] = 0.02
    state = opt.state_dict()
    again = oe.Optimizer(SGD([{"params": [p]}, {"params": [q], "lr": 0.01}], lr=0.1))
    again.load_state_dict(state)
    assert [g["lr"] for g in again.param_groups] == [0.1, 0.02]


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("make_opt,pattern", [
    (lambda p: SGD([{"params": [p], "clip_grad_max_nrom": 1.0}]),
     r"group 0 has key 'clip_grad_max_nrom', which no group takes"),
    (lambda p: SGD([{"params": [p], "contiguous_params": True}]), r"'contiguous_params'"),
    (lambda p: SGD([{"params": [p], "momentum": 0.5}], momentum=0.9),
     r"momentum=0\.5 differs from the optimizer's momentum=0\.9"),
    (lambda p: Adam([{"params": [p], "momentum": 0.5}]), r"Adam has no 'momentum'"),
    (lambda p: SGD([{"params": [p], "clip_grad_norm_type": 2.0}]),
     r"clip_grad_norm_type=2\.0 without clip_grad_max_norm clips nothing"),
    (lambda p: SGD([{"params": [p], "clip_grad_max_norm": -1.0}]), r"clip_grad_max_norm=-1\.0"),
    (lambda p: SGD([{"params": [p], "clip_grad_max_norm": 1.0, "clip_grad_norm_type": 0.0}]),
     r"clip_grad_norm_type=0\.0: use p > 0"),
    (lambda p: SGD([{"params": [p], "weight_decay": -1}]), r"weight_decay=-1"),
    (lambda p: SGD([{"params": [p]}, {"params": [p]}]), r"more than one parameter group"),
    (lambda p: SGD([{"lr": 0.1}]), r"group 0 has no 'params'"),
    (lambda p: SGD([{"params": [p]}, p]), r"mixes parameter groups .* and parameters"),
    (lambda p: Ftrl([{"params": [p], "lr": 0.0}], convention="oneflow"), r"Ftrl: lr=0\.0"),
])
def test_bad_groups_are_named(make_opt, pattern):
    p = Parameter(np.zeros(2, np.float32), name="p")
    with pytest.raises(ConfigError, match=pattern):
        make_opt(p)


def test_group_keys_set_later_are_checked_and_used():
    p = Parameter(np.zeros(2, np.float32), name="p")
    opt = SGD([p], lr=1.0)
    group = opt.param_groups[0]
    with pytest.raises(ConfigError, match=r"no setting 'fused'"):
        group["fused"] = True
    with pytest.raises(ConfigError, match=r"clip_grad_norm_type=nan"):
        group["clip_grad_norm_type"] = float("nan")
    group["clip_grad_max_norm"] = 1.0          # OneFlow's eager optimizer ignored this
    p.grad[...] = [3.0, 4.0]
    opt.step()
    np.testing.assert_allclose(p.data, [-0.6, -0.8], rtol=1e-6)


def test_an_embedding_must_name_its_group_when_there_are_several():
    emb = embedding("e")
    p = Parameter(np.zeros(2, np.float32), name="p")
    with pytest.raises(ConfigError, match=r"embedding 'e' is in none of the row optimizer's 2 "
                                          r"parameter groups"):
        oe.Optimizer(SGD([{"params": [p]}, {"params": [], "lr": 0.5}], momentum=0.5),
                     embeddings=[emb])
    with pytest.raises(ConfigError, match=r"holds embeddings; wrap the optimizer"):
        SGD([{"params": [emb]}]).step()
