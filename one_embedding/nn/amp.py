"""Mixed precision (AMP): the dense model's matrix products in fp16 or bf16, the rest in fp32.

::

    with amp.autocast("fp16"):            # or "bf16"; "off" (the default) changes nothing
        logits = model(dense, ids)
        ...
        model.backward(dlogits * scaler.scale)

Inside ``autocast`` the products of the dense model — every Linear layer's ``x Wᵀ`` and its two
backward products, and the dot interaction (inputs and pairwise dot products) — take operands
rounded to the half type and give results rounded to it, as PyTorch's ``torch.autocast`` runs
matmuls in half precision. Everything else stays fp32: the master weights and biases, the
optimizer state, the embedding rows in the store and their optimizer state ("fp32 master rows"),
bias + activation passes, DCN's cross layers and FM's sums, the loss. Weight gradients are
accumulated in fp32.

fp16 (5 exponent bits) underflows small gradients: train it with a loss scale
(``optim.LossScaler``; the Trainer does this for ``--amp fp16``). bf16 has fp32's exponent range
and needs none.

How the products run:

- CuPy, fp16: real float16 operands (``astype(float16)``), so cuBLAS runs the GEMM on tensor
  cores with fp32 accumulation and a float16 result, cast back to fp32.
- numpy (and bf16 on CuPy, which has no bfloat16 dtype): the operands rounded to the half type's
  values (round to nearest even) and multiplied by the fp32 BLAS — the numbers tensor cores
  multiply, accumulated in fp32 — then the result rounded likewise. It differs from the GPU only
  in summation order, and gives CPU runs the numerics of a GPU run, not its speed (the rounding
  passes cost time).
"""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError

#: the choices of ``autocast`` and of ``--amp``
PRECISIONS = ("off", "fp16", "bf16")

_current = contextvars.ContextVar("one_embedding_amp", default="off")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"amp={precision!r}: use one of {', '.join(PRECISIONS)} (off: fp32 "
                          "everywhere; fp16 / bf16: the dense model's matrix products in half "
                          "precision, master weights and rows in fp32)")
    return precision


@contextlib.contextmanager
def autocast(precision: str = "fp16"):
    """Run the dense model's products in ``precision`` ("off", "fp16", "bf16") inside the block
    (this thread / task only; nesting restores the outer setting)."""
    token = _current.set(check_precision(precision))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str:
    """The precision in effect here: "off", "fp16" or "bf16"."""
    return _current.get()


def active() -> bool:
    return _current.get() != "off"


def round_to(x, precision: str | None = None):
    """``x`` (float32 or float64 array) with every value rounded to the nearest ``precision``
    value (ties to even), in ``x``'s dtype; a new array. Overflow gives ±inf, as the half type
    would; NaN stays NaN."""
    precision = current() if precision is None else check_precision(precision)
    if precision == "off":
        return x
    xp = array_namespace(x)
    if precision == "fp16":
        with np.errstate(over="ignore"):  # overflow is ±inf, as in fp16 (the loss scale backs off)
            return x.astype(xp.float16).astype(x.dtype)
    # bf16: the top 16 bits of the float32, rounded to nearest even on the 16 dropped ones
    f = x.astype(xp.float32)
    bits = f.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) \
        & xp.uint32(0xFFFF0000)
    # NaN payloads may carry into the exponent: keep NaN as the canonical quiet NaN
    rounded = xp.where(xp.isnan(f), xp.uint32(0x7FC00000), rounded)
    return rounded.view(xp.float32).astype(x.dtype, copy=False)


def matmul(a, b):
    """``a @ b`` with the current precision's operands and result (see the module docstring);
    exactly ``a @ b`` when AMP is off. a: (..., M, K), b: (..., K, N) or (K,)."""
    precision = current()
    if precision == "off":
        return a @ b
    xp = array_namespace(a, b)
    if precision == "fp16" and xp is not np:
        return (a.astype(xp.float16) @ b.astype(xp.float16)).astype(a.dtype)
    return round_to(round_to(a, precision) @ round_to(b, precision), precision)
