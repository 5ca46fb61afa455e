"""The number formats of mixed precision, below the layers that use them (``nn.amp``) and the
kernels' glue (``kernels.gemm``, ``kernels.dense_ops``): the precision names and rounding a
float array to a precision's values, on numpy or CuPy arrays."""
from __future__ import annotations

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError

#: the choices of ``autocast`` and of ``--amp``
PRECISIONS = ("off", "tf32", "fp16", "bf16")
#: the precisions whose products give half-typed results (and whose operands are 16-bit)
HALF_PRECISIONS = ("fp16", "bf16")

def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"amp={precision!r}: use one of {', '.join(PRECISIONS)} (off: fp32 "
                          "everywhere; tf32 / fp16 / bf16: the dense model's matrix products on "
                          "tensor cores, master weights and rows in fp32)")
    return precision


def _float32_round_to_odd(x, xp):
    """float64 ``x`` -> float32, rounded to odd: truncated toward zero, its last bit set where
    that was inexact. Rounding this to a narrower format (bf16, tf32: at least two bits fewer)
    gives the nearest value of ``x`` itself, where going through the nearest float32 would round
    twice (1 + 2**-8 + 2**-30 became a tie, then 1.0 in bf16)."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(xp.float32)
        back = f.astype(xp.float64)
        inexact = (back != x) & ~xp.isnan(x)
        f = xp.where(inexact & (xp.abs(back) > xp.abs(x)), xp.nextafter(f, xp.float32(0)), f)
    return (f.view(xp.uint32) | inexact.astype(xp.uint32)).view(xp.float32)


def _round_bits(x, xp, dropped: int):
    """float32 or float64 ``x`` with the low ``dropped`` bits of a float32 mantissa rounded off
    (nearest, ties to even; float64 is rounded once, through ``_float32_round_to_odd``), NaN
    kept as the canonical quiet NaN; overflow rounds to ±inf."""
    f = _float32_round_to_odd(x, xp) if x.dtype == xp.float64 else x.astype(xp.float32)
    bits = f.view(xp.uint32)
    half = xp.uint32((1 << (dropped - 1)) - 1)
    keep = xp.uint32((0xFFFFFFFF << dropped) & 0xFFFFFFFF)
    rounded = (bits + half + ((bits >> xp.uint32(dropped)) & xp.uint32(1))) & keep
    # NaN payloads may carry into the exponent: keep NaN as the canonical quiet NaN
    rounded = xp.where(xp.isnan(f), xp.uint32(0x7FC00000), rounded)
    return rounded.view(xp.float32).astype(x.dtype, copy=False)


def round_to(x, precision: str):
    """``x`` (float32 or float64 array) with every value rounded to the nearest ``precision``
    value (ties to even), in ``x``'s dtype; a new array ("off": ``x`` itself). Overflow gives
    ±inf, as the narrow type would; NaN stays NaN. tf32 keeps 10 mantissa bits and fp32's
    exponent (fp32's subnormals stay, as in a tensor core's TF32 input)."""
    precision = check_precision(precision)
    if precision == "off":
        return x
    xp = array_namespace(x)
    if precision == "fp16":
        with np.errstate(over="ignore"):  # overflow is ±inf, as in fp16 (the loss scale backs off)
            return x.astype(xp.float16).astype(x.dtype)
    # bf16: the top 16 bits of the float32; tf32: the top 19 (sign, 8 exponent, 10 mantissa)
    return _round_bits(x, xp, 16 if precision == "bf16" else 13)


def from_bits(bits, precision: str):
    """uint16 patterns of fp16 / bf16 values (numpy or CuPy, any shape) -> those values as
    float32, exactly (every fp16 and bf16 value is a float32 value)."""
    if precision not in HALF_PRECISIONS:
        raise ConfigError(f"from_bits under precision={precision!r}: 16-bit patterns are fp16 "
                          "or bf16 values")
    xp = array_namespace(bits)
    if bits.dtype != np.uint16:
        raise ConfigError(f"from_bits of a {bits.dtype} array: pass the uint16 patterns")
    if precision == "fp16":
        return bits.view(xp.float16).astype(xp.float32)
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
