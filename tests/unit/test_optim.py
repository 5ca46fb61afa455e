"""Embedding/dense optimizers and LR schedules: float64 references, PyTorch, known values."""
import importlib.util
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.errors import ConfigError, ConventionWarning, InputError
from one_embedding.optim import (SGD, Adagrad, Adam, Ftrl, LinearWarmup, MultiStepLR,
                                 PolynomialDecay, WarmupPolynomialDecay)

STEPS = 20
N_ROWS, DIM = 192, 16


# ---------------------------------------------------------------------------------------------
# float64 reference: OneFlow's formulas (weight_decay an L2 term in the gradient, as OneFlow's
# CastScaleRegularizeGradientFunctor adds l2 * w), written independently of the implementation
# ---------------------------------------------------------------------------------------------
def reference_step(opt, w, states, g, t):
    """One update in float64. w, states, g: float64 arrays; returns (w, states)."""
    lr = opt.lr
    g = g + opt.weight_decay * w
    if isinstance(opt, SGD):
        if opt.momentum > 0:
            m = opt.momentum * states[0] + g
            return w - lr * m, [m]
        return w - lr * g, []
    if isinstance(opt, Adagrad):
        clr = lr / (1 + (t - 1) * opt.lr_decay)
        s = states[0] + g ** 2
        return w - clr * g / (np.sqrt(s) + opt.eps), [s]
    if isinstance(opt, Adam):
        b1, b2 = opt.betas
        m = b1 * states[0] + (1 - b1) * g
        v = b2 * states[1] + (1 - b2) * g ** 2
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if opt.do_bias_correction else (1.0, 1.0)
        return w - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + opt.eps), [m, v]
    if isinstance(opt, Ftrl):
        return ftrl_reference_step(opt, w, states, g, lr)
    raise AssertionError(opt)


def ftrl_reference_step(opt, w, states, g, lr):
    """OneFlow's formula (FtrlUpdateFunctor: n ** lr_power, lambda2 as given, zero where
    |z| < lambda1) or TensorFlow's FTRL-Proximal (n ** -lr_power, 2*lambda2, zero where
    |z| <= lambda1); g already holds the L2 term."""
    n, z = states
    oneflow = opt.convention == "oneflow"
    p = opt.lr_power if oneflow else -opt.lr_power
    q = opt.lambda2 if oneflow else 2 * opt.lambda2
    n_new = n + g ** 2
    z = z + g - (n_new ** p - n ** p) / lr * w
    dwd = opt.weight_decay if opt.weight_decay_mode == "decoupled" else 0.0
    update = (np.sign(z) * opt.lambda1 - z) / ((opt.beta + n_new ** p) / lr + q) - lr * dwd * w
    dead = np.abs(z) < opt.lambda1 if oneflow else np.abs(z) <= opt.lambda1
    return np.where(dead, 0.0, update), [n_new, z]


