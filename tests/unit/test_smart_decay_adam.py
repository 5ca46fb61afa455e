"""SmartDecayAdam (OneFlow's ``one_embedding.SmartDecayAdam``): embedding rows decay by the steps
since their last update, kept as an int64 in the line at OneFlow's offset; dense parameters take
plain Adam.

The reference restates OneFlow's SmartDecaySparseAdamUpdateKernel
(oneflow/user/kernels/one_embedding_update_kernels.cu at 25c8978c) and its line size
(oneflow/user/ops/one_embedding_ops.cpp, OneEmbeddingSmartDecaySparseAdamUpdateOp): the three
blocks, padded to 8 bytes, then the int64 step.
"""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError, InputError
from one_embedding.kernels import device_ops
from one_embedding.nn.module import Parameter
from one_embedding.optim import Adam, SmartDecayAdam

E = 6


def oneflow_line_size(embedding_dim, value_bytes=4, step_bytes=8):
    """one_embedding_ops.cpp: align(3 * E * value bytes, 8) + 8 bytes, in values."""
    model_and_states = embedding_dim * 3 * value_bytes
    aligned = (model_and_states + step_bytes - 1) // step_bytes * step_bytes
    return (aligned + step_bytes) // value_bytes, aligned // value_bytes


def reference_rows(lines, grads, t, hp, e=E):
    """OneFlow's kernel in float64 on (n, L) float64 lines whose step column holds int64."""
    b1, b2 = hp["betas"]
    col = oneflow_line_size(e)[1]
    w, m, v = lines[:, :e], lines[:, e:2 * e], lines[:, 2 * e:3 * e]
    prev = lines[:, col].astype(np.int64)
    k = (t - prev)[:, None]
    g = grads.astype(np.float64) * hp.get("scale", 1.0) + hp.get("weight_decay", 0.0) * w
    catchup = np.where(k > 1, m * b1 * (1 - b1 ** (k - 1)) / (1 - b1), 0.0)
    m_new = b1 ** k * m + (1 - b1) * g
    v_new = b2 ** k * v + (1 - b2) * g * g
    w[:] = w - hp["lr"] * (m_new + catchup) / (np.sqrt(v_new) + hp["eps"])
    m[:], v[:] = m_new, v_new
    lines[:, col] = t


def steps_of(lines, opt, e=E):
    col = opt.row_column_offset(e)
    return np.ascontiguousarray(lines[:, col:col + 2]).view(np.int64)[:, 0]


@pytest.mark.parametrize("embedding_dim", [1, 2, 3, 4, 5, 16, 127, 128])
def test_line_size_is_oneflows(embedding_dim):
    opt = SmartDecayAdam()
    size, col = oneflow_line_size(embedding_dim)
    assert opt.required_storage_dim(embedding_dim) == size
    assert opt.row_column_offset(embedding_dim) == col
    assert SmartDecayAdam().required_storage_dim(128) == 3 * 128 + 2


def _run_rows(path, hp, schedule, launch=None):
    """Updates the rows of ``schedule`` ([(t, row indices)]) on float32 lines; returns them."""
    opt = SmartDecayAdam(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                         weight_decay=hp.get("weight_decay", 0.0))
    opt.grad_scale = hp.get("scale", 1.0)
    opt.use_compiled = path == "numba"
    rng = np.random.default_rng(3)
    lines = np.zeros((20, opt.required_storage_dim(E)), np.float32)
    lines[:, :E] = rng.uniform(-1, 1, (20, E))
    col = opt.row_column_offset(E)
    for t, rows in schedule:
        g = rng.normal(size=(len(rows), E)).astype(np.float32)
        sub = np.ascontiguousarray(lines[rows])
        if launch is not None:
            device_ops.update_lines(opt, sub, g, t, launch=launch)
        else:
            opt.update(sub[:, :E], [sub[:, E:2 * E], sub[:, 2 * E:3 * E]], g, t,
                       last_step=sub[:, col:col + 2])
        lines[rows] = sub
    return opt, lines


SCHEDULE = [(1, [0, 1, 2]), (2, [1, 2]), (3, [2, 3]), (7, [0, 3, 4]), (8, [0, 1]),
            (30, [2, 5]), (31, list(range(20)))]
HP = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "scale": 0.5}


@pytest.mark.parametrize("path", ["numba", "vectorized", "cuda"])
def test_rows_follow_oneflows_kernel(path, request):
    launch = request.getfixturevalue("launch") if path == "cuda" else None
    opt, lines = _run_rows(path, HP, SCHEDULE, launch)
    col = opt.row_column_offset(E)
    rng = np.random.default_rng(3)                # the draws of _run_rows, in order
    want = np.zeros((20, col + 1))
    want[:, :E] = rng.uniform(-1, 1, (20, E)).astype(np.float32)
    for t, rows in SCHEDULE:
        g = rng.normal(size=(len(rows), E)).astype(np.float32)
        sub = want[rows]
        reference_rows(sub, g, t, HP)
        want[rows] = sub
    np.testing.assert_allclose(lines[:, :3 * E], want[:, :3 * E], rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(steps_of(lines, opt), want[:, col].astype(np.int64))
    assert steps_of(lines, opt)[0] == 31


def test_every_path_gives_the_same_bits(launch):
    results = [_run_rows(path, HP, SCHEDULE, launch if path == "cuda" else None)[1]
               for path in ("numba", "vectorized", "cuda")]
    for other in results[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), results[0].view(np.uint32))


