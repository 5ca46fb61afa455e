"""Factorization machine, second order, summed to one logit per sample.

out[b] = Σ_d 0.5 * ((Σ_f x[b,f,d])² - Σ_f x[b,f,d]²) = Σ_{f<g} <x_f, x_g>
(a faithful DeepFM sums over d; REFERENCE.md notes OneFlow's script does not).
"""
from __future__ import annotations

from ..backend import array_namespace
from ..errors import InputError
from ..kernels import ops_for
from .module import Module, check_features, keeps_activations


class FactorizationMachine(Module):
    """x: (B, F, D) -> (B,); no parameters; keeps the input dtype."""

    def __init__(self):
        self._x = None

    def forward(self, x):
        check_features(x, "FM input", 3)
        xp = array_namespace(x)
        x = xp.ascontiguousarray(x)
        if keeps_activations():
            self._x = x
        return ops_for(xp).fm_forward(x)

    def backward(self, dout):
        """dout: (B,) -> dx (B, F, D)."""
        if self._x is None:
            raise InputError("FactorizationMachine.backward() without a forward(): run forward first")
        check_features(dout, "FM output gradient", 1, self._x.shape[0], axis=0)
        dx = ops_for(array_namespace(dout, self._x)).fm_backward(dout, self._x)
        self._x = None
        return dx