CASES = {
    "sgd": lambda: SGD(0.05),
    "sgd_wd": lambda: SGD(0.05, weight_decay=0.03),
    "momentum_wd": lambda: SGD(0.03, momentum=0.9, weight_decay=0.02),
    "adagrad": lambda: Adagrad(0.1),
    "adagrad_all": lambda: Adagrad(0.1, lr_decay=0.05, weight_decay=0.01,
                                   initial_accumulator_value=0.1, eps=1e-6),
    "adam": lambda: Adam(0.01),
    "adam_wd_betas": lambda: Adam(0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    "adam_no_bias_correction": lambda: Adam(0.01, do_bias_correction=False),
    "ftrl": lambda: Ftrl(0.1, convention="oneflow"),
    "ftrl_all": lambda: Ftrl(0.2, lr_power=-0.5, initial_accumulator_value=0.5, lambda1=0.05,
                             lambda2=0.1, beta=0.5, convention="oneflow"),
    "ftrl_pow": lambda: Ftrl(0.1, lr_power=-0.7, initial_accumulator_value=0.2, lambda1=0.01,
                             lambda2=0.02, beta=1.0, convention="oneflow"),
    "ftrl_half": lambda: Ftrl(0.1, lr_power=0.5, lambda1=0.01, beta=1.0, convention="oneflow"),
    "ftrl_tf": lambda: Ftrl(0.1, convention="tensorflow"),
    "ftrl_tf_all": lambda: Ftrl(0.2, lr_power=-0.5, initial_accumulator_value=0.5, lambda1=0.05,
                                lambda2=0.1, beta=0.5, convention="tensorflow"),
    "ftrl_tf_pow": lambda: Ftrl(0.1, lr_power=-0.7, initial_accumulator_value=0.2, lambda1=0.01,
                                lambda2=0.02, beta=1.0, convention="tensorflow"),
}


def make_lines(opt, rng, n=N_ROWS, dim=DIM, pad=3):
    """(n, (1+k)*dim + pad) float32 lines, the pad columns holding a sentinel; new-key states."""
    k = opt.n_states
    lines = np.full((n, (1 + k) * dim + pad), 7.0, np.float32)
    lines[:, :dim] = rng.normal(0.0, 0.5, (n, dim))
    for i, value in enumerate(opt.initial_state()):
        lines[:, (1 + i) * dim:(2 + i) * dim] = value
    return lines


def split(lines, k, dim=DIM):
    return lines[:, :dim], [lines[:, (1 + i) * dim:(2 + i) * dim] for i in range(k)]


def random_grads(rng, steps, n=N_ROWS, dim=DIM):
    """float32 grads over three magnitudes per row, with whole zero rows (untouched keys)."""
    g = rng.normal(0.0, 1.0, (steps, n, dim)) * rng.choice([1e-3, 1.0, 10.0, 0.0], (steps, n, 1))
    return g.astype(np.float32)


def assert_close_to_float64(actual32, expected64, what):
    # Elementwise rtol 1e-6; near-zero elements (cancellation in w - update) get an absolute
    # tolerance of 1e-6 of the array's scale, since float32 storage rounds every step.
    scale = float(np.abs(expected64).max()) or 1.0
    np.testing.assert_allclose(actual32.astype(np.float64), expected64, rtol=1e-6,
                               atol=1e-6 * scale, err_msg=what)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "vectorized"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference_through_line_views(case, compiled):
    opt = CASES[case]()
    opt.use_compiled = compiled
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    lines = make_lines(opt, rng)
    k = opt.n_states
    w, states = split(lines, k)
    assert not w.flags.c_contiguous
    ref_w = w.astype(np.float64)
    ref_states = [s.astype(np.float64) for s in states]
    grads = random_grads(rng, STEPS)
    # The gradient is itself a strided view on odd steps.
    wide = np.zeros((N_ROWS, 2 * DIM), np.float32)
    for t in range(1, STEPS + 1):
        g = grads[t - 1]
        if t % 2:
            wide[:, DIM:] = g
            g = wide[:, DIM:]
        opt.update(w, states, g, t)
        ref_w, ref_states = reference_step(opt, ref_w, ref_states, grads[t - 1].astype(np.float64),
                                           t)
    assert_close_to_float64(w, ref_w, f"{case}: w")
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert_close_to_float64(s, r, f"{case}: {opt.state_names[i]}")
    assert np.all(lines[:, (1 + k) * DIM:] == 7.0), "padding columns after the line changed"


def assert_compiled_and_vectorized_agree(make_optimizer, seed):
    """STEPS updates through the numba kernels and through numpy expressions: the same float64
    expressions in the same order, one rounding each, so bit-identical lines."""
    results = []
    for compiled in (True, False):
        opt = make_optimizer()
        opt.use_compiled = compiled
        lines = make_lines(opt, np.random.default_rng(seed))
        w, states = split(lines, opt.n_states)
        for t, g in enumerate(random_grads(np.random.default_rng(seed + 1), STEPS), start=1):
            opt.update(w, states, g, t)
        results.append(lines)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_and_vectorized_paths_agree(case):
    assert_compiled_and_vectorized_agree(CASES[case], seed=2)


@pytest.mark.parametrize("case", ["sgd_wd", "momentum_wd", "adagrad_all", "adam_wd_betas",
                                  "ftrl_all"])
@pytest.mark.parametrize("shape", [(), (5,), (4, 3, 6), "transposed"], ids=str)
def test_dense_parameters_of_any_shape_and_layout(case, shape):
    # The same elements updated as one (1, size) row must give bit-identical results.
    if shape == "transposed":
        # (6, 4, 3) view of a contiguous (3, 4, 6) buffer: no 2-D view exists without a copy.
        to_param = lambda a: a.reshape(3, 4, 6).transpose(2, 1, 0)  # noqa: E731
        flatten = lambda a: a.transpose(2, 1, 0).reshape(1, -1)  # noqa: E731
    else:
        to_param = lambda a: a.reshape(shape)  # noqa: E731
        flatten = lambda a: a.reshape(1, -1)  # noqa: E731
    rng = np.random.default_rng(4)
    flat_opt, opt = CASES[case](), CASES[case]()
    size = 72 if shape == "transposed" else int(np.prod(shape))
    flat_w = rng.normal(0.0, 0.5, (1, size)).astype(np.float32)
    flat_states = [np.full((1, size), v, np.float32) for v in opt.initial_state()]
    w = to_param(flat_w.copy())
    states = [to_param(s.copy()) for s in flat_states]
    for t, g in enumerate(random_grads(rng, 3, n=1, dim=size), start=1):
        opt.update(w, states, to_param(g), t)
        flat_opt.update(flat_w, flat_states, g, t)
    np.testing.assert_array_equal(flatten(w), flat_w)
    for s, fs in zip(states, flat_states):
        np.testing.assert_array_equal(flatten(s), fs)


def test_new_states_for_a_dense_parameter():
    w = np.ones((3, 2), np.float32)
    n, z = Ftrl(0.1, initial_accumulator_value=0.25, convention="oneflow").new_states(w)
    assert n.dtype == z.dtype == np.float32 and n.shape == z.shape == (3, 2)
    assert np.all(n == 0.25) and np.all(z == 0.0)
    assert SGD(0.1).new_states(w) == []


def test_empty_update_is_a_no_op():
    opt = Adam(0.1)
    lines = np.zeros((0, 3 * DIM), np.float32)
    w, states = split(lines, 2)
    opt.update(w, states, np.zeros((0, DIM), np.float32), 1)


# ---------------------------------------------------------------------------------------------
# PyTorch parity (dense case, where the semantics coincide)
# ---------------------------------------------------------------------------------------------
TORCH_CASES = {
    "sgd_wd": (lambda: SGD(0.05, weight_decay=0.03),
               lambda torch, p: torch.optim.SGD([p], lr=0.05, weight_decay=0.03)),
    "momentum": (lambda: SGD(0.03, momentum=0.9),
                 lambda torch, p: torch.optim.SGD([p], lr=0.03, momentum=0.9)),
    "adagrad": (lambda: Adagrad(0.1, lr_decay=0.05, initial_accumulator_value=0.3, eps=1e-7),
                lambda torch, p: torch.optim.Adagrad([p], lr=0.1, lr_decay=0.05,
                                                     initial_accumulator_value=0.3, eps=1e-7)),
    "adam": (lambda: Adam(0.01, betas=(0.85, 0.99), eps=1e-6),
             lambda torch, p: torch.optim.Adam([p], lr=0.01, betas=(0.85, 0.99), eps=1e-6)),
    # weight_decay as PyTorch's (and OneFlow's) Adam applies it: g += wd*w
    "adam_wd": (lambda: Adam(0.01, weight_decay=0.1),
                lambda torch, p: torch.optim.Adam([p], lr=0.01, weight_decay=0.1)),
    "momentum_wd": (lambda: SGD(0.03, momentum=0.9, weight_decay=0.02),
                    lambda torch, p: torch.optim.SGD([p], lr=0.03, momentum=0.9,
                                                     weight_decay=0.02)),
    # Decoupled decay lr*wd*w on the old weight is exactly AdamW's w *= 1 - lr*wd first.
    "adamw": (lambda: Adam(0.01, weight_decay=0.1, weight_decay_mode="decoupled"),
              lambda torch, p: torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_matches_torch_optim(case):
    torch = pytest.importorskip("torch")
    make_ours, make_torch = TORCH_CASES[case]
    rng = np.random.default_rng(5)
    opt = make_ours()
    w = rng.normal(0.0, 0.5, (8, 12)).astype(np.float32)
    states = [np.full_like(w, v) for v in opt.initial_state()]
    p = torch.nn.Parameter(torch.from_numpy(w.astype(np.float64)))
    topt = make_torch(torch, p)
    for t, g in enumerate(random_grads(rng, STEPS, n=8, dim=12), start=1):
        opt.update(w, states, g, t)
        p.grad = torch.from_numpy(g.astype(np.float64))
        topt.step()
    assert_close_to_float64(w, p.detach().numpy(), case)


# ---------------------------------------------------------------------------------------------
# FTRL properties
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("convention", ["oneflow", "tensorflow"])
def test_ftrl_large_lambda1_gives_exact_zeros_but_keeps_accumulating(convention):
    opt = Ftrl(0.1, lambda1=1e3, convention=convention)
    rng = np.random.default_rng(6)
    lines = make_lines(opt, rng)
    w, (n, z) = split(lines, 2)
    grads = random_grads(rng, 5)
    for t, g in enumerate(grads, start=1):
        opt.update(w, [n, z], g, t)
    assert np.all(w == 0.0) and not np.signbit(w).any()
    np.testing.assert_allclose(n, 0.1 + (grads.astype(np.float64) ** 2).sum(0), rtol=1e-6)
    assert np.abs(z).max() > 0


@pytest.mark.parametrize("convention", ["oneflow", "tensorflow"])
def test_ftrl_zeroes_exactly_where_z_within_lambda1(convention):
    opt = Ftrl(0.1, lambda1=0.5, lambda2=0.1, convention=convention)
    rng = np.random.default_rng(7)
    lines = make_lines(opt, rng)
    w, (n, z) = split(lines, 2)
    for t, g in enumerate(random_grads(rng, 3), start=1):
        opt.update(w, [n, z], g, t)
    inside = np.abs(z) <= 0.5
    assert inside.any() and (~inside).any()
    assert np.all(w[inside] == 0.0)
    assert np.all(w[~inside] != 0.0)
    # The weight points against z: w = -(z - sign(z)*l1) / quad with quad > 0.
    assert np.all(np.sign(w[~inside]) == -np.sign(z[~inside]))


def test_ftrl_first_step_from_zero():
    # From w = 0 with no regularization z = g, so FTRL-Proximal (TensorFlow's convention) gives
    # the Adagrad-like w = -lr*g/sqrt(n0 + g^2), and OneFlow's n ** lr_power gives
    # w = -lr*g*sqrt(n0 + g^2)
    g = np.random.default_rng(8).normal(size=(4, 5)).astype(np.float32)
    g64 = g.astype(np.float64)
    for convention, want in [("tensorflow", -0.3 * g64 / np.sqrt(0.2 + g64 ** 2)),
                             ("oneflow", -0.3 * g64 * np.sqrt(0.2 + g64 ** 2))]:
        opt = Ftrl(0.3, initial_accumulator_value=0.2, convention=convention)
        w, n, z = np.zeros_like(g), np.full_like(g, 0.2), np.zeros_like(g)
        opt.update(w, [n, z], g, 1)
        np.testing.assert_allclose(w, want, rtol=1e-6)
        np.testing.assert_array_equal(z, g)


def test_ftrl_refuses_zero_lr_from_a_schedule():
    opt = Ftrl(0.1, convention="oneflow")
    opt.lr = 0.0
    w, n, z, g = (np.zeros((2, 2), np.float32) for _ in range(4))
    with pytest.raises(ConfigError, match=r"lr=0\.0.*start_factor > 0"):
        opt.update(w, [n, z], g, 1)


# ---------------------------------------------------------------------------------------------
# Layout and validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt,n_states,initial,size_factor", [
    (SGD(0.1), 0, (), 1),
    (SGD(0.1, momentum=0.5), 1, (0.0,), 2),
    (Adagrad(0.1, initial_accumulator_value=0.25), 1, (0.25,), 2),
    (Adam(0.1), 2, (0.0, 0.0), 3),
    (Ftrl(0.1, initial_accumulator_value=0.3, convention="oneflow"), 2, (0.3, 0.0), 3),
])
def test_line_layout(opt, n_states, initial, size_factor):
    assert opt.n_states == n_states == len(opt.state_names)
    assert opt.initial_state() == initial
    assert opt.required_size_factor() == size_factor
    opt.check_size_factor(size_factor)
    with pytest.raises(ConfigError, match=f"size_factor=9 .* use size_factor={size_factor}"):
        opt.check_size_factor(9)


@pytest.mark.parametrize("make,pattern", [
    (lambda: SGD(-0.1), r"lr=-0\.1 .*\[0, inf\)"),
    (lambda: SGD(float("nan")), r"lr=nan"),
    (lambda: SGD("0.1"), r"lr='0\.1' is not a real number"),
    (lambda: SGD(0.1, momentum=1.0), r"momentum=1\.0 .*\[0, 1\)"),
    (lambda: SGD(0.1, weight_decay=-1e-4), r"weight_decay=-0\.0001"),
    (lambda: Adagrad(0.1, eps=0.0), r"eps=0\.0 .*\(0, inf\)"),
    (lambda: Adagrad(0.1, lr_decay=-1), r"lr_decay=-1"),
    (lambda: Adagrad(0.1, initial_accumulator_value=-0.5), r"initial_accumulator_value=-0\.5"),
    (lambda: Adam(0.1, betas=(0.9, 1.0)), r"betas\[1\]=1\.0 .*\[0, 1\)"),
    (lambda: Adam(0.1, betas=(-0.1, 0.9)), r"betas\[0\]=-0\.1"),
    (lambda: Adam(0.1, betas=0.9), r"betas=0\.9 must be a pair"),
    (lambda: Adam(0.1, eps=-1e-8), r"eps=-1e-08"),
    (lambda: Adam(0.1, do_bias_correction="yes"), r"do_bias_correction='yes'"),
    (lambda: Ftrl(0.0), r"Ftrl: lr=0\.0 .*\(0, inf\)"),
    (lambda: Ftrl(0.1, lr_power=0.5, convention="tensorflow"),
     r"lr_power=0\.5 .*\(-inf, 0\].*TensorFlow's convention"),
    (lambda: Ftrl(0.1, lr_power=float("nan")), r"lr_power=nan"),
    (lambda: Ftrl(0.1, convention="tf"), r"convention='tf': use 'oneflow'"),
    (lambda: Ftrl(0.1, initial_accumulator_value=0.0), r"initial_accumulator_value=0\.0 .*\(0"),
    (lambda: Ftrl(0.1, lambda1=-1.0), r"lambda1=-1\.0"),
    (lambda: Ftrl(0.1, lambda2=float("inf")), r"lambda2=inf"),
    (lambda: Ftrl(0.1, beta=-2), r"beta=-2"),
])
def test_bad_hyper_parameters_are_named(make, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make()


def test_bad_update_inputs():
    opt = Adam(0.1)
    w = np.zeros((4, 3), np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    with pytest.raises(InputError, match=r"step=0"):
        opt.update(w, [m, v], np.zeros_like(w), 0)
    with pytest.raises(InputError, match=r"g has shape \(4, 2\) but w has shape \(4, 3\)"):
        opt.update(w, [m, v], np.zeros((4, 2), np.float32), 1)
    with pytest.raises(InputError, match=r"keeps 2 state arrays .* got 1"):
        opt.update(w, [m], np.zeros_like(w), 1)
    v.flags.writeable = False
    with pytest.raises(InputError, match=r"states\[1\] is read-only"):
        opt.update(w, [m, v], np.zeros_like(w), 1)
    with pytest.raises(InputError, match=r"g has dtype int32"):
        opt.update(w, [m, np.zeros_like(w)], np.zeros(w.shape, np.int32), 1)
    opt.lr = -1.0
    with pytest.raises(ConfigError, match=r"lr=-1\.0"):
        opt.update(w, [m, np.zeros_like(w)], np.zeros_like(w), 1)


def test_import_does_not_pull_cupy():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed, so nothing could import it")
    code = "import sys, one_embedding.optim; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_cupy_matches_numpy(case):
    if not cupy_available():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy

    results = []
    for xp in (np, cupy):
        opt = CASES[case]()
        lines = xp.asarray(make_lines(opt, np.random.default_rng(9)))
        w, states = split(lines, opt.n_states)
        for t, g in enumerate(random_grads(np.random.default_rng(10), 5), start=1):
            opt.update(w, states, xp.asarray(g), t)
        results.append(cupy.asnumpy(lines) if xp is cupy else lines)
    if case == "ftrl_pow":
        # CUDA's pow may differ from glibc's in the last float64 bit.
        np.testing.assert_allclose(results[1], results[0], rtol=1e-6,
                                   atol=1e-7 * float(np.abs(results[0]).max()))
    else:
        np.testing.assert_array_equal(results[1], results[0])


# ---------------------------------------------------------------------------------------------
# LR schedules
# ---------------------------------------------------------------------------------------------
class Target:
    lr = -1.0


def test_linear_warmup_values():
    # OneFlow's LinearLR: update t is rated at t - 1, so the warmup starts at start_factor
    s = LinearWarmup(None, 2.0, warmup_steps=4)
    assert [s.lr_at(t) for t in range(1, 8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    s = LinearWarmup(None, 2.0, warmup_steps=4, start_factor=0.5)
    assert [s.lr_at(t) for t in (1, 2, 5, 10)] == [1.0, 1.25, 2.0, 2.0]
    assert LinearWarmup(None, 3.0, warmup_steps=0).lr_at(1) == 3.0
    # before issue 23: one update ahead
    s = LinearWarmup(None, 2.0, warmup_steps=4, step_origin=1)
    assert [s.lr_at(t) for t in range(1, 6)] == [0.5, 1.0, 1.5, 2.0, 2.0]


def test_polynomial_decay_values():
    s = PolynomialDecay(None, 1.0, decay_start=10, decay_steps=4)
    assert [s.lr_at(t) for t in (1, 10, 11, 12, 13, 14, 15, 100)] == \
        [1.0, 1.0, 1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    s = PolynomialDecay(None, 1.0, decay_start=0, decay_steps=4, end_lr=0.2, power=1.0)
    assert s.lr_at(3) == pytest.approx(0.6) and s.lr_at(5) == s.lr_at(50) == 0.2


def oneflow_dlrm_lr(t, base, warmup, decay_start, decay_steps):
    """OneFlow's DLRM schedule at its step counter s = t - 1 (train_step during update t):
    SequentialLR([LinearLR(start_factor=0, total_iters=warmup), PolynomialLR(decay_steps,
    end_learning_rate=0, power=2)], milestones=[decay_start], interval_rescaling=True), from
    python/oneflow/nn/optimizer/{linear_lr,polynomial_lr,sequential_lr}.py."""
    s = t - 1
    if s < decay_start:                      # bisect_right([decay_start], s) == 0: LinearLR
        return base * (0.0 + (1.0 - 0.0) * (s / warmup)) if s < warmup else base
    cur = min(s - decay_start, decay_steps)  # interval_rescaling: PolynomialLR from 0
    return (base - 0.0) * (1 - cur / decay_steps) ** 2.0 + 0.0


def test_warmup_polynomial_decay_is_oneflows_dlrm_schedule():
    base, warmup, start, steps = 24.0, 2750, 49315, 27772
    s = WarmupPolynomialDecay(None, base, warmup, start, steps)
    for t in [1, 2, 3, 100, 2750, 2751, 2752, start, start + 1, start + 2, start + 13886,
              start + steps, start + steps + 1, start + steps + 2, 10 ** 7]:
        assert s.lr_at(t) == oneflow_dlrm_lr(t, base, warmup, start, steps), t
    assert s.lr_at(1) == 0.0 and s.lr_at(2) == pytest.approx(base / warmup, rel=1e-15)
    assert s.lr_at(warmup + 1) == s.lr_at(start + 1) == base
    assert s.lr_at(start + steps + 1) == 0.0 < s.lr_at(start + steps)
    # the schedule before issue 23 was one update ahead
    old = WarmupPolynomialDecay(None, base, warmup, start, steps, step_origin=1)
    assert all(old.lr_at(t) == s.lr_at(t + 1) for t in [1, 2, 2749, 2750, start, start + 7])


def test_multistep_values_and_torch_parity():
    s = MultiStepLR(None, 1.0, milestones=[3, 5], gamma=0.1)
    got = [s.lr_at(t) for t in range(1, 8)]
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01], rel=1e-12)
    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    tsched = torch.optim.lr_scheduler.MultiStepLR(topt, milestones=[3, 5], gamma=0.1)
    torch_lrs = []
    for _ in range(7):
        torch_lrs.append(topt.param_groups[0]["lr"])
        topt.step()
        tsched.step()
    assert got == pytest.approx(torch_lrs, rel=1e-12)


def test_schedule_drives_optimizers():
    emb, dense = SGD(99.0), Target()
    s = LinearWarmup([emb, dense], 1.0, warmup_steps=4)
    assert emb.lr == dense.lr == 0.0 == s.current_lr
    w, g = np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32)
    for t in range(1, 6):
        assert emb.lr == s.lr_at(t)
        emb.update(w, [], g, t)
        assert s.step() == s.lr_at(t + 1) == dense.lr
    assert w[0, 0] == pytest.approx(-(0.0 + 0.25 + 0.5 + 0.75 + 1.0))
    resumed = LinearWarmup(Target(), 1.0, warmup_steps=4, last_step=2)
    assert resumed.targets[0].lr == 0.5


def test_a_schedule_state_saved_before_issue_23_resumes_one_update_ahead():
    import one_embedding as oe

    s = WarmupPolynomialDecay(Target(), 1.0, warmup_steps=4, decay_start=6, decay_steps=3)
    for _ in range(2):
        s.step()
    state = s.state_dict()
    assert state == {"last_step": 2, "step_origin": 0}
    fresh = WarmupPolynomialDecay(Target(), 1.0, warmup_steps=4, decay_start=6, decay_steps=3)
    fresh.load_state_dict(state)
    assert fresh.targets[0].lr == s.lr_at(3) == 0.5
    old = WarmupPolynomialDecay(Target(), 1.0, warmup_steps=4, decay_start=6, decay_steps=3)
    with pytest.warns(oe.ConventionWarning, match=r"step_origin=1, saved before issue 23"):
        old.load_state_dict({"last_step": 2})
    assert old.step_origin == 1 and old.targets[0].lr == 0.75
    multi = MultiStepLR(Target(), 1.0, milestones=[2])
    multi.load_state_dict({"last_step": 2})     # MultiStepLR always matched OneFlow's
    assert multi.step_origin == 0 and multi.targets[0].lr == pytest.approx(0.1)


@pytest.mark.parametrize("make,error,pattern", [
    (lambda: LinearWarmup(None, -1.0, 10), ConfigError, r"base_lr=-1\.0"),
    (lambda: LinearWarmup(None, 1.0, -1), ConfigError, r"warmup_steps=-1 must be an integer >= 0"),
    (lambda: LinearWarmup(None, 1.0, 2.5), ConfigError, r"warmup_steps=2\.5"),
    (lambda: LinearWarmup(None, 1.0, 10, start_factor=1.5), ConfigError, r"start_factor=1\.5"),
    (lambda: LinearWarmup(object(), 1.0, 10), ConfigError, r"has no 'lr' attribute"),
    (lambda: PolynomialDecay(None, 1.0, 0, 0), ConfigError, r"decay_steps=0 must be .* >= 1"),
    (lambda: PolynomialDecay(None, 1.0, 0, 5, end_lr=2.0), ConfigError, r"end_lr=2\.0"),
    (lambda: PolynomialDecay(None, 1.0, 0, 5, power=0), ConfigError, r"power=0"),
    (lambda: WarmupPolynomialDecay(None, 1.0, 100, 50, 10), ConfigError,
     r"decay_start=50 is before .* decay_start >= 100"),
    (lambda: MultiStepLR(None, 1.0, [5, 3]), ConfigError, r"milestones=\[5, 3\] .* increasing"),
    (lambda: MultiStepLR(None, 1.0, [0]), ConfigError, r"milestones\[0\]=0"),
    (lambda: MultiStepLR(None, 1.0, 7), ConfigError, r"milestones=7"),
    (lambda: MultiStepLR(None, 1.0, [2], gamma=0.0), ConfigError, r"gamma=0\.0"),
    (lambda: MultiStepLR(None, 1.0, [2]).lr_at(-1), InputError, r"step=-1"),
    (lambda: LinearWarmup(None, 1.0, 4, step_origin=2), ConfigError, r"step_origin=2: use 0"),
])
def test_bad_schedule_arguments_are_named(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


# ---------------------------------------------------------------------------------------------
# OneFlow's / PyTorch's arguments: dampening, nesterov, amsgrad, maximize, weight_decay_mode,
# grad_scale, params, defaults
# ---------------------------------------------------------------------------------------------
def general_reference_step(opt, w, states, g, t):
    """One update in float64 with every argument, written from the formulas in the
    row_optimizers docstring (independently of the kernels). Returns (w, states)."""
    lr = opt.lr
    g = g * opt.grad_scale * (-1.0 if opt.maximize else 1.0)
    l2 = opt.weight_decay if opt.weight_decay_mode == "l2" else 0.0
    dwd = opt.weight_decay if opt.weight_decay_mode == "decoupled" else 0.0
    g = g + l2 * w
    if isinstance(opt, SGD):
        if opt.momentum == 0:
            return w - lr * (g + dwd * w), []
        m = opt.momentum * states[0] + (1 - opt.dampening) * g
        d = g + opt.momentum * m if opt.nesterov else m
        return w - lr * d - lr * dwd * w, [m]
    if isinstance(opt, Adagrad):
        clr = lr / (1 + (t - 1) * opt.lr_decay)
        s = states[0] + g ** 2
        return w - clr * g / (np.sqrt(s) + opt.eps) - clr * dwd * w, [s]
    if isinstance(opt, Adam):
        b1, b2 = opt.betas
        m = b1 * states[0] + (1 - b1) * g
        v = b2 * states[1] + (1 - b2) * g ** 2
        new = [m, v]
        if opt.amsgrad:
            v = np.maximum(states[2], v)
            new.append(v)
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if opt.do_bias_correction else (1.0, 1.0)
        return w - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + opt.eps) - lr * dwd * w, new
    if isinstance(opt, Ftrl):
        return ftrl_reference_step(opt, w, states, g, lr)
    raise AssertionError(opt)


NEW_CASES = {
    "momentum_dampening": lambda: SGD(lr=0.03, momentum=0.8, dampening=0.3),
    "nesterov_l2": lambda: SGD(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.02,
                               weight_decay_mode="l2"),
    "nesterov_decoupled": lambda: SGD(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.02,
                                      weight_decay_mode="decoupled"),
    "adagrad_decoupled": lambda: Adagrad(lr=0.1, weight_decay=0.02, initial_accumulator_value=0.1,
                                         weight_decay_mode="decoupled"),
    "adam_decoupled": lambda: Adam(lr=0.02, weight_decay=0.05, weight_decay_mode="decoupled"),
    "sgd_l2_maximize": lambda: SGD(lr=0.05, weight_decay=0.03, weight_decay_mode="l2",
                                   maximize=True),
    "adagrad_l2": lambda: Adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.01,
                                  initial_accumulator_value=0.1, weight_decay_mode="l2"),
    "adam_l2": lambda: Adam(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
                            weight_decay_mode="l2"),
    "adam_amsgrad": lambda: Adam(lr=0.02, amsgrad=True, weight_decay=0.05,
                                 weight_decay_mode="decoupled"),
    "adam_amsgrad_l2_maximize": lambda: Adam(lr=0.01, amsgrad=True, weight_decay=0.01,
                                             weight_decay_mode="l2", maximize=True),
    "ftrl_l2": lambda: Ftrl(lr=0.2, weight_decay=0.05, initial_accumulator_value=0.5,
                            lambda1=0.05, lambda2=0.1, beta=0.5, convention="oneflow"),
    "ftrl_tf_l2": lambda: Ftrl(lr=0.2, weight_decay=0.05, initial_accumulator_value=0.5,
                               lambda1=0.05, lambda2=0.1, beta=0.5, convention="tensorflow"),
    "ftrl_decoupled": lambda: Ftrl(lr=0.2, weight_decay=0.05, lambda1=0.05, beta=0.5,
                                   weight_decay_mode="decoupled", convention="oneflow"),
    "ftrl_tf_decoupled_maximize": lambda: Ftrl(lr=0.2, weight_decay=0.05, lambda1=0.05,
                                               weight_decay_mode="decoupled", maximize=True,
                                               convention="tensorflow"),
    "adagrad_grad_scale": lambda: _with_grad_scale(Adagrad(lr=0.1, weight_decay=0.01), 1 / 1024),
}


def _with_grad_scale(opt, scale):
    opt.grad_scale = scale
    return opt


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "vectorized"])
@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_new_arguments_match_float64_reference(case, compiled):
    opt = NEW_CASES[case]()
    opt.use_compiled = compiled
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    lines = make_lines(opt, rng)
    w, states = split(lines, opt.n_states)
    ref_w, ref_states = w.astype(np.float64), [s.astype(np.float64) for s in states]
    for t, g in enumerate(random_grads(rng, STEPS), start=1):
        opt.update(w, states, g, t)
        ref_w, ref_states = general_reference_step(opt, ref_w, ref_states, g.astype(np.float64), t)
    assert_close_to_float64(w, ref_w, f"{case}: w")
    for name, s, r in zip(opt.state_names, states, ref_states):
        assert_close_to_float64(s, r, f"{case}: {name}")
    assert np.all(lines[:, (1 + opt.n_states) * DIM:] == 7.0)


