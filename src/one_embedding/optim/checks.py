"""Argument checks shared by the row optimizers, their parameter groups, LR schedules and loss
scalers: the lowest module of ``optim``, importing nothing from it (``base`` and ``groups`` both use
it, so neither imports the other for it)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from one_embedding.errors import ConfigError

__all__ = ["check_real", "check_bool"]


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


def check_bool(owner: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{owner}: {name}={value!r} must be True or False")
    return bool(value)
