"""Criteo's column layout, the categorical key scheme, the dense transform and the ``Batch`` type.

Key scheme (how a raw hex categorical becomes a globally unique int64 key):

* ``mode="mod"`` (OneFlow's Parquet scheme): ``key = (value % mod) + mod * column`` for column
  ``0..25`` (C1..C26), where ``value`` is the hex field read as an unsigned integer. The default
  ``mod = 2**32`` is lossless for Criteo's 8-character hex, and a wider value (9-16 hex digits,
  data hashed to 64 bits) gets a key of its own, ``XXH64(value, seed=column) | 2**63``, instead
  of folding; ``mod = 40_000_000`` reproduces OneFlow's DLRM files (``--mod_idx 40000000``),
  folding wide values as they do. A missing field gets the reserved key
  ``mod * 26 + column``, one per column, beyond every column's range, so it never collides with a
  real value.
* ``mode="hash"``: ``key = XXH64(value as 8 little-endian bytes, seed=column) & (2**63 - 1)``; a
  missing field gets ``XXH64(b"", seed=column) & (2**63 - 1)``. Collisions across columns are
  possible only with probability ~2**-63 per pair.

Dense transform: ``dense = log(max(x, 0) + 1)`` as float32, missing -> 0. Negative integers (I2 goes
down to -3) are clamped to 0 first because ``log(x + 1)`` is undefined at -1 and below; this matches
OneFlow's Parquet (``raw + 1`` with missing -> 1) after its training-time ``log``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import ConfigError, InputError
from ..hashing import splitmix64 as _splitmix64
from ..hashing import xxh64_empty, xxh64_u64  # noqa: F401  (xxh64_u64: one_embedding.data's name)

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABEL_COLUMN = "label"

# Per-column cardinalities of C1..C26 (REFERENCE.md "Criteo").
CRITEO_CARDINALITIES: dict[str, tuple[int, ...]] = {
    # MLPerf DLRMv2 on Criteo 1TB, every column capped at 40M (204,184,588 rows in all).
    "mlperf40m": (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
                  405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
                  12973, 108, 36),
    # MLPerf v1 / OneFlow DLRM defaults on Criteo 1TB.
    "mlperf_v1": (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546,
                  403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935,
                  12972, 108, 36),
    # Criteo Kaggle (Display Advertising Challenge) train.txt.
    "kaggle": (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572),
}

_MASK63 = np.uint64((1 << 63) - 1)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 on uint64 (``hashing.splitmix64`` with numpy): the row hash behind splits and
    the synthetic data. x: (...) uint64 -> (...) uint64."""
    return _splitmix64(np, x)


@dataclasses.dataclass(frozen=True)
class KeyScheme:
    """How raw hex categoricals map to global int64 keys (see the module docstring).

    mode: "mod" or "hash"; mod: range size per column in "mod" mode (ignored by "hash").
    """

    mode: str = "mod"
    mod: int = 1 << 32

    def __post_init__(self):
        if self.mode not in ("mod", "hash"):
            raise ConfigError(f"KeyScheme mode={self.mode!r}: use 'mod' or 'hash'")
        if self.mode == "mod":
            if not isinstance(self.mod, (int, np.integer)) or self.mod < 1:
                raise ConfigError(f"KeyScheme mod={self.mod!r}: use a positive integer, e.g. 2**32")
            if (self.mod * (NUM_SPARSE + 1)) >= (1 << 63):
                raise ConfigError(f"KeyScheme mod={self.mod} overflows int64 over 26 columns: "
                                  f"use mod <= {((1 << 63) - 1) // (NUM_SPARSE + 1)}")

    def missing_keys(self) -> np.ndarray:
        """The reserved key of each column for a missing field: (26,) int64."""
        cols = np.arange(NUM_SPARSE, dtype=np.int64)
        if self.mode == "mod":
            return np.int64(self.mod) * NUM_SPARSE + cols
        return np.array([xxh64_empty(c) & ((1 << 63) - 1) for c in range(NUM_SPARSE)], np.int64)

    @property
    def keeps_wide_values(self) -> bool:
        """Values of more than 32 bits get keys of their own (the default range 2**32, and
        "hash"); a custom "mod" range below it folds them, as OneFlow's ``--mod_idx`` does."""
        return self.mode == "hash" or self.mod >= 1 << 32

    def keys(self, values: np.ndarray, present: np.ndarray) -> np.ndarray:
        """Global keys from parsed hex values.

        values: (N, 26) uint64 raw hex values; present: (N, 26) bool (False = missing field).
        Returns (N, 26) int64.

        Under ``mode="mod"`` with the default range 2**32, a value of 9-16 hex digits (>= 2**32)
        is not folded: it gets ``XXH64(value, seed=column) | 2**63`` (a negative int64), a range
        no 32-bit value, missing field or other column reaches, distinct from every other wide
        value up to a 64-bit hash collision. Values below 2**32 keep ``value + mod * column``.
        """
        cols = np.arange(NUM_SPARSE, dtype=np.uint64)
        if self.mode == "mod":
            mod = np.uint64(self.mod)
            out = (values % mod + mod * cols).astype(np.int64)
            wide = values >= mod
            if self.keeps_wide_values and wide.any():
                hashed = xxh64_u64(values, cols) | np.uint64(1 << 63)
                out = np.where(wide, hashed.view(np.int64), out)
        else:
            out = (xxh64_u64(values, cols) & _MASK63).astype(np.int64)
        return np.where(present, out, self.missing_keys()[None, :])


def dense_log(raw: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
    """``log(max(x, 0) + 1)`` as float32, missing -> 0.

    raw: (N, 13) int64 or float; present: optional (N, 13) bool. Returns (N, 13) float32.
    """
    x = np.maximum(np.asarray(raw, dtype=np.float64), 0.0)
    if present is not None:
        x = np.where(present, x, 0.0)
    return np.log1p(x).astype(np.float32)


@dataclasses.dataclass
class Batch:
    """One training batch.

    dense: (B, 13) float32, already ``log(x + 1)``-transformed;
    ids: (B, F) int64 global keys, F = 26 for Criteo (column c of ids feeds table c);
    labels: (B,) float32 in {0, 1}, NaN for an unlabelled source (Kaggle test.txt).
    """

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __post_init__(self):
        b = self.labels.shape[0]
        if self.dense.shape != (b, NUM_DENSE) or self.ids.shape[0] != b or self.ids.ndim != 2:
            raise InputError(f"Batch shapes dense={self.dense.shape} ids={self.ids.shape} "
                             f"labels={self.labels.shape}: want (B, 13), (B, F), (B,)")


def resolve_cardinalities(cardinalities, scale: float = 1.0) -> tuple[int, ...]:
    """A named list ("mlperf40m", "mlperf_v1", "kaggle") or a custom sequence, scaled.

    Each scaled cardinality is ``max(1, round(c * scale))``. Returns a tuple of 26 ints (or
    len(custom)).
    """
    if isinstance(cardinalities, str):
        if cardinalities not in CRITEO_CARDINALITIES:
            raise ConfigError(f"cardinalities={cardinalities!r}: use one of "
                              f"{sorted(CRITEO_CARDINALITIES)} or a list of ints")
        base = CRITEO_CARDINALITIES[cardinalities]
    else:
        base = tuple(int(c) for c in cardinalities)
        if not base or any(c < 1 for c in base):
            raise ConfigError(f"cardinalities={list(base)}: every cardinality must be >= 1")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ConfigError(f"scale={scale!r}: use a positive finite number, e.g. 0.01")
    return tuple(max(1, int(round(c * scale))) for c in base)