@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_new_arguments_compiled_and_vectorized_agree(case):
    assert_compiled_and_vectorized_agree(NEW_CASES[case], seed=12)


@pytest.mark.parametrize("case", ["sgd", "momentum_wd", "adagrad_all", "adam_wd_betas",
                                  "ftrl_all"])
def test_defaults_are_bit_identical_to_naming_every_default(case):
    # The new arguments at their defaults change nothing: same bits as spelling them out.
    spelled = {
        "sgd": lambda: SGD(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0,
                           nesterov=False, maximize=False, weight_decay_mode="l2"),
        "momentum_wd": lambda: SGD(lr=0.03, momentum=0.9, dampening=0.0, weight_decay=0.02,
                                   nesterov=False, weight_decay_mode="l2"),
        "adagrad_all": lambda: Adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.01,
                                       initial_accumulator_value=0.1, eps=1e-6,
                                       weight_decay_mode="l2", maximize=False),
        "adam_wd_betas": lambda: Adam(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
                                      amsgrad=False, do_bias_correction=True,
                                      weight_decay_mode="l2"),
        "ftrl_all": lambda: Ftrl(lr=0.2, weight_decay=0.0, lr_power=-0.5,
                                 initial_accumulator_value=0.5, lambda1=0.05, lambda2=0.1,
                                 beta=0.5, weight_decay_mode="l2", convention="oneflow",
                                 maximize=False),
    }[case]
    results = []
    for make in (CASES[case], spelled):
        opt = make()
        opt.grad_scale = 1.0
        lines = make_lines(opt, np.random.default_rng(14))
        w, states = split(lines, opt.n_states)
        for t, g in enumerate(random_grads(np.random.default_rng(15), 5), start=1):
            opt.update(w, states, g, t)
        results.append(lines)
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "vectorized"])
@pytest.mark.parametrize("case", ["sgd_wd", "momentum_wd", "adagrad_all", "adam_wd_betas",
                                  "ftrl_all"])