def test_a_row_seen_every_step_is_adam_without_bias_correction():
    hp = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}
    _, lines = _run_rows("numba", hp, [(t, [0]) for t in range(1, 6)])
    rng = np.random.default_rng(3)
    w = rng.uniform(-1, 1, (20, E))[0].astype(np.float32).astype(np.float64)
    m = v = np.zeros(E)
    for _ in range(5):
        g = rng.normal(size=(1, E)).astype(np.float32)[0].astype(np.float64)
        m = 0.8 * m + 0.2 * g
        v = 0.99 * v + 0.01 * g * g
        w = w - 0.05 * m / (np.sqrt(v) + 1e-6)
    np.testing.assert_allclose(lines[0, :E], w, rtol=1e-6)


# ---------------------------------------------------------------- through the embedding
def _embedding(path, device=None, opt=None):
    opt = opt or SmartDecayAdam()
    store = oe.make_device_mem_store_options(str(path), capacity=1000,
                                             storage_dim=opt.required_storage_dim(E))
    return oe.MultiTableEmbedding("s", E, np.float32, np.int64, None, store, seed=2,
                                  device=device)


def _train(emb, opt, steps=6):
    rng = np.random.default_rng(8)
    for t in range(steps):
        ids = rng.integers(0, 12 + 4 * t, (10, 2))       # new keys, and keys that skip steps
        out = emb(ids)
        emb.backward(emb.xp.asarray(rng.normal(size=out.shape).astype(np.float32)))
        opt.step()
    keys, lines = emb.export()
    order = np.argsort(keys)
    return keys[order], np.asarray(lines)[order]


def test_embedding_rows_record_their_last_step_and_survive_a_snapshot(tmp_path):
    emb = _embedding(tmp_path / "a")
    opt = oe.Optimizer(SmartDecayAdam(lr=0.01), embeddings=[emb])
    keys, lines = _train(emb, opt)
    last = steps_of(lines, opt.optimizer)
    assert last.min() >= 1 and last.max() == 6 and len(set(last.tolist())) > 1
    emb.save_snapshot("s")
    emb.load_snapshot("s")
    _, again = emb.export()
    assert sorted(steps_of(np.asarray(again), opt.optimizer).tolist()) == sorted(last.tolist())
    emb.close()


def test_device_embedding_equals_the_cpu_one(launch, tmp_path):
    cpu = _embedding(tmp_path / "cpu")
    dev = _embedding(tmp_path / "dev", device=launch)
    want = _train(cpu, oe.Optimizer(SmartDecayAdam(lr=0.01, weight_decay=0.01), embeddings=[cpu]))
    got = _train(dev, oe.Optimizer(SmartDecayAdam(lr=0.01, weight_decay=0.01), embeddings=[dev]))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    assert "optim_smart_decay_adam_steps" in launch.launched
    cpu.close(), dev.close()


def test_dense_parameters_take_plain_adam():
    p, q = (Parameter(np.ones((2, 3), np.float32), name=n) for n in "pq")
    smart, plain = SmartDecayAdam([p], lr=0.1), Adam([q], lr=0.1)
    rng = np.random.default_rng(1)
    for _ in range(3):
        p.grad[...] = q.grad[...] = rng.normal(size=(2, 3)).astype(np.float32)
        smart.step(), plain.step()
    np.testing.assert_array_equal(p.data, q.data)


@pytest.mark.parametrize("make,error,pattern", [
    (lambda: SmartDecayAdam(weight_decay_mode="decoupled"), ConfigError, r"row kernel adds"),
    (lambda: SmartDecayAdam(amsgrad=True), ConfigError, r"amsgrad=True"),
    (lambda: SmartDecayAdam(do_bias_correction=False), ConfigError, r"OneFlow requires True"),
    (lambda: SmartDecayAdam().required_size_factor(), ConfigError,
     r"no size_factor gives it; set storage_dim"),
])
def test_refusals(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_a_store_without_the_step_column_is_refused(tmp_path):
    store = oe.make_device_mem_store_options(None, capacity=10, size_factor=3)
    emb = oe.MultiTableEmbedding("r", E, np.float32, np.int64, None, store)
    with pytest.raises(ConfigError, match=r"line_size=18 but SmartDecayAdam .* last_step per row "
                                          r".* use storage_dim=20"):
        oe.Optimizer(SmartDecayAdam(), embeddings=[emb])
    emb.close()


def test_a_restarted_step_count_is_refused(tmp_path):
    emb = _embedding(tmp_path / "r")
    _train(emb, oe.Optimizer(SmartDecayAdam(lr=0.01), embeddings=[emb]), steps=3)
    fresh = oe.Optimizer(SmartDecayAdam(lr=0.01), embeddings=[emb])
    emb(np.array([0, 1, 2, 3]))
    emb.backward(np.ones((4, E), np.float32))
    with pytest.raises(InputError, match=r"last updated at step 3, not before this step 1"):
        fresh.step()
    emb.close()
