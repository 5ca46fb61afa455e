"""The feature transform from raw Criteo features to a model's inputs, as training applied it.

Training records it in every checkpoint (``FeatureTransform.as_dict``) and serving applies the
same one to raw requests, so there is no training / serving skew:

* dense: (n, 13) raw integer features as float, NaN = missing -> ``schema.dense_log``:
  ``log(max(x, 0) + 1)`` as float32, missing -> 0 (the readers' and the synthetic source's
  transform);
* categorical: (n, 26) strings, "" = missing ->
  - ``kind="criteo"`` (TSV / Parquet training data): hex values (Criteo's 8 hex digits; up to 16)
    through the run's ``KeyScheme`` (``mod``: ``value % mod + mod * column``, a reserved key per
    column when missing; ``hash``: XXH64 per column);
  - ``kind="synthetic"``: the per-column value index as a decimal integer, ``0 <= v <
    cardinality``, keyed ``offset[column] + v`` as the synthetic source keys it (it has no missing
    values: "" is refused).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from .schema import NUM_DENSE, NUM_SPARSE, KeyScheme, dense_log

KINDS = ("criteo", "synthetic")


@dataclass(frozen=True)
class FeatureTransform:
    """kind: "criteo" or "synthetic"; key_scheme: {"mode", "mod"} (criteo); offsets /
    cardinalities: per column (synthetic)."""

    kind: str = "criteo"
    key_scheme: dict = field(default_factory=lambda: {"mode": "mod", "mod": 1 << 32})
    offsets: tuple = ()
    cardinalities: tuple = ()

    @classmethod
    def for_config(cls, cfg) -> "FeatureTransform":
        """The transform of a ``TrainConfig``'s data source."""
        if tuple(cfg.data) == ("synthetic",):
            from .synthetic import SyntheticCriteo

            source = SyntheticCriteo(cfg.synthetic_cardinalities, scale=cfg.synthetic_scale,
                                     alpha=cfg.zipf_alpha, seed=cfg.seed, num_rows=1)
            return cls("synthetic", offsets=tuple(int(o) for o in source.offsets),
                       cardinalities=tuple(int(c) for c in source.cardinalities))
        scheme = KeyScheme()
        return cls("criteo", key_scheme={"mode": scheme.mode, "mod": int(scheme.mod)})

    def as_dict(self) -> dict:
        return {"kind": self.kind, "dense": "log1p", "key_scheme": dict(self.key_scheme),
                "offsets": list(self.offsets), "cardinalities": list(self.cardinalities)}

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureTransform":
        if d.get("kind") not in KINDS:
            raise InputError(f"feature transform kind {d.get('kind')!r} is not one of {KINDS}")
        return cls(d["kind"], dict(d.get("key_scheme") or {}), tuple(d.get("offsets") or ()),
                   tuple(d.get("cardinalities") or ()))

    @property
    def num_sparse(self) -> int:
        return len(self.offsets) if self.kind == "synthetic" else NUM_SPARSE

    def dense(self, raw) -> np.ndarray:
        """raw (n, 13) numbers, NaN = missing -> (n, 13) float32 model input."""
        raw = np.asarray(raw)
        if raw.ndim != 2 or raw.shape[1] != NUM_DENSE:
            raise InputError(f"dense has shape {raw.shape}; expected (n, {NUM_DENSE}): Criteo's "
                             "I1..I13, NaN for a missing value")
        if raw.dtype.kind not in "fiu":
            raise InputError(f"dense has dtype {raw.dtype}; pass FP32 numbers (NaN = missing)")
        raw = raw.astype(np.float64)
        if np.isinf(raw).any():
            raise InputError("dense holds an infinite value: pass finite numbers, NaN = missing")
        present = ~np.isnan(raw)
        return dense_log(np.where(present, raw, 0.0), present)

    def keys(self, categorical) -> np.ndarray:
        """categorical (n, num_sparse) str / bytes, "" = missing -> (n, num_sparse) int64 ids."""
        fixed = isinstance(categorical, np.ndarray) and categorical.dtype.kind in "SU"
        cat = categorical if fixed else np.asarray(categorical, dtype=object)
        f = self.num_sparse
        if cat.ndim != 2 or cat.shape[1] != f:
            raise InputError(f"categorical has shape {cat.shape}; expected (n, {f}) strings "
                             '("" = missing)')
        base = 16 if self.kind == "criteo" else 10
        parsed = _parse_digits(cat, base)
        values, present = parsed if parsed is not None else \
            self._parse_each(cat.astype(object), base)
        if self.kind == "criteo":
            return KeyScheme(**self.key_scheme).keys(values, present)
        if not present.all():
            i, j = np.argwhere(~present)[0]
            raise InputError(f"categorical[{i}, {j}] is missing, but the synthetic source this "
                             "model was trained on has no missing values")
        card = np.array(self.cardinalities, np.uint64)
        over = values >= card[None, :]
        if over.any():
            i, j = np.argwhere(over)[0]
            raise InputError(f"categorical[{i}, {j}] = {int(values[i, j])} is outside column "
                             f"{j}'s 0..{int(card[j]) - 1}")
        return (values + np.array(self.offsets, np.uint64)[None, :]).astype(np.int64)

    @staticmethod
    def _parse_each(cat: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
        """cat (n, f) object -> (values (n, f) uint64, present (n, f) bool), one element at a
        time through ``int``: names the first element that is not a number."""
        n, f = cat.shape
        values = np.zeros((n, f), np.uint64)
        present = np.zeros((n, f), np.bool_)
        for (i, j), v in np.ndenumerate(cat):
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if not isinstance(v, str):
                raise InputError(f"categorical[{i}, {j}] is {v!r}: pass strings")
            if v == "":
                continue
            if not _PLAIN_DIGITS[base].fullmatch(v):  # int() would take " 7", "+7", "1_0", "٧"
                raise InputError(f"categorical[{i}, {j}] = {v!r} is not a "
                                 f"{'hex' if base == 16 else 'decimal'} value (ASCII digits "
                                 "only)")
            number = int(v, base)
            if not number < 1 << 64:
                raise InputError(f"categorical[{i}, {j}] = {v!r} does not fit 64 bits")
            values[i, j], present[i, j] = number, True
        return values, present


#: what the element-wise parse takes, per base: plain ASCII digits, as the column-wise one
_PLAIN_DIGITS = {10: re.compile(r"[0-9]+"), 16: re.compile(r"[0-9a-fA-F]+")}
#: digit value of each ASCII code (99: not a digit)
_DIGITS = np.full(128, 99, np.uint64)
_DIGITS[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_DIGITS[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_DIGITS[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
#: digits that always fit 64 bits, per base
_SAFE_WIDTH = {10: 19, 16: 16}


def _parse_digits(categorical, base: int):
    """(n, f) strings of plain digits ("" = missing) -> (values uint64, present bool), parsed
    column-wise by numpy; None where an element is anything else (a sign, spaces, "0x", too
    many digits, a non-string), which the element-wise parse handles or names."""
    cat = categorical
    if cat.dtype == object:
        kinds = {type(v) for v in cat.flat}
        if kinds not in ({str}, {bytes}):
            return None
        chars = sum(map(len, cat.flat))
        cat = cat.astype(str if kinds == {str} else bytes)
        if int(np.char.str_len(cat).sum()) != chars:  # a trailing NUL the cast dropped
            return None
    if cat.dtype.kind not in "SU" or cat.ndim != 2:
        return None
    n, f = cat.shape
    width = cat.dtype.itemsize // (4 if cat.dtype.kind == "U" else 1)
    if width == 0 or cat.size == 0:
        return np.zeros((n, f), np.uint64), np.zeros((n, f), np.bool_)
    if width > _SAFE_WIDTH[base]:
        return None
    codes = cat.view(np.uint32 if cat.dtype.kind == "U" else np.uint8).reshape(n, f, width)
    pad = codes == 0  # a fixed-width string ends at its first NUL
    if (codes >= 128).any():
        return None
    digits = _DIGITS[np.minimum(codes, 127)]
    if ((digits >= base) & ~pad).any() or (pad[:, :, :-1] & ~pad[:, :, 1:]).any():
        return None
    values = np.zeros((n, f), np.uint64)
    b = np.uint64(base)
    for k in range(width):
        values = np.where(pad[:, :, k], values, values * b + digits[:, :, k])
    return values, ~pad[:, :, 0]