def test_grad_scale_undoes_a_power_of_two_loss_scale_exactly(case, compiled):
    results = []
    for scale in (1.0, 2.0 ** 12):
        opt = CASES[case]()
        opt.use_compiled = compiled
        opt.grad_scale = 1.0 / scale
        lines = make_lines(opt, np.random.default_rng(16))
        w, states = split(lines, opt.n_states)
        for t, g in enumerate(random_grads(np.random.default_rng(17), 5), start=1):
            opt.update(w, states, g * np.float32(scale), t)
        results.append(lines)
    np.testing.assert_array_equal(results[0], results[1])


def test_amsgrad_and_dampening_layouts():
    assert Adam(amsgrad=True).state_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert Adam(amsgrad=True).required_size_factor() == 4
    assert Adam(amsgrad=True).initial_state() == (0.0, 0.0, 0.0)
    assert SGD(momentum=0.9, dampening=0.5, nesterov=False).required_size_factor() == 2


def test_oneflow_defaults():
    import inspect

    expected = {
        SGD: {"lr": 0.001, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
              "nesterov": False, "maximize": False},
        Adagrad: {"lr": 0.001, "lr_decay": 0.0, "weight_decay": 0.0,
                  "initial_accumulator_value": 0.0, "eps": 1e-10},
        Adam: {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "do_bias_correction": True},
        Ftrl: {"lr": 0.001, "weight_decay": 0.0, "lr_power": -0.5,
               "initial_accumulator_value": 0.1, "lambda1": 0.0, "lambda2": 0.0, "beta": 0.0},
    }
    for cls, defaults in expected.items():
        params = inspect.signature(cls).parameters
        names = list(params)
        # OneFlow's positional order: params, lr, then the algorithm's own arguments
        assert names[:2 + len(defaults) - 1] == ["params", *defaults], cls
        for name, value in defaults.items():
            assert params[name].default == value, (cls, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConventionWarning)   # Ftrl's default: OneFlow's formula
            opt = cls()
        assert opt.lr == 0.001 and opt.params == []


