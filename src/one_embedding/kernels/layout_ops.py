"""The dot interaction's input laid out once: rows gathered straight into it.

DLRM's interaction reads X = [z, emb_1, ..., emb_F] (B, F + 1, E). Without this module the
embedding gathers its rows into a (B, F, E) float32 array and the interaction stacks z in front
of it (a concatenation on the fp32 GPU path) and rounds every operand to the AMP type. Here one
buffer, ``InteractionInput.data`` (B, S, E), is the interaction's input: the embedding's gather
writes its rows at slots ``first_slot ..`` and the model writes z at slot 0, each cast to the
buffer's storage on the way in:

    precision "off" / "tf32"   float32 values (the tf32 rounding stays in the interaction's kernel)
    precision "fp16" / "bf16"  uint16: the 16-bit patterns of the values rounded to the type
                               (nearest even, nn.amp.round_to), half the bytes to write and read

The interaction rounds its operands to the precision anyway, and rounding is idempotent, so the
results are the same bits as the gather + concatenation + cast they replace.

Every launching function takes ``launch``, a ``device_ops.Launcher`` (the kernel is
``embedding_gather_into`` in ``cuda/embedding.cu``, or ``embedding_gather_into_vector`` at 16
bytes per thread where the layout allows it); ``launch=None`` runs the numpy twin on numpy
arrays (the CPU model of the dry run, and the reference the kernel is tested against).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .device_ops import Launcher, device_array, launch_threads, vector_lanes
from .precision import HALF_PRECISIONS, check_precision, from_bits, round_to

#: kernels/cuda/precision.cuh's kind codes of the 16-bit types
_KINDS = {"fp16": 1, "bf16": 2}


def storage_dtype(precision: str) -> np.dtype:
    """The dtype of an interaction input under ``precision``: uint16 (the 16-bit patterns) for
    fp16 / bf16, float32 otherwise."""
    return np.dtype(np.uint16 if check_precision(precision) in HALF_PRECISIONS else np.float32)


@dataclass
class InteractionInput:
    """The dot interaction's input buffer (see the module docstring).

    data: (B, S, E) ``storage_dtype(precision)``; precision: the AMP precision it was cast for
    (the interaction refuses another); first_slot: the slot of the first embedding (the slots
    before it are the model's own features: DLRM's z at 0); launch: the ``Launcher`` whose arrays
    ``data`` are (None: numpy, filled by the numpy twins)."""

    data: object
    precision: str
    first_slot: int
    launch: Launcher | None = None

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    def values(self):
        """The values as float32 (B, S, E): ``data`` itself, or the 16-bit patterns decoded
        (exactly: every fp16 / bf16 value is a float32)."""
        return decode(self.data, self.precision)


def empty_input(xp, batch: int, slots: int, dim: int, precision: str, first_slot: int,
                launch: Launcher | None = None) -> InteractionInput:
    """An unfilled ``InteractionInput`` of (batch, slots, dim) on array module ``xp``."""
    data = xp.empty((int(batch), int(slots), int(dim)), dtype=storage_dtype(precision))
    return InteractionInput(data, precision, int(first_slot), launch)


def encode(values, precision: str):
    """values: float32 array -> its storage under ``precision`` (numpy or CuPy, elementwise): the
    float32 itself, or the uint16 patterns of the values rounded to fp16 / bf16."""
    if check_precision(precision) not in HALF_PRECISIONS:
        return values.astype(np.float32, copy=False)
    if precision == "fp16":
        with np.errstate(over="ignore"):   # overflow is ±inf, as in the kernel
            return values.astype(np.float16).view(np.uint16)
    rounded = round_to(values.astype(np.float32, copy=False), "bf16")
    return (rounded.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def decode(data, precision: str):
    """The inverse of ``encode``: storage -> float32 values (exact)."""
    if check_precision(precision) not in HALF_PRECISIONS:
        return data
    if data.dtype != np.uint16:
        raise InputError(f"interaction input of dtype {data.dtype} under {precision}: expected the "
                         "uint16 patterns that storage_dtype gives")
    return from_bits(data, precision)


def _check_target(target: InteractionInput, batch: int, n_features: int, slot: int, dim: int):
    data = target.data
    want = storage_dtype(target.precision)
    if data.ndim != 3 or data.dtype != want or not data.flags.c_contiguous:
        raise InputError(f"interaction input of shape {tuple(data.shape)} and dtype {data.dtype}: "
                         f"expected a C-contiguous (B, S, E) {want} array for {target.precision}")
    b, slots, e = data.shape
    if b != batch or e != dim or slot < 0 or slot + n_features > slots:
        raise InputError(f"{n_features} feature(s) of dim {dim} for {batch} samples at slot {slot} "
                         f"do not fit the interaction input of shape {tuple(data.shape)}")


def gather_into(rows, index, target: InteractionInput, first_slot: int,
                launch: Launcher | None = None, columns: int | None = None,
                vector: bool = True) -> None:
    """rows: (U, E) float32, index: (B, F) int64 into rows (< 0: a zero row) -> writes
    ``rows[index]`` cast to the target's storage into ``target.data[:, first_slot:first_slot + F]``.
    ``columns``: the first ``columns`` of each row of wider rows (whole lines, read in place).
    ``vector``: as ``device_ops.gather_rows``'s (False: the one-element-per-thread kernel always).

    The twin of ``gather_rows`` + stacking + ``encode``, bit for bit."""
    batch, n_features = index.shape
    if columns is not None and launch is None:
        rows = rows[:, :columns]
    dim = rows.shape[1] if columns is None else int(columns)
    _check_target(target, batch, n_features, first_slot, dim)
    if launch is None:
        values = np.zeros(index.shape + (dim,), np.float32)
        hit = index >= 0
        values[hit] = rows[index[hit]]
        target.data[:, first_slot:first_slot + n_features] = encode(values, target.precision)
        return
    _launch(launch, rows, index.reshape(-1), True, batch * n_features, n_features, target,
            first_slot, dim, vector)


def write_slot(x, target: InteractionInput, slot: int, launch: Launcher | None = None) -> None:
    """x: (B, E) float32 -> ``target.data[:, slot]`` = x cast to the target's storage (the bottom
    MLP's output into slot 0)."""
    batch, dim = x.shape
    _check_target(target, batch, 1, slot, dim)
    if launch is None:
        target.data[:, slot] = encode(x, target.precision)
        return
    _launch(launch, x, None, False, batch, 1, target, slot)


