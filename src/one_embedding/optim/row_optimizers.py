"""Element-wise optimizers for embedding rows and dense parameters, with OneFlow's arguments.

An embedding line is ``[w (E) | state1 (E) | state2 (E) ...]`` in float32; the front end hands
``update`` the column views ``w = lines[:, :E]``, ``states = [lines[:, E:2E], ...]`` of the
unique rows of a step, and the optimizer rewrites them in place. Dense parameters use the same
objects with arrays of any shape. The math (``t`` the global step, counted from 1; g' the gradient
after the loss-scale factor and, in the default ``weight_decay_mode="l2"`` (OneFlow's), plus
``wd*w``; ``dwd`` the decoupled decay, ``wd`` in ``weight_decay_mode="decoupled"`` and 0 in
``"l2"``):

    SGD        w -= lr * (g' + dwd*w)
    momentum   m = beta*m + (1-dampening)*g';  d = g' + beta*m (nesterov) or m;
               w -= lr*d + lr*dwd*w
    Adagrad    s += g'^2;                      w -= clr*g'/(sqrt(s) + eps) + clr*dwd*w,
               clr = lr / (1 + (t-1)*lr_decay)
    Adam       m = b1*m + (1-b1)*g';  v = b2*v + (1-b2)*g'^2;  bc_i = 1 - b_i^t
               (amsgrad: v_max = max(v_max, v), used for v below)
               w -= (lr/bc1) * m/(sqrt(v)/sqrt(bc2) + eps) + lr*dwd*w
    Ftrl       n' = n + g'^2;  sigma = (P(n') - P(n))/lr;  z += g' - sigma*w;  n = n'
               w = (sign(z)*l1 - z) / ((beta + P(n'))/lr + q) - lr*dwd*w outside the dead zone,
               else 0 (OneFlow's P(n) = n^lr_power, q = lambda2, or TensorFlow's: optim.ftrl)

Weight-decay terms use the weight before the update. Every update reads float32 storage, computes
in float64 and rounds once per stored value. Over 20 steps this keeps every optimizer within
about 3e-7 (relative to the array's scale) of a float64 run, where float32 arithmetic drifts about
twice as far; the float64 pass costs 20-30% in the compiled kernels (Adam, Ftrl; measured).

Defaults are OneFlow's (``lr=0.001`` for all four, ``flow.optim.SGD/Adagrad/Adam`` and
``flow.one_embedding.Ftrl``), weight decay included: ``weight_decay`` is an L2 term added to the
gradient, as OneFlow's optimizers (``l2=weight_decay``) and PyTorch's apply it. AdamW's decoupled
form is ``weight_decay_mode="decoupled"`` (this library's default until issue 23). One difference
is on purpose: a momentum buffer starts at 0 (PyTorch copies the first gradient into it, which
differs only with ``dampening > 0``).

Two paths compute the same expressions in the same order: a compiled numba kernel per optimizer
for numpy arrays (``optim.kernels``: one pass, no temporaries, GIL released), and a vectorized
``xp`` path used for CuPy arrays, for numpy arrays that cannot be viewed as 2-D, and whenever
``use_compiled`` is False.
"""
from __future__ import annotations

import math

from one_embedding.errors import ConfigError
from one_embedding.optim import kernels
from one_embedding.optim.base import (DEFAULT_LR, WEIGHT_DECAY_MODES, RowOptimizer, as_f64,
                                      check_bool, check_real)
from one_embedding.optim.ftrl import Ftrl  # its own module (two conventions); importable here

__all__ = ["RowOptimizer", "SGD", "Adagrad", "Adam", "Ftrl", "check_real", "DEFAULT_LR",
           "WEIGHT_DECAY_MODES"]


_f64 = as_f64


