"""Weight initializers of the dense layers; each draws from a numpy Generator (seeded by the model).

- ``"dlrm"`` (facebookresearch/dlrm): W ~ N(0, sqrt(2 / (fan_in + fan_out))),
  b ~ N(0, sqrt(1 / fan_out)).
- ``"glorot"``: W ~ U(+-sqrt(6 / (fan_in + fan_out))) (Glorot & Bengio 2010), b = 0.
  The scheme of the DCN and DeepFM models here: it keeps activations' variance roughly constant
  through ReLU stacks of equal width, and zero biases make the initial model unbiased.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError

SCHEMES = ("dlrm", "glorot")


def linear_weights(rng: np.random.Generator, fan_in: int, fan_out: int, scheme: str, dtype):
    """-> (W (fan_out, fan_in), b (fan_out,)) in ``dtype``, drawn in float64 then rounded once."""
    if scheme == "dlrm":
        w = rng.normal(0.0, np.sqrt(2.0 / (fan_in + fan_out)), size=(fan_out, fan_in))
        b = rng.normal(0.0, np.sqrt(1.0 / fan_out), size=fan_out)
    elif scheme == "glorot":
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        w = rng.uniform(-bound, bound, size=(fan_out, fan_in))
        b = np.zeros(fan_out)
    else:
        raise ConfigError(f"init={scheme!r} is not one of {SCHEMES}")
    return w.astype(dtype), b.astype(dtype)


def make_rng(seed) -> np.random.Generator:
    """A Generator from an int seed, a SeedSequence, or an existing Generator (used as is)."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)