def _launch(launch, src, index, has_index, n_rows, per_sample, target, first_slot, dim=None,
            vector=True):
    xp = launch.xp
    src = device_array(launch, "rows", src, np.float32, ndim=2)
    dim = src.shape[1] if dim is None else dim
    if not 0 <= dim <= src.shape[1]:
        raise InputError(f"{dim} columns of rows of {src.shape[1]}")
    index = (device_array(launch, "index", index, np.int64) if has_index
             else xp.zeros((1,), dtype=xp.int64))
    half = target.precision in HALF_PRECISIONS
    data = device_array(launch, "interaction input", target.data, target.data.dtype, writable=True)
    unused_float = xp.empty((1,), dtype=xp.float32)
    unused_bits = xp.empty((1,), dtype=xp.uint16)
    # 16 bytes per thread where the layout allows it: dim and the row length multiples of 4,
    # rows at a 16-byte aligned address, the buffer at 16 (float32) or 8 (4 fp16 / bf16
    # patterns); each row's slot then starts on a vector boundary too (its offset is a multiple
    # of dim)
    lanes = vector_lanes(np.float32, (dim, src.shape[1]), (src,) if half else (src, data),
                         data if half else None) if vector else 0
    groups, row = (dim // lanes, src.shape[1] // lanes) if lanes else (dim, src.shape[1])
    args = (src, np.int32(groups), np.int32(row), index, np.int32(bool(has_index)),
            np.int64(n_rows), np.int32(per_sample), np.int32(data.shape[1]),
            np.int32(first_slot), np.int32(_KINDS.get(target.precision, 0)),
            unused_float if half else data, data if half else unused_bits)
    if lanes:
        launch_threads(launch, "embedding", "gather_into_vector", np.float32, n_rows * groups, args)
    else:
        launch_threads(launch, "embedding", "gather_into", np.float32, n_rows * groups, args)
