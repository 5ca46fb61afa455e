"""Compiled CPU updates of the row optimizers: 2-D arrays of any strides, float64 arithmetic, one
rounding per stored value, the GIL released.

Each kernel first forms the gradient term ``gi = g*factor`` (factor = grad_scale, negated with
maximize; 1.0 multiplies exactly) and adds ``l2*w`` only when ``l2`` is non-zero, so a run without
L2 decay computes exactly what it did before the term existed. The vectorized ``xp`` paths in
``row_optimizers`` evaluate the same expressions in the same order.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def sgd_kernel(w, g, factor, lr, wd):
    # wd*w inside the bracket is both the decoupled and the L2 form: lr*(g + wd*w).
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            w[i, j] = wi - lr * (np.float64(g[i, j]) * factor + wd * wi)


@njit(cache=True, nogil=True)
def momentum_kernel(w, m, g, factor, l2, lr, beta, keep, nesterov, lr_wd):
    # keep = 1 - dampening; nesterov steps along g + beta*m instead of m.
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j]) * factor
            if l2 != 0.0:
                gi = gi + l2 * wi
            mi = beta * np.float64(m[i, j]) + keep * gi
            m[i, j] = mi
            if nesterov:
                mi = gi + beta * mi
            w[i, j] = wi - lr * mi - lr_wd * wi


@njit(cache=True, nogil=True)
def adagrad_kernel(w, s, g, factor, l2, clr, eps, clr_wd):
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j]) * factor
            if l2 != 0.0:
                gi = gi + l2 * wi
            si = np.float64(s[i, j]) + gi * gi
            s[i, j] = si
            w[i, j] = wi - clr * gi / (math.sqrt(si) + eps) - clr_wd * wi


@njit(cache=True, nogil=True)
def adam_kernel(w, m, v, v_max, g, factor, l2, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd,
                amsgrad):
    # v_max is read and written only with amsgrad (callers pass v itself otherwise).
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j]) * factor
            if l2 != 0.0:
                gi = gi + l2 * wi
            mi = b1 * np.float64(m[i, j]) + (1.0 - b1) * gi
            vi = b2 * np.float64(v[i, j]) + (1.0 - b2) * (gi * gi)
            m[i, j] = mi
            v[i, j] = vi
            if amsgrad:
                vi = max(np.float64(v_max[i, j]), vi)
                v_max[i, j] = vi
            w[i, j] = wi - step_size * (mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)) - lr_wd * wi


@njit(cache=True, nogil=True)
def _powered(n, power):
    # +-0.5 as sqrt and 1/sqrt: correctly rounded, so numpy, numba and CUDA agree bit for bit
    if power == 0.5:
        return math.sqrt(n)
    if power == -0.5:
        return 1.0 / math.sqrt(n)
    return n ** power


@njit(cache=True, nogil=True)
def ftrl_kernel(w, acc, z, g, factor, l2, inv_lr, power, l1, quad_l2, beta, closed, lr_wd):
    # Both conventions (optim/ftrl.py): power = lr_power (OneFlow) or -lr_power (TensorFlow);
    # quad_l2 = lambda2 or 2*lambda2; closed: |z| == l1 is in the dead zone (TensorFlow).
    # Multiplying by 1/lr instead of dividing twice saves a quarter of the time.
    n, e = w.shape
    for i in range(n):
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j]) * factor
            if l2 != 0.0:
                gi = gi + l2 * wi
            ni = np.float64(acc[i, j])
            nn = ni + gi * gi
            p_old = _powered(ni, power)
            p_new = _powered(nn, power)
            zi = np.float64(z[i, j]) + gi - (p_new - p_old) * inv_lr * wi
            acc[i, j] = nn
            z[i, j] = zi
            if abs(zi) > l1 or (not closed and abs(zi) == l1):
                out = (math.copysign(l1, zi) - zi) / ((beta + p_new) * inv_lr + quad_l2)
                if lr_wd != 0.0:
                    out = out - lr_wd * wi
                w[i, j] = out
            else:
                w[i, j] = 0.0


@njit(cache=True, nogil=True)
def _powi(x, k):
    # x ** k for an integer k >= 0 by squaring: plain multiplications, so numpy, numba and CUDA
    # round alike (pow's last bit differs between libraries)
    result = 1.0
    while k > 0:
        if k & 1:
            result = result * x
        x = x * x
        k >>= 1
    return result


@njit(cache=True, nogil=True)
def smart_decay_adam_kernel(w, m, v, steps, g, factor, l2, b1, b2, lr, eps, t):
    # steps: (n, 2) uint32, each row's last-update step as little-endian int64 words; every
    # column of a row decays by the steps since then, and the row then records t.
    n, e = w.shape
    for i in range(n):
        k = t - np.int64((np.uint64(steps[i, 1]) << np.uint64(32)) | np.uint64(steps[i, 0]))
        b1k = _powi(b1, k)
        b2k = _powi(b2, k)
        back = _powi(b1, k - 1) if k > 1 else 1.0
        for j in range(e):
            wi = np.float64(w[i, j])
            gi = np.float64(g[i, j]) * factor
            if l2 != 0.0:
                gi = gi + l2 * wi
            mi = np.float64(m[i, j])
            catchup = mi * b1 * (1.0 - back) / (1.0 - b1) if k > 1 else 0.0
            mi = b1k * mi + (1.0 - b1) * gi
            vi = b2k * np.float64(v[i, j]) + (1.0 - b2) * (gi * gi)
            m[i, j] = mi
            v[i, j] = vi
            w[i, j] = wi - lr * (mi + catchup) / (math.sqrt(vi) + eps)
        steps[i, 0] = np.uint32(t & 0xFFFFFFFF)
        steps[i, 1] = np.uint32(t >> 32)