# ----------------------------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------------------------
class SGD(RowOptimizer):
    """Stochastic gradient descent, with heavy-ball or Nesterov momentum when ``momentum > 0``.

    Arguments and defaults as OneFlow's ``flow.optim.SGD(params, lr=0.001, momentum=0.0,
    dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)``. State: none, or ``[m]``
    (starts at 0) with momentum. OneFlow's size_factor: 1 or 2.
    """

    def __init__(self, params=None, lr: float = DEFAULT_LR, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 maximize: bool = False, *, weight_decay_mode: str | None = None):
        super().__init__(params, lr, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode, maximize=maximize)
        self.momentum = check_real("SGD", "momentum", momentum, 0.0, 1.0, high_open=True)
        self.dampening = check_real("SGD", "dampening", dampening, 0.0, 1.0)
        self.nesterov = check_bool("SGD", "nesterov", nesterov)
        if self.nesterov and (self.momentum == 0.0 or self.dampening != 0.0):
            raise ConfigError(f"SGD: nesterov=True needs momentum > 0 and dampening=0 (got "
                              f"momentum={momentum!r}, dampening={dampening!r})")
        if self.momentum == 0.0 and self.dampening != 0.0:
            raise ConfigError(f"SGD: dampening={dampening!r} without momentum does nothing: set "
                              "momentum > 0, or leave dampening at 0")
        self.n_states = 1 if self.momentum > 0.0 else 0
        self.state_names = ("momentum",) if self.n_states else ()

    def initial_state(self) -> tuple[float, ...]:
        return (0.0,) * self.n_states

    def _kernel(self, w, states, g, lr, t, factor):
        if self.n_states:
            kernels.momentum_kernel(w, states[0], g, factor, self._l2(), lr, self.momentum,
                                    1.0 - self.dampening, self.nesterov, lr * self._decoupled())
        else:
            kernels.sgd_kernel(w, g, factor, lr, self.weight_decay)

    def _vectorized(self, xp, w, states, g, lr, t, factor):
        w64 = _f64(xp, w)
        if self.n_states:
            g64 = self._scaled_grad(xp, g, w64, factor, self._l2())
            m = states[0]
            m64 = _f64(xp, m)
            m64 *= self.momentum
            m64 += (1.0 - self.dampening) * g64
            m[...] = m64
            if self.nesterov:
                m64 *= self.momentum
                m64 += g64
            m64 *= lr
            out = w64 - m64
            decay = self._decoupled()
            if decay:
                w64 *= lr * decay
                out -= w64
        else:
            upd = _f64(xp, g)
            upd *= factor
            if self.weight_decay:
                upd += self.weight_decay * w64
            upd *= lr
            out = w64
            out -= upd
        w[...] = out


