"""Element-wise optimizers for embedding rows and dense parameters.

An embedding line is ``[w (E) | state1 (E) | state2 (E)]`` in float32; the front end hands
``update`` the column views ``w = lines[:, :E]``, ``states = [lines[:, E:2E], ...]`` of the
unique rows of a step, and the optimizer rewrites them in place. Dense parameters use the same
objects with arrays of any shape. The math (g is the gradient after any scaling, ``t`` the
global step, counted from 1):

    SGD        w -= lr * (g + wd*w)
    momentum   m = beta*m + g;                 w -= lr*m + lr*wd*w
    Adagrad    s += g^2;                       w -= clr*g/(sqrt(s) + eps) + clr*wd*w,
               clr = lr / (1 + (t-1)*lr_decay)
    Adam       m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  bc_i = 1 - b_i^t
               w -= (lr/bc1) * m/(sqrt(v)/sqrt(bc2) + eps) + lr*wd*w
    Ftrl       n' = n + g^2;  sigma = (n'^-p - n^-p)/lr;  z += g - sigma*w;  n = n'   (p = lr_power)
               w = (sign(z)*l1 - z) / ((beta + n^-p)/lr + 2*l2)  where |z| > l1, else 0

Weight-decay terms use the weight before the update. Every update reads float32 storage, computes
in float64 and rounds once per stored value. Over 20 steps this keeps every optimizer within
about 3e-7 (relative to the array's scale) of a float64 run, where float32 arithmetic drifts about
twice as far; the float64 pass costs 20-30% in the compiled kernels (Adam, Ftrl; measured).

Two paths compute the same expressions in the same order: a compiled numba kernel per optimizer
for numpy arrays (one pass, no temporaries, GIL released), and a vectorized ``xp`` path used for
CuPy arrays, for numpy arrays that cannot be viewed as 2-D, and whenever ``use_compiled`` is False.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
import numbers

import numpy as np
from numba import njit

from one_embedding.backend import array_namespace
from one_embedding.errors import ConfigError, InputError

__all__ = ["RowOptimizer", "SGD", "Adagrad", "Adam", "Ftrl", "check_real"]


def check_real(owner: str, name: str, value, low: float = -math.inf, high: float = math.inf,
               low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """``float(value)`` after checking it is a finite real number in the given interval.

    Raises ConfigError naming ``owner``, the parameter, the bad value and the valid range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{owner}: {name}={value!r} is not a real number; pass a float{hint}")
    v = float(value)
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if not math.isfinite(v) or too_low or too_high:
        left = "(" if low_open or low == -math.inf else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ConfigError(f"{owner}: {name}={value!r} is outside the valid range "
                          f"{left}{low:g}, {high:g}{right} (finite){hint}")
    return v


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise InputError(f"step={step!r} must be an integer >= 1: the global step counts updates "
                         "from 1 (Adam's bias correction and Adagrad's lr_decay use it)")
    return int(step)


def _as_2d(a):
    """A 2-D view of ``a`` (same memory), or None when no view exists without a copy."""
    if a.ndim == 2:
        return a
    shape = (1, 1) if a.ndim == 0 else (-1, a.shape[-1])
    if a.ndim >= 1 and a.shape[-1] == 0:
        shape = (0, 0)
    r = a.reshape(shape)
    # A reshape that had to copy never overlaps the original's memory.
    if r.size and not np.may_share_memory(r, a):
        return None
    return r


