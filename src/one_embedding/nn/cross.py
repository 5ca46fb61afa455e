"""DCN cross network: ``num_layers`` cross layers applied to x0.

- "vector" (DCN v1, weight w (D,)): x_{l+1} = x0 * (x_l · w) + b + x_l
- "matrix" (DCN v2, weight W (D, D)): x_{l+1} = (x_l Wᵀ + b) ⊙ x0 + x_l

Initialization (documented scheme of this library): weights Glorot-normal,
std = sqrt(2 / (fan_in + fan_out)) with (fan_in, fan_out) = (D, 1) for a vector and (D, D) for a
matrix; biases zero. With zero biases and small weights each layer starts near the identity plus a
small feature cross, which keeps deep stacks stable.
"""
from __future__ import annotations

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError, InputError
from ..kernels import ops_for
from .init import make_rng
from .linear import _check_dtype, _positive_int
from .module import Module, Parameter, check_features, keeps_activations

KINDS = ("vector", "matrix")


class CrossNet(Module):
    """x0: (B, dim) -> (B, dim) after ``num_layers`` cross layers of ``kind``."""

    def __init__(self, dim: int, num_layers: int, kind: str = "vector", *, seed=0, dtype=np.float32,
                 name: str = "cross"):
        if kind not in KINDS:
            raise ConfigError(f"cross kind={kind!r} is not one of {KINDS}")
        self.dim = _positive_int("dim", dim)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.kind = kind
        self.dtype = _check_dtype(dtype)
        rng = make_rng(seed)
        self.weights, self.biases = [], []
        for i in range(self.num_layers):
            if kind == "vector":
                w = rng.normal(0.0, np.sqrt(2.0 / (self.dim + 1)), size=self.dim)
            else:
                w = rng.normal(0.0, np.sqrt(1.0 / self.dim), size=(self.dim, self.dim))
            self.weights.append(Parameter(w.astype(self.dtype), f"{name}.{i}.weight"))
            self.biases.append(Parameter(np.zeros(self.dim, self.dtype), f"{name}.{i}.bias"))
        self._xs = None

    def _children(self):
        for w, b in zip(self.weights, self.biases):
            yield w
            yield b

    def forward(self, x0):
        """x0: (B, dim) -> x_L (B, dim)."""
        check_features(x0, "cross input", 2, self.dim, self.dtype)
        ops = ops_for(array_namespace(x0, self.weights[0].data))
        xs = [x0]
        for w, b in zip(self.weights, self.biases):
            if self.kind == "vector":
                xs.append(ops.cross_vector_forward(x0, xs[-1], w.data, b.data))
            else:
                xs.append(ops.cross_matrix_forward(x0, xs[-1], w.data, b.data))
        if keeps_activations():
            self._xs = xs[:-1]  # the inputs of each layer
        return xs[-1]

    def backward(self, dout):
        """dout: (B, dim) -> dx0 (B, dim); x0 feeds every layer, so its gradients sum."""
        if self._xs is None:
            raise InputError("CrossNet.backward() without a forward(): run forward first")
        check_features(dout, "cross output gradient", 2, self.dim, self.dtype)
        ops = ops_for(array_namespace(dout, self.weights[0].data))
        x0 = self._xs[0]
        dx0_total = None
        dxl = dout
        for i in reversed(range(self.num_layers)):
            w, b, xl = self.weights[i], self.biases[i], self._xs[i]
            if self.kind == "vector":
                dx0, dxl, dw, db = ops.cross_vector_backward(dxl, x0, xl, w.data)
            else:
                dx0, dxl, dw, db = ops.cross_matrix_backward(dxl, x0, xl, w.data, b.data)
            w.grad += dw
            b.grad += db
            if dx0_total is None:
                dx0_total = dx0
            else:
                dx0_total += dx0
        dx0_total += dxl  # layer 0's x_l is x0 itself
        self._xs = None
        return dx0_total