class Adagrad(RowOptimizer):
    """Adagrad with PyTorch's ``lr_decay``: ``clr = lr / (1 + (t-1)*lr_decay)``.

    Arguments and defaults as OneFlow's ``flow.optim.Adagrad(params, lr=0.001, lr_decay=0.0,
    weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10)``. State: ``[s]``, the running
    sum of squared gradients, starting at ``initial_accumulator_value``.
    """

    n_states = 1
    state_names = ("sum_sq",)

    def __init__(self, params=None, lr: float = DEFAULT_LR, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, *, maximize: bool = False,
                 weight_decay_mode: str | None = None):
        super().__init__(params, lr, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode, maximize=maximize)
        self.lr_decay = check_real("Adagrad", "lr_decay", lr_decay, low=0.0)
        self.initial_accumulator_value = check_real(
            "Adagrad", "initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.eps = check_real("Adagrad", "eps", eps, low=0.0, low_open=True)

    def initial_state(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value,)

    def _clr(self, lr: float, t: int) -> float:
        return lr / (1.0 + (t - 1) * self.lr_decay)

    def _kernel(self, w, states, g, lr, t, factor):
        clr = self._clr(lr, t)
        kernels.adagrad_kernel(w, states[0], g, factor, self._l2(), clr, self.eps,
                               clr * self._decoupled())

    def _vectorized(self, xp, w, states, g, lr, t, factor):
        clr = self._clr(lr, t)
        s = states[0]
        w64 = _f64(xp, w)
        g64 = self._scaled_grad(xp, g, w64, factor, self._l2())
        s64 = _f64(xp, s)
        s64 += g64 * g64
        s[...] = s64
        xp.sqrt(s64, out=s64)
        s64 += self.eps
        g64 *= clr
        g64 /= s64
        out = w64 - g64
        decay = self._decoupled()
        if decay:
            w64 *= clr * decay
            out -= w64
        w[...] = out


class Adam(RowOptimizer):
    """Adam, bias-corrected by the global step; AMSGrad with ``amsgrad=True``.

    Arguments and defaults as OneFlow's ``flow.optim.Adam(params, lr=0.001, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0.0, amsgrad=False, do_bias_correction=True)``. ``weight_decay`` is an
    L2 term in the gradient (Adam's, OneFlow's) unless ``weight_decay_mode="decoupled"`` (AdamW's
    ``lr*wd*w``).
    State: ``[m, v]``, both starting at 0, and ``v_max`` (starting at 0) with amsgrad, so an
    embedding needs size_factor 3, or 4 with amsgrad (OneFlow's embeddings refuse amsgrad).
    """

    n_states = 2
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params=None, lr: float = DEFAULT_LR, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 do_bias_correction: bool = True, *, maximize: bool = False,
                 weight_decay_mode: str | None = None):
        super().__init__(params, lr, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode, maximize=maximize)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ConfigError(f"Adam: betas={betas!r} must be a pair (beta1, beta2), "
                              "e.g. (0.9, 0.999)") from None
        self.betas = (check_real("Adam", "betas[0]", b1, 0.0, 1.0, high_open=True),
                      check_real("Adam", "betas[1]", b2, 0.0, 1.0, high_open=True))
        self.eps = check_real("Adam", "eps", eps, low=0.0, low_open=True)
        self.amsgrad = check_bool("Adam", "amsgrad", amsgrad)
        self.do_bias_correction = check_bool("Adam", "do_bias_correction", do_bias_correction)
        if self.amsgrad:
            self.n_states = 3
            self.state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def initial_state(self) -> tuple[float, ...]:
        return (0.0,) * self.n_states

    def _corrections(self, lr: float, t: int) -> tuple[float, float]:
        """(lr/bc1, 1/sqrt(bc2)) of step t, with bc_i = 1 - beta_i^t."""
        if not self.do_bias_correction:
            return lr, 1.0
        b1, b2 = self.betas
        return lr / (1.0 - b1 ** t), 1.0 / math.sqrt(1.0 - b2 ** t)

    def _kernel(self, w, states, g, lr, t, factor):
        step_size, inv_sqrt_bc2 = self._corrections(lr, t)
        b1, b2 = self.betas
        v_max = states[2] if self.amsgrad else states[1]
        kernels.adam_kernel(w, states[0], states[1], v_max, g, factor, self._l2(), b1, b2,
                            step_size, inv_sqrt_bc2, self.eps, lr * self._decoupled(),
                            self.amsgrad)

    def _vectorized(self, xp, w, states, g, lr, t, factor):
        step_size, inv_sqrt_bc2 = self._corrections(lr, t)
        b1, b2 = self.betas
        m, v = states[0], states[1]
        w64 = _f64(xp, w)
        g64 = self._scaled_grad(xp, g, w64, factor, self._l2())
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
        if self.amsgrad:
            v_max = states[2]
            xp.maximum(_f64(xp, v_max), v64, out=v64)
            v_max[...] = v64
        xp.sqrt(v64, out=v64)
        v64 *= inv_sqrt_bc2
        v64 += self.eps
        m64 /= v64
        m64 *= step_size
        out = w64 - m64
        decay = self._decoupled()
        if decay:
            w64 *= lr * decay
            out -= w64
        w[...] = out
