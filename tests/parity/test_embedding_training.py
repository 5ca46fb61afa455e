"""Training through MultiTableEmbedding equals a dense float64 implementation of the formulas.

K steps on random batches with duplicate ids, new keys appearing mid-training and a padding_idx,
for each of the five optimizers (SGD, SGD+momentum, Adagrad, Adam, Ftrl), and Adam with AdamW's
decoupled decay. The reference below restates OneFlow's formulas (weight decay an L2 term in the
gradient) independently of one_embedding.optim, computing in float64 and
storing rows as the line does (float32) after each step, so the comparison measures the update
arithmetic rather than the storage format.
"""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.initializers import initial_values

E = 8
TABLES = 3
PAD = 7


def ref_update(kind, hp, w, states, g, t):
    """float64 formulas (OneFlow's: weight_decay is an L2 term in the gradient, g += wd*w; with
    hp["decoupled"] AdamW's lr*wd*w instead); w, states updated in place; g: (E,) float64."""
    lr, wd = hp["lr"], hp.get("weight_decay", 0.0)
    l2, dwd = (0.0, wd) if hp.get("decoupled") else (wd, 0.0)
    g = g + l2 * w
    if kind == "sgd":
        w -= lr * (g + dwd * w)
    elif kind == "momentum":
        m = states[0]
        m[:] = hp["momentum"] * m + g
        w -= lr * m + lr * dwd * w
    elif kind == "adagrad":
        s = states[0]
        clr = lr / (1 + (t - 1) * hp["lr_decay"])
        s += g * g
        w -= clr * g / (np.sqrt(s) + hp["eps"]) + clr * dwd * w
    elif kind == "adam":
        m, v = states
        b1, b2 = hp["betas"]
        old = w.copy()
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        w -= (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + hp["eps"]) + lr * dwd * old
    elif kind == "ftrl":
        # OneFlow's FtrlUpdateFunctor (n ** lr_power, lambda2, zero where |z| < lambda1), or
        # TensorFlow's FTRL-Proximal (n ** -lr_power, 2 * lambda2, zero where |z| <= lambda1)
        n, z = states
        tf = hp.get("convention") == "tensorflow"
        p = -hp["lr_power"] if tf else hp["lr_power"]
        n_new = n + g * g
        sigma = (n_new**p - n**p) / lr
        z += g - sigma * w
        n[:] = n_new
        denom = (hp["beta"] + n**p) / lr + (2 * hp["lambda2"] if tf else hp["lambda2"])
        dead = np.abs(z) <= hp["lambda1"] if tf else np.abs(z) < hp["lambda1"]
        w[:] = np.where(dead, 0.0, (np.sign(z) * hp["lambda1"] - z) / denom)
    else:
        raise ValueError(kind)


CASES = {
    "sgd": (lambda hp: oe.optim.SGD(lr=hp["lr"], weight_decay=hp["weight_decay"]),
            {"lr": 0.05, "weight_decay": 0.01}, []),
    "momentum": (lambda hp: oe.optim.SGD(lr=hp["lr"], momentum=hp["momentum"],
                                         weight_decay=hp["weight_decay"]),
                 {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, [0.0]),
    "adagrad": (lambda hp: oe.optim.Adagrad(lr=hp["lr"], lr_decay=hp["lr_decay"],
                                            weight_decay=hp["weight_decay"],
                                            initial_accumulator_value=hp["iav"], eps=hp["eps"]),
                {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.001, "iav": 0.1, "eps": 1e-8},
                ["iav"]),
    "adam": (lambda hp: oe.optim.Adam(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                      weight_decay=hp["weight_decay"]),
             {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.001}, [0.0, 0.0]),
    "adam_decoupled": (lambda hp: oe.optim.Adam(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                                weight_decay=hp["weight_decay"],
                                                weight_decay_mode="decoupled"),
                       {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                        "decoupled": True}, [0.0, 0.0]),
    "ftrl": (lambda hp: oe.optim.Ftrl(lr=hp["lr"], lr_power=hp["lr_power"],
                                      initial_accumulator_value=hp["iav"], lambda1=hp["lambda1"],
                                      lambda2=hp["lambda2"], beta=hp["beta"],
                                      convention="oneflow"),
             {"lr": 0.1, "lr_power": -0.5, "iav": 0.1, "lambda1": 0.001, "lambda2": 0.01,
              "beta": 0.5}, ["iav", 0.0]),
    "ftrl_tensorflow": (lambda hp: oe.optim.Ftrl(lr=hp["lr"], lr_power=hp["lr_power"],
                                                 initial_accumulator_value=hp["iav"],
                                                 lambda1=hp["lambda1"], lambda2=hp["lambda2"],
                                                 beta=hp["beta"], convention="tensorflow"),
                        {"lr": 0.1, "lr_power": -0.5, "iav": 0.1, "lambda1": 0.001,
                         "lambda2": 0.01, "beta": 0.5, "convention": "tensorflow"},
                        ["iav", 0.0]),
}


def make_batches(rng, steps, batch):
    """Ids grow over time (new keys mid-training), Zipf-like duplicates, some padding."""
    out = []
    for k in range(steps):
        hi = 40 + 15 * k
        ids = rng.integers(0, hi, size=(batch, TABLES)) * TABLES + np.arange(TABLES)
        ids[rng.random(ids.shape) < 0.3] = 8 * TABLES  # a hot key in column 2
        ids[:, 2] = np.where(rng.random(batch) < 0.5, 8 * TABLES + 2, ids[:, 2])
        ids[rng.random(ids.shape) < 0.1] = PAD
        out.append(ids.astype(np.int64))
    return out


@pytest.mark.parametrize("kind", list(CASES))
def test_training_matches_float64_formulas(kind, tmp_path):
    build, hp, state_init = CASES[kind]
    n_states = len(state_init)
    inits = [oe.make_uniform_initializer(-0.5, 0.5), oe.make_normal_initializer(0.1, 0.3),
             oe.make_trunc_normal_initializer(0.0, 0.2, -0.3, 0.3)]
    tables = [oe.make_table_options(i) for i in inits]
    store = oe.make_device_mem_store_options(str(tmp_path), capacity=1000, size_factor=1 + n_states)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, tables, store, padding_idx=PAD, seed=11)
    opt = oe.Optimizer(build(hp), embeddings=[emb])

    rng = np.random.default_rng(0)
    ref: dict[int, list[np.ndarray]] = {}
    cols = np.arange(E, dtype=np.uint64)
    for t, ids in enumerate(make_batches(rng, 12, 32), start=1):
        out = emb(ids)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        # reference forward: initialise new keys by (seed, key, column, table initializer)
        for j in range(TABLES):
            for key in ids[:, j]:
                key = int(key)
                if key != PAD and key not in ref:
                    w0 = initial_values(np, inits[j], 11, np.array([key], np.uint64), cols)[0]
                    st = [np.full(E, hp[s] if isinstance(s, str) else s) for s in state_init]
                    ref[key] = [w0.astype(np.float64)] + st
        # the forward returns the current rows (padding rows zero)
        want_out = np.stack([[ref[int(k)][0] if k != PAD else np.zeros(E) for k in row] for row in ids])
        np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-7)
        summed: dict[int, np.ndarray] = {}
        for (b, j), key in np.ndenumerate(ids):
            if key != PAD:  # summed in float32, as the gradient shuffle sums them
                summed.setdefault(int(key), np.zeros(E, np.float32))
                summed[int(key)] += grad[b, j]
        emb.backward(grad)
        opt.step()
        opt.zero_grad()
        for key, g in summed.items():
            w, *states = ref[key]
            ref_update(kind.split("_")[0], hp, w, states, g.astype(np.float64), t)
            # the line stores float32: the reference stores what the formulas give, rounded once
            for a in (w, *states):
                a[:] = a.astype(np.float32)
    keys, lines = emb.export()
    assert PAD not in set(keys.tolist())
    assert sorted(keys.tolist()) == sorted(ref)
    want = np.stack([np.concatenate(ref[int(k)]) for k in keys])
    np.testing.assert_allclose(lines[:, : E * (1 + n_states)], want, rtol=1e-6, atol=1e-7)
    emb.close()