def test_params_first_as_in_oneflow_and_lr_positionally_as_before():
    from one_embedding.nn.module import Parameter

    p = Parameter(np.zeros((2, 3), np.float32), name="w")
    opt = SGD([p], lr=0.1, momentum=0.9)
    assert opt.params == [p] and opt.lr == 0.1
    assert SGD(0.25).lr == 0.25 and SGD(0.25).params == []
    assert Adam(iter([p]), 0.01).params == [p]
    with pytest.raises(ConfigError, match=r"learning rate is given twice"):
        SGD(0.1, lr=0.2)
    grouped = Adam([{"params": [p], "lr": 0.1}])     # OneFlow's list of dicts
    assert grouped.params == [p] and grouped.lr == 0.1 == grouped.param_groups[0]["lr"]
    with pytest.raises(ConfigError, match=r"has no \.data and \.grad"):
        Adagrad([np.zeros(3)])
    with pytest.raises(ConfigError, match=r"params=<object .* not an iterable"):
        Adagrad(object())


@pytest.mark.parametrize("make,pattern", [
    (lambda: SGD(momentum=0.0, nesterov=True), r"nesterov=True needs momentum > 0"),
    (lambda: SGD(momentum=0.9, dampening=0.1, nesterov=True), r"dampening=0 \(got"),
    (lambda: SGD(dampening=0.5), r"dampening=0\.5 without momentum"),
    (lambda: SGD(momentum=0.5, dampening=1.5), r"dampening=1\.5 .*\[0, 1\]"),
    (lambda: SGD(nesterov="yes"), r"nesterov='yes' must be True or False"),
    (lambda: Adam(amsgrad=1), r"amsgrad=1 must be True or False"),
    (lambda: Adagrad(maximize=None), r"maximize=None"),
    (lambda: Adam(weight_decay_mode="adamw"), r"weight_decay_mode='adamw': use 'l2'"),
])
def test_bad_new_arguments_are_named(make, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make()


def test_bad_grad_scale_is_named():
    opt = SGD(lr=0.1)
    w = np.zeros((2, 2), np.float32)
    for bad in (-0.5, float("nan")):
        opt.grad_scale = bad
        with pytest.raises(ConfigError, match=r"grad_scale=.* loss scaler sets 1/scale"):
            opt.update(w, [], w.copy(), 1)


def _torch_zero_momentum(torch, topt, p):
    # PyTorch copies the first gradient into a missing momentum buffer; a buffer that exists
    # from the start (at 0, as a new row's state is) takes the dampened form from step 1.
    topt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return topt


NEW_TORCH_CASES = {
    "nesterov_l2": (
        lambda: SGD(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.02,
                    weight_decay_mode="l2"),
        lambda torch, p: torch.optim.SGD([p], lr=0.03, momentum=0.9, nesterov=True,
                                         weight_decay=0.02)),
    "dampening": (
        lambda: SGD(lr=0.03, momentum=0.8, dampening=0.3),
        lambda torch, p: _torch_zero_momentum(
            torch, torch.optim.SGD([p], lr=0.03, momentum=0.8, dampening=0.3), p)),
    "momentum_l2_maximize": (
        lambda: SGD(lr=0.03, momentum=0.9, weight_decay=0.01, weight_decay_mode="l2",
                    maximize=True),
        lambda torch, p: torch.optim.SGD([p], lr=0.03, momentum=0.9, weight_decay=0.01,
                                         maximize=True)),
    "adagrad_l2": (
        lambda: Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.02, eps=1e-8,
                        weight_decay_mode="l2"),
        lambda torch, p: torch.optim.Adagrad([p], lr=0.1, lr_decay=0.01, weight_decay=0.02,
                                             eps=1e-8)),
    "adam_l2": (
        lambda: Adam(lr=0.01, weight_decay=0.05, weight_decay_mode="l2"),
        lambda torch, p: torch.optim.Adam([p], lr=0.01, weight_decay=0.05)),
    "amsgrad": (
        lambda: Adam(lr=0.01, betas=(0.8, 0.9), amsgrad=True),
        lambda torch, p: torch.optim.Adam([p], lr=0.01, betas=(0.8, 0.9), amsgrad=True)),
    "amsgradw": (
        lambda: Adam(lr=0.01, amsgrad=True, weight_decay=0.1, weight_decay_mode="decoupled"),
        lambda torch, p: torch.optim.AdamW([p], lr=0.01, amsgrad=True, weight_decay=0.1)),
}


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "vectorized"])
@pytest.mark.parametrize("case", sorted(NEW_TORCH_CASES))
def test_new_arguments_match_torch_optim(case, compiled):
    torch = pytest.importorskip("torch")
    make_ours, make_torch = NEW_TORCH_CASES[case]
    rng = np.random.default_rng(18)
    opt = make_ours()
    opt.use_compiled = compiled
    w = rng.normal(0.0, 0.5, (8, 12)).astype(np.float32)
    states = [np.full_like(w, v) for v in opt.initial_state()]
    p = torch.nn.Parameter(torch.from_numpy(w.astype(np.float64)))
    topt = make_torch(torch, p)
    for t, g in enumerate(random_grads(rng, STEPS, n=8, dim=12), start=1):
        opt.update(w, states, g, t)
        p.grad = torch.from_numpy(g.astype(np.float64))
        topt.step()
    assert_close_to_float64(w, p.detach().numpy(), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_cupy_matches_numpy_new_arguments(case):
    if not cupy_available():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy

    results = []
    for xp in (np, cupy):
        opt = NEW_CASES[case]()
        lines = xp.asarray(make_lines(opt, np.random.default_rng(19)))
        w, states = split(lines, opt.n_states)
        for t, g in enumerate(random_grads(np.random.default_rng(20), 5), start=1):
            opt.update(w, states, xp.asarray(g), t)
        results.append(cupy.asnumpy(lines) if xp is cupy else lines)
    np.testing.assert_array_equal(results[1], results[0])