class RowOptimizer(ABC):
    """Base class: hyper-parameters, the state layout of a line, and an in-place ``update``.

    Attributes:
        n_states: state arrays per weight element (the line holds ``1 + n_states`` blocks of E).
        state_names: names of those states, in line order.
        lr: the learning rate, a plain attribute that LR schedules assign between steps.
        use_compiled: numpy arrays go through the numba kernel when True (the default); False
            forces the vectorized path, the one CuPy arrays always take.
    """

    n_states: int = 0
    state_names: tuple[str, ...] = ()
    use_compiled: bool = True

    def __init__(self, lr: float):
        self.lr = check_real(type(self).__name__, "lr", lr, low=0.0)

    # --- layout -------------------------------------------------------------------------------
    def initial_state(self) -> tuple[float, ...]:
        """The value each state element of a new key (or parameter) starts at, in line order."""
        return ()

    def new_states(self, w) -> list:
        """Fresh state arrays for a parameter ``w`` (any shape; numpy or cupy), in line order."""
        xp = array_namespace(w)
        return [xp.full(w.shape, value, dtype=w.dtype) for value in self.initial_state()]

    def required_size_factor(self) -> int:
        """Blocks of E floats per line: the weight plus one per state."""
        return 1 + self.n_states

    def check_size_factor(self, size_factor: int) -> None:
        """Raise ConfigError unless a store with ``size_factor`` can hold this optimizer's lines."""
        need = self.required_size_factor()
        if size_factor != need:
            states = f"{self.n_states} state{'s' if self.n_states != 1 else ''} per row"
            raise ConfigError(f"size_factor={size_factor!r} but {type(self).__name__} stores "
                              f"{states}: use size_factor={need}")

    def _current_lr(self) -> float:
        # lr is mutable (schedules set it), so it is checked again at each update.
        return check_real(type(self).__name__, "lr", self.lr, low=0.0,
                          hint="; check the LR schedule that set it")

    # --- update -------------------------------------------------------------------------------
    def update(self, w, states, g, step: int) -> None:
        """Apply one step in place.

        Args:
            w: (n, E) float32 weights, or any shape; may be a non-contiguous view into lines.
            states: ``n_states`` arrays shaped like ``w`` (views allowed), in ``state_names`` order.
            g: gradient shaped like ``w`` (float32 usually).
            step: global step t >= 1 of this update.
        """
        t = _check_step(step)
        lr = self._current_lr()
        states = list(states)
        if len(states) != self.n_states:
            raise InputError(f"{type(self).__name__} keeps {self.n_states} state arrays "
                             f"{self.state_names}, got {len(states)}")
        named = [("w", w), ("g", g)] + [(f"states[{i}]", s) for i, s in enumerate(states)]
        for name, a in named:
            if tuple(a.shape) != tuple(w.shape):
                raise InputError(f"{name} has shape {tuple(a.shape)} but w has shape "
                                 f"{tuple(w.shape)}: pass arrays shaped like w")
            if a.dtype.kind != "f":
                raise InputError(f"{name} has dtype {a.dtype}: optimizers update floating-point "
                                 "arrays (float32 lines)")
        xp = array_namespace(w, g, *states)
        if xp is np:
            for name, a in named:
                if name != "g" and not a.flags.writeable:
                    raise InputError(f"{name} is read-only: pass a writable array (or view)")
            if self.use_compiled:
                views = [_as_2d(a) for a in [w, *states, g]]
                if all(v is not None for v in views):
                    self._kernel(views[0], views[1:-1], views[-1], lr, t)
                    return
        self._vectorized(xp, w, states, g, lr, t)

    @abstractmethod
    def _kernel(self, w, states, g, lr: float, t: int) -> None:
        """The compiled CPU update on 2-D views."""

    @abstractmethod
    def _vectorized(self, xp, w, states, g, lr: float, t: int) -> None:
        """The same update as array expressions in ``xp`` (numpy or cupy)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if k not in ("use_compiled", "n_states", "state_names"))
        return f"{type(self).__name__}({fields})"


# ----------------------------------------------------------------------------------------------
# Compiled kernels: 2-D arrays of any strides, float64 arithmetic, one rounding per stored value.
# ----------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _sgd_kernel(w, g, lr, wd):
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            w[i, j] = wi - lr * (np.float64(g[i, j]) + wd * wi)


@njit(cache=True, nogil=True)
def _momentum_kernel(w, m, g, lr, beta, lr_wd):
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            mi = beta * np.float64(m[i, j]) + np.float64(g[i, j])
            m[i, j] = mi
            w[i, j] = wi - lr * mi - lr_wd * wi


@njit(cache=True, nogil=True)
def _adagrad_kernel(w, s, g, clr, eps, clr_wd):
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j])
            si = np.float64(s[i, j]) + gi * gi
            s[i, j] = si
            w[i, j] = wi - clr * gi / (math.sqrt(si) + eps) - clr_wd * wi


@njit(cache=True, nogil=True)
def _adam_kernel(w, m, v, g, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd):
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j])
            mi = b1 * np.float64(m[i, j]) + (1.0 - b1) * gi
            vi = b2 * np.float64(v[i, j]) + (1.0 - b2) * (gi * gi)
            m[i, j] = mi
            v[i, j] = vi
            w[i, j] = wi - step_size * (mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)) - lr_wd * wi


@njit(cache=True, nogil=True)
def _ftrl_kernel(w, acc, z, g, inv_lr, power, l1, l2, beta):
    # power = -lr_power >= 0; 0.5 (the default) takes sqrt, which is exact and faster than pow.
    # Multiplying by 1/lr instead of dividing twice saves a quarter of the time.
    n, e = w.shape
    use_sqrt = power == 0.5
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j])
            ni = np.float64(acc[i, j])
            nn = ni + gi * gi
            if use_sqrt:
                p_old = math.sqrt(ni)
                p_new = math.sqrt(nn)
            else:
                p_old = ni ** power
                p_new = nn ** power
            zi = np.float64(z[i, j]) + gi - (p_new - p_old) * inv_lr * wi
            acc[i, j] = nn
            z[i, j] = zi
            if abs(zi) > l1:
                w[i, j] = (math.copysign(l1, zi) - zi) / ((beta + p_new) * inv_lr + 2.0 * l2)
            else:
                w[i, j] = 0.0


def _f64(xp, a):
    return a.astype(xp.float64)


# ----------------------------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------------------------
class SGD(RowOptimizer):
    """Stochastic gradient descent, with heavy-ball momentum when ``momentum > 0``.

    State: none, or ``[m]`` (starts at 0) with momentum. OneFlow's size_factor: 1 or 2.
    """

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(lr)
        self.momentum = check_real("SGD", "momentum", momentum, 0.0, 1.0, high_open=True)
        self.weight_decay = check_real("SGD", "weight_decay", weight_decay, low=0.0)
        self.n_states = 1 if self.momentum > 0.0 else 0
        self.state_names = ("momentum",) if self.n_states else ()

    def initial_state(self) -> tuple[float, ...]:
        return (0.0,) * self.n_states

    def _kernel(self, w, states, g, lr, t):
        if self.n_states:
            _momentum_kernel(w, states[0], g, lr, self.momentum, lr * self.weight_decay)
        else:
            _sgd_kernel(w, g, lr, self.weight_decay)

    def _vectorized(self, xp, w, states, g, lr, t):
        w64 = _f64(xp, w)
        if self.n_states:
            m = states[0]
            m64 = _f64(xp, m)
            m64 *= self.momentum
            m64 += g
            m[...] = m64
            m64 *= lr
            out = w64 - m64
            if self.weight_decay:
                w64 *= lr * self.weight_decay
                out -= w64
        else:
            upd = _f64(xp, g)
            if self.weight_decay:
                upd += self.weight_decay * w64
            upd *= lr
            out = w64
            out -= upd
        w[...] = out


class Adagrad(RowOptimizer):
    """Adagrad with PyTorch's ``lr_decay``: ``clr = lr / (1 + (t-1)*lr_decay)``.

    State: ``[s]``, the running sum of squared gradients, starting at ``initial_accumulator_value``.
    """

    n_states = 1
    state_names = ("sum_sq",)

    def __init__(self, lr: float, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        super().__init__(lr)
        self.lr_decay = check_real("Adagrad", "lr_decay", lr_decay, low=0.0)
        self.weight_decay = check_real("Adagrad", "weight_decay", weight_decay, low=0.0)
        self.initial_accumulator_value = check_real(
            "Adagrad", "initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.eps = check_real("Adagrad", "eps", eps, low=0.0, low_open=True)

    def initial_state(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value,)

    def _clr(self, lr: float, t: int) -> float:
        return lr / (1.0 + (t - 1) * self.lr_decay)

    def _kernel(self, w, states, g, lr, t):
        clr = self._clr(lr, t)
        _adagrad_kernel(w, states[0], g, clr, self.eps, clr * self.weight_decay)

    def _vectorized(self, xp, w, states, g, lr, t):
        clr = self._clr(lr, t)
        s = states[0]
        g64 = _f64(xp, g)
        s64 = _f64(xp, s)
        s64 += g64 * g64
        s[...] = s64
        xp.sqrt(s64, out=s64)
        s64 += self.eps
        g64 *= clr
        g64 /= s64
        w64 = _f64(xp, w)
        out = w64 - g64
        if self.weight_decay:
            w64 *= clr * self.weight_decay
            out -= w64
        w[...] = out


class Adam(RowOptimizer):
    """Adam with decoupled weight decay (``lr*wd*w``, as AdamW), bias-corrected by the global step.

    State: ``[m, v]``, both starting at 0.
    """

    n_states = 2
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, do_bias_correction: bool = True):
        super().__init__(lr)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ConfigError(f"Adam: betas={betas!r} must be a pair (beta1, beta2), "
                              "e.g. (0.9, 0.999)") from None
        self.betas = (check_real("Adam", "betas[0]", b1, 0.0, 1.0, high_open=True),
                      check_real("Adam", "betas[1]", b2, 0.0, 1.0, high_open=True))
        self.eps = check_real("Adam", "eps", eps, low=0.0, low_open=True)
        self.weight_decay = check_real("Adam", "weight_decay", weight_decay, low=0.0)
        if not isinstance(do_bias_correction, (bool, np.bool_)):
            raise ConfigError(f"Adam: do_bias_correction={do_bias_correction!r} must be True "
                              "or False")
        self.do_bias_correction = bool(do_bias_correction)

    def initial_state(self) -> tuple[float, ...]:
        return (0.0, 0.0)

    def _corrections(self, lr: float, t: int) -> tuple[float, float]:
        """(lr/bc1, 1/sqrt(bc2)) of step t, with bc_i = 1 - beta_i^t."""
        if not self.do_bias_correction:
            return lr, 1.0
        b1, b2 = self.betas
        return lr / (1.0 - b1 ** t), 1.0 / math.sqrt(1.0 - b2 ** t)

    def _kernel(self, w, states, g, lr, t):
        step_size, inv_sqrt_bc2 = self._corrections(lr, t)
        b1, b2 = self.betas
        _adam_kernel(w, states[0], states[1], g, b1, b2, step_size, inv_sqrt_bc2, self.eps,
                     lr * self.weight_decay)

    def _vectorized(self, xp, w, states, g, lr, t):
        step_size, inv_sqrt_bc2 = self._corrections(lr, t)
        b1, b2 = self.betas
        m, v = states
        g64 = _f64(xp, g)
        m64 = _f64(xp, m)
        m64 *= b1
        m64 += (1.0 - b1) * g64
        m[...] = m64
        g64 *= g64
        g64 *= 1.0 - b2
        v64 = _f64(xp, v)
        v64 *= b2
        v64 += g64
        v[...] = v64
        xp.sqrt(v64, out=v64)
        v64 *= inv_sqrt_bc2
        v64 += self.eps
        m64 /= v64
        m64 *= step_size
        w64 = _f64(xp, w)
        out = w64 - m64
        if self.weight_decay:
            w64 *= lr * self.weight_decay
            out -= w64
        w[...] = out


class Ftrl(RowOptimizer):
    """FTRL-Proximal (McMahan et al. 2013) with TensorFlow's conventions (``n^-lr_power``, beta).

    State: ``[n, z]``: the squared-gradient accumulator, starting at ``initial_accumulator_value``
    (> 0), and the linear term z, starting at 0. The weight is recomputed from them each step, so
    it is exactly 0 wherever ``|z| <= lambda1``.
    """

    n_states = 2
    state_names = ("accumulator", "linear")

    def __init__(self, lr: float, lr_power: float = -0.5, initial_accumulator_value: float = 0.1,
                 lambda1: float = 0.0, lambda2: float = 0.0, beta: float = 0.0):
        super().__init__(lr)
        # sigma divides by lr, so Ftrl needs lr > 0 (checked again at each update).
        self.lr = self._check_lr(lr)
        self.lr_power = check_real("Ftrl", "lr_power", lr_power, high=0.0)
        self.initial_accumulator_value = check_real(
            "Ftrl", "initial_accumulator_value", initial_accumulator_value, low=0.0,
            low_open=True, hint=": n^-lr_power of a zero accumulator leaves 0/0 on a zero gradient")
        self.lambda1 = check_real("Ftrl", "lambda1", lambda1, low=0.0)
        self.lambda2 = check_real("Ftrl", "lambda2", lambda2, low=0.0)
        self.beta = check_real("Ftrl", "beta", beta, low=0.0)

    @staticmethod
    def _check_lr(lr) -> float:
        return check_real("Ftrl", "lr", lr, low=0.0, low_open=True,
                          hint=": FTRL divides by lr; start a warmup with start_factor > 0")

    def _current_lr(self) -> float:
        return self._check_lr(self.lr)

    def initial_state(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, 0.0)

    def _kernel(self, w, states, g, lr, t):
        _ftrl_kernel(w, states[0], states[1], g, 1.0 / lr, -self.lr_power, self.lambda1,
                     self.lambda2, self.beta)

    def _vectorized(self, xp, w, states, g, lr, t):
        acc, z = states
        power = -self.lr_power
        g64 = _f64(xp, g)
        n_old = _f64(xp, acc)
        n_new = n_old + g64 * g64
        acc[...] = n_new
        if power == 0.5:
            p_old, p_new = xp.sqrt(n_old), xp.sqrt(n_new)
        else:
            p_old, p_new = n_old ** power, n_new ** power
        del n_old, n_new
        inv_lr = 1.0 / lr
        p_old -= p_new          # p_old now holds -(p_new - p_old)
        p_old *= inv_lr
        p_old *= _f64(xp, w)    # -sigma * w
        z64 = _f64(xp, z)
        z64 += g64
        z64 += p_old
        z[...] = z64
        del p_old, g64
        p_new += self.beta
        p_new *= inv_lr
        p_new += 2.0 * self.lambda2
        num = xp.copysign(xp.float64(self.lambda1), z64)
        num -= z64
        num /= p_new
        w[...] = xp.where(xp.abs(z64) > self.lambda1, num, 0.0)