def test_lookup_without_backward_changes_nothing(tmp_path):
    store = oe.make_device_mem_store_options(None, capacity=100, size_factor=2)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    first = emb(np.array([1, 2, 3]))
    emb.backward(np.ones_like(first))
    opt.step()
    before = emb.export()
    emb(np.array([1, 2, 3, 4, 5]))  # evaluation: no backward
    opt.step()
    after = emb.export()
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    assert len(emb) == 3


def test_two_backwards_before_one_step_sum_gradients():
    store = oe.make_device_mem_store_options(None, capacity=100)
    a = oe.MultiTableEmbedding("a", 4, np.float32, np.int64, None, store, seed=3)
    b = oe.MultiTableEmbedding("b", 4, np.float32, np.int64, None, store, seed=3)
    opt_a = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[a])
    opt_b = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[b])
    g1 = np.full((3, 4), 1.0, np.float32)
    g2 = np.full((2, 4), 2.0, np.float32)
    a(np.array([1, 2, 1])); a.backward(g1)
    a(np.array([2, 5])); a.backward(g2)
    opt_a.step()
    b(np.array([1, 2, 1, 2, 5])); b.backward(np.concatenate([g1, g2]))
    opt_b.step()
    np.testing.assert_array_equal(a.export()[1], b.export()[1])


def test_padding_rows_are_zero_and_never_stored():
    store = oe.make_device_mem_store_options(None, capacity=100)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store, padding_idx=-1)
    opt = oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb])
    out = emb(np.array([[-1, 3], [3, -1]]))
    assert not out[0, 0].any() and not out[1, 1].any()
    assert out[0, 1].any()
    emb.backward(np.ones_like(out))
    opt.step()
    keys, _ = emb.export()
    assert keys.tolist() == [3]


def test_multicolumn_output_concatenates_columns():
    dims = [6, 1]
    tables = [oe.make_table_options([oe.make_column_options(oe.make_constant_initializer(0.5)),
                                     oe.make_column_options(oe.make_constant_initializer(-2.0))])
              for _ in range(2)]
    store = oe.make_device_mem_store_options(None, capacity=100, size_factor=3)
    emb = oe.MultiTableMultiColumnEmbedding("mc", dims, np.float32, np.int64, tables, store)
    out = emb(np.array([[10, 11], [12, 13]]))
    assert out.shape == (2, 2, 7)
    assert (out[..., :6] == 0.5).all() and (out[..., 6] == -2.0).all()
    opt = oe.Optimizer(oe.optim.Adam(lr=0.1), embeddings=[emb])
    emb.backward(np.ones_like(out))
    opt.step()
    assert emb.export()[1].shape == (4, 21)


def test_len_counts_keys_that_live_only_in_a_cache(tmp_path):
    store = oe.make_cached_ssd_store_options(1, str(tmp_path), size_factor=1)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    out = emb(np.arange(50))
    emb.backward(np.ones_like(out))
    opt.step()
    assert emb.store_stats()[-1]["rows"] == 0  # the 1 MB cache holds them all so far
    assert len(emb) == 50
    emb.close()
